"""The routing-policy contract: typed inputs (a request, replica states, pool hits) and ranked candidates out.

Who calls what:
- ``router.ingress`` (live) and ``bench.simulate`` (simulated cluster) build a ``RouteRequest`` and a
  ``ClusterSnapshot`` from the cluster prefix view (``router.index``) and call ``PolicyRunner.decide``.
- ``PolicyRunner`` owns everything around a policy: timing, tie-breaks, the decision record and metrics.
- A ``RoutingPolicy`` ranks candidates and does nothing else: no I/O, no clocks, no global state other than what
  it is constructed with (an injected RNG for randomised policies).

Actions (DESIGN.md, "The walk of one request"):
- HOLDER    — the replica already holds a prefix in its HBM cache; it computes the rest.
- FETCH     — the replica pulls a prefix from a pool shard (``FetchPlan``) and computes the rest.
- RECOMPUTE — the replica computes the whole prompt.
- SPLIT     — the replica computes the head of the prefix while fetching its tail (``FetchPlan.start_block`` > 0).

The values a decision builds many of (replica states, pool hits, candidates, fetch plans, the snapshot) are frozen
msgspec structs: built ~10x faster than frozen dataclasses (the router's hot path makes dozens per request), and
encoded by the decision records as they are. ``msgspec.structs.replace`` replaces ``dataclasses.replace`` on them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
from typing import Any, ClassVar, Literal

from kvpool.keys import BlockKey
from router.cost import Hardware
from router.kv_admission import KvAdmission

StorageTier = Literal["dram", "ssd"]


class Action(enum.StrEnum):
    HOLDER = "holder"
    FETCH = "fetch"
    RECOMPUTE = "recompute"
    SPLIT = "split"


# The actions' values as a Literal, for typed messages (``router.wire.GenerateRequest.action``).
ActionName = Literal["holder", "fetch", "recompute", "split"]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One prompt to place: its length and the chained block keys of its full blocks."""

    request_id: str
    prompt_tokens: int
    block_size: int
    block_keys: Sequence[BlockKey]


class ReplicaState(msgspec.Struct, frozen=True):
    """A replica as the router sees it for one request."""

    replica_id: str
    node_id: str
    running: int
    waiting: int
    queue_delay_s: float
    hbm_prefix_blocks: int
    hw: Hardware
    kv: KvAdmission | None = None  # its KV cache's admission (``router.kv_admission``; None: not known)

    @property
    def load(self) -> int:
        return self.running + self.waiting


class PoolHit(msgspec.Struct, frozen=True):
    """The longest prefix of the request a pool shard holds in one storage tier."""

    shard_id: str
    node_id: str
    tier: StorageTier
    prefix_blocks: int
    queue_delay_s: float = 0.0


@dataclass(slots=True)
class ReplicaColumns:
    """A snapshot's replicas as columns, index-aligned with ``ClusterSnapshot.replicas``: what a policy that scans
    every replica reads (``cost_based``), without a pass over the states per request. Process-local (``hw_ids`` are
    ``id()``s), never encoded. Kept up to date by ``router.replica_book.ReplicaBook`` as load reports change its states
    (issue 13: "per-replica columns kept up to date by the load reports instead of rebuilt per request"); the index's
    ``snapshot`` and the runner's in-flight view replace the columns they change (``hbm``, ``queues``) in a copy.
    The lists are shared: readers must not mutate them."""

    ids: list[str]
    nodes: list[str]
    hws: list[Hardware]
    hw_ids: list[int]  # id() of each hardware object: replicas of one deployment share theirs
    queues: list[float]  # queue_delay_s
    hbm: list[int]  # hbm_prefix_blocks
    kv: list[KvAdmission | None]  # kv
    kv_free: list[float]  # kv's free tokens (inf: not reported): the replicas a prompt may wait on, found in C

    @classmethod
    def of(cls, replicas: Sequence[ReplicaState]) -> ReplicaColumns:
        hws = [r.hw for r in replicas]
        kv = [r.kv for r in replicas]
        return cls([r.replica_id for r in replicas], [r.node_id for r in replicas], hws, list(map(id, hws)),
                   [r.queue_delay_s for r in replicas], [r.hbm_prefix_blocks for r in replicas],
                   kv, list(map(kv_free_tokens, kv)))

    def with_changes(self, *, queues: list[float] | None = None, hbm: list[int] | None = None,
                     kv: list[KvAdmission | None] | None = None, kv_free: list[float] | None = None) -> ReplicaColumns:
        """A copy with the given columns replaced (``kv`` without ``kv_free``: the free tokens read from it)."""
        if kv is not None and kv_free is None:
            kv_free = list(map(kv_free_tokens, kv))
        return ReplicaColumns(self.ids, self.nodes, self.hws, self.hw_ids, self.queues if queues is None else queues,
                              self.hbm if hbm is None else hbm, self.kv if kv is None else kv,
                              self.kv_free if kv_free is None else kv_free)


def kv_free_tokens(kv: KvAdmission | None) -> float:
    """``ReplicaColumns.kv_free`` of one replica."""
    return float("inf") if kv is None else kv.free_tokens


class ClusterSnapshot(msgspec.Struct, frozen=True):
    """What the policy may look at: every live replica and every pool hit for this request; ``columns``, when the
    producer keeps them (the live router's ``ReplicaBook`` through ``PrefixIndex.snapshot``), the same replicas as
    columns (``ReplicaColumns``; None: a policy that wants them builds them, ``ReplicaColumns.of``). ``now``: the
    decision's time on the clock the replicas' ``kv`` release times use (the runner's; 0: not given)."""

    replicas: Sequence[ReplicaState]
    pool_hits: Sequence[PoolHit] = ()
    columns: ReplicaColumns | None = None
    now: float = 0.0


class FetchPlan(msgspec.Struct, frozen=True):
    """Blocks [start_block, end_block) of the request's keys, pulled from ``shard_id``'s ``tier``."""

    shard_id: str
    node_id: str
    tier: StorageTier
    start_block: int
    end_block: int

    @property
    def blocks(self) -> int:
        return self.end_block - self.start_block


class Candidate(msgspec.Struct, frozen=True):
    """One priced option: an action on a replica, its predicted TTFT and the prefix it reuses."""

    action: Action
    replica_id: str
    predicted_ttft_s: float
    reused_tokens: int = 0
    fetch: FetchPlan | None = None
    note: str = ""


Explanation = Callable[[], tuple[str, dict[str, float]]]


class Ranking:
    """A policy's answer: candidates best-first (the first is chosen) and a one-line reason with its numbers.

    ``choosable``: how many leading candidates the runner's tie-break may pick among (``None``: all of them); the
    candidates after them are alternatives for the record only (``cost_based`` puts there the actions it held back
    in favour of the HBM holder, so a near-tie is never handed back to them).

    A policy whose reason is costly to format (``cost_based``: a formula with a dozen numbers, a third of a
    decision's time) passes ``explain`` instead: it runs once, when ``reason`` or ``extra`` is first read (the
    runner hands it to the audit log, which reads it only when somebody reads the record)."""

    __slots__ = ("_explain", "_extra", "_reason", "candidates", "choosable")

    def __init__(self, candidates: Sequence[Candidate], reason: str = "", extra: dict[str, float] | None = None,
                 *, explain: Explanation | None = None, choosable: int | None = None) -> None:
        if choosable is not None and not 1 <= choosable <= len(candidates):
            raise ValueError(f"choosable must be in [1, {len(candidates)}], got {choosable}")
        self.candidates = candidates
        self.choosable = choosable
        self._reason = reason
        self._extra = extra if extra is not None else {}
        self._explain = explain

    @property
    def explained(self) -> bool:
        return self._explain is None

    def _resolve(self) -> None:
        explain, self._explain = self._explain, None
        if explain is not None:
            self._reason, self._extra = explain()

    @property
    def reason(self) -> str:
        self._resolve()
        return self._reason

    @property
    def extra(self) -> dict[str, float]:
        self._resolve()
        return self._extra


class NoReplicasError(ValueError):
    """The snapshot has no live replica: nothing to route to (the caller answers 503)."""


class RoutingPolicy(ABC):
    """Ranks candidates for one request. Implementations live one per file in ``router/policies/``."""

    name: ClassVar[str]
    #: True when the choosable candidates (``Ranking.choosable``) are ordered by ``predicted_ttft_s`` and near-equal
    #: ones are interchangeable: the ``PolicyRunner`` then picks at random among those within its tie window
    #: (anti-herding). Policies whose order means something else (round robin, pow-2 on load) leave it False and
    #: break their own ties.
    tie_break: ClassVar[bool] = False
    #: True when the policy prices pool fetches against the HBM and recomputing: its decision is then the load
    #: plan, and a HOLDER or RECOMPUTE means "load nothing from the pool" — the replica tells the connector not to
    #: look the request up (no lookup round trip before vLLM may schedule it). Policies that leave the pool to the
    #: connector (round robin, prefix affinity) keep False: the connector looks up every request.
    plans_pool_loads: ClassVar[bool] = False

    @abstractmethod
    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        """Return candidates best-first; must not mutate inputs, do I/O or read clocks."""

    def update_tier_map(self, tier_map: Any) -> bool:
        """Price pool fetches with ``tier_map`` (a ``router.policies.pricing.TierMap``, e.g. calibrated from
        observed transfers) from the next decision on; True if it changed anything. Policies that do not price
        fetches ignore it."""
        return False
