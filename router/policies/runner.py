"""``PolicyRunner``: everything around a policy — anti-herding, tie-breaks, the decision record, audit and metrics.

Who calls what:
- The ingress (live) and ``bench.simulate`` build a ``RouteRequest`` and a ``ClusterSnapshot`` and call
  ``runner.decide(request, snapshot)`` → ``DecisionRecord`` (action, replica, fetch plan, predicted TTFT of the
  alternatives, reason, decision latency).
- When the request's first token arrives: ``runner.record_actual(request_id, ttft_s)`` (fills in regret and
  prediction error, acknowledges the assignment). When a load report that already counts a request arrives:
  ``runner.acknowledge(request_id)`` (or ``acknowledge_replica`` for everything decided before a report).
- A policy may explain its choice lazily (``Ranking(explain=...)``): the record's ``reason`` is then filled in
  when the record is read from the audit log (formatting it costs a third of a decision); without an audit log it
  stays empty (the simulator never reads it).
- ``make_policy(name, **ctx)`` builds a policy by name; ``ctx`` may carry ``rng`` and ``tier_map`` (passed to
  policies that take them) and policy options.

Anti-herding (several routers, each with its own index, sharing only the replicas' load reports): between two load
reports every router would see the same "best" replica and pile onto it. The runner therefore (1) adds its own
in-flight assignments to the snapshot it shows the policy — +1 waiting and +the request's own predicted prefill
seconds on the replica's queue delay — until the replica reports them (``acknowledge*``), the first token arrives,
or ``inflight_ttl_s`` passes; on a replica that reports its KV cache (``ReplicaState.kv``), also the KV the request
will hold (its prompt less the HBM prefix it reuses, ``KvAdmission.claimed``), which the first token does not end:
until a report counts the request, it finishes, or ``inflight_ttl_s`` passes; and (2) for policies with
``tie_break`` (candidates ordered by predicted TTFT) picks among the choosable candidates (``Ranking.choosable``)
within ``max(tie_abs_s, tie_rel · best)`` of the best the one on the replica this router assigned least recently,
at random (its own injected RNG) among replicas it never assigned, so two routers with identical views still choose
different replicas, and one router spreads a burst over equally priced replicas in turn. Fresh prompts reach idle
replicas one by one (the in-flight term ends at their first token, tens of ms later): a coin flip per prompt put 13
of 16 on one replica of two (the two-router e2e test, CI). Both can be switched off (``anti_herding=False``,
``tie_break=False``) to measure the herd a naive router forms.

No I/O: clocks and the RNG are injected; audit log and metrics are optional in-memory sinks.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from msgspec.structs import replace as replace_struct

from router.decision import AuditLog, DecisionRecord
from router.metrics import RouterMetrics
from router.policies.always_fetch import AlwaysFetch
from router.policies.base import (
    Candidate,
    ClusterSnapshot,
    NoReplicasError,
    ReplicaState,
    RouteRequest,
    RoutingPolicy,
    kv_free_tokens,
)
from router.policies.cost_based import CostBased
from router.policies.least_loaded import LeastLoaded
from router.policies.prefix_affinity import PrefixAffinity
from router.policies.round_robin import RoundRobin

POLICIES: Mapping[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAffinity, CostBased, AlwaysFetch)
}
#: Context every policy may be offered; a policy that does not take one of these simply does not get it.
CONTEXT_KEYS = frozenset({"rng", "tier_map"})


class UnknownPolicyError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")


class PolicyError(RuntimeError):
    """A policy broke its contract (no candidates, or a replica that is not in the snapshot)."""


def make_policy(name: str, **ctx: Any) -> RoutingPolicy:
    """Build policy ``name``. Shared context (``rng``, ``tier_map``) goes to the policies that take it; any other
    keyword must be an option of that policy. A policy that takes an RNG and gets none gets a fresh
    ``random.Random()`` (pass a seeded one for reproducible runs)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicyError(name)
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {}
    for key, value in ctx.items():
        if key in params:
            kwargs[key] = value
        elif key not in CONTEXT_KEYS:
            options = sorted(p for p in params if p != "self")
            raise TypeError(f"policy {name!r} has no option {key!r}; it takes: {', '.join(options)}")
    if "rng" in params and "rng" not in kwargs:
        kwargs["rng"] = random.Random()
    missing = [
        p.name
        for p in params.values()
        if p.name != "self" and p.default is inspect.Parameter.empty and p.name not in kwargs
    ]
    if missing:
        raise TypeError(f"policy {name!r} needs {', '.join(missing)} (e.g. tier_map=TierMap.from_tiers(load_tiers()))")
    return cls(**kwargs)


@dataclasses.dataclass(slots=True)
class _Pending:
    replica_id: str
    decided_at: float
    expires_at: float
    added_s: float


@dataclasses.dataclass(slots=True)
class _KvClaim:
    replica_id: str
    tokens: int
    decided_at: float
    expires_at: float


class PolicyRunner:
    """Runs one policy for one router. Not thread-safe (one per event loop / simulator)."""

    def __init__(
        self,
        policy: RoutingPolicy,
        *,
        rng: random.Random,
        tie_abs_s: float = 5e-4,
        tie_rel: float = 0.01,
        tie_break: bool = True,
        anti_herding: bool = True,
        inflight_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        audit: AuditLog | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        if tie_abs_s < 0 or tie_rel < 0:
            raise ValueError(f"tie window must be >= 0, got tie_abs_s={tie_abs_s} tie_rel={tie_rel}")
        if inflight_ttl_s <= 0:
            raise ValueError(f"inflight_ttl_s must be positive, got {inflight_ttl_s}")
        self.policy = policy
        self.policy_name = type(policy).name
        self._rng = rng
        self.tie_abs_s = tie_abs_s
        self.tie_rel = tie_rel
        self._tie_break = tie_break and bool(type(policy).tie_break)
        self.anti_herding = anti_herding
        self.inflight_ttl_s = inflight_ttl_s
        self._clock = clock
        self._timer = timer
        self.audit = audit
        self.metrics = metrics
        self._pending: dict[str, _Pending] = {}  # request id -> assignment
        self._per_replica: dict[str, tuple[int, float]] = {}  # replica id -> (count, added seconds)
        self._kv_claims: dict[str, _KvClaim] = {}  # request id -> the KV its assignment will hold
        self._kv_per_replica: dict[str, int] = {}  # replica id -> tokens claimed
        self._next_expiry = float("inf")
        self._chosen_seq: dict[str, int] = {}  # replica id -> when this runner last chose it (``_seq`` at the time)
        self._seq = 0

    # ---- deciding -------------------------------------------------------------------------------------------

    def decide(self, request: RouteRequest, snapshot: ClusterSnapshot) -> DecisionRecord:
        t0 = self._timer()
        if not snapshot.replicas:
            raise NoReplicasError(f"no live replica to route request {request.request_id!r} to")
        now = self._clock()
        view = self._with_inflight(snapshot, now) if self._pending or self._kv_claims else snapshot
        view = replace_struct(view, now=now)
        ranking = self.policy.rank(request, view)
        cands = ranking.candidates
        if not cands:
            raise PolicyError(f"policy {self.policy_name!r} returned no candidates")
        chosen = cands[0]
        tie = ""
        n = len(cands) if ranking.choosable is None else ranking.choosable
        if self._tie_break and n > 1:
            best = chosen.predicted_ttft_s
            window = max(self.tie_abs_s, self.tie_rel * best)
            limit = best + window
            k = 1
            while k < n and cands[k].predicted_ttft_s <= limit:
                k += 1
            if k > 1:
                j = self._least_recent(cands, k)
                chosen = cands[j]
                tie = (f"least recently chosen {j + 1} of {k} within {window * 1e3:.3f} ms of the best: "
                       f"{chosen.action} on {chosen.replica_id} (the reason explains the best)")
        replica = _find(view.replicas, chosen.replica_id)
        if replica is None:
            raise PolicyError(f"policy {self.policy_name!r} chose replica {chosen.replica_id!r}, not in the snapshot")
        best_pred = min([c.predicted_ttft_s for c in cands])
        plan = chosen.fetch
        fetched = plan.blocks * request.block_size if plan is not None else 0
        record = DecisionRecord(
            request_id=request.request_id,
            policy=self.policy_name,
            action=chosen.action,
            replica_id=chosen.replica_id,
            fetch=plan,
            predicted_ttft_s=chosen.predicted_ttft_s,
            best_predicted_ttft_s=best_pred,
            alternatives=tuple(cands),
            reason=ranking.reason if ranking.explained else "",
            prompt_tokens=request.prompt_tokens,
            block_size=request.block_size,
            hbm_tokens=max(0, chosen.reused_tokens - fetched),
            fetched_tokens=fetched,
            decided_at=now,
            decision_latency_s=0.0,
            tie_break=tie,
        )
        self._note_chosen(chosen.replica_id, len(view.replicas))
        if self.anti_herding:
            self._track(request.request_id, replica, chosen.predicted_ttft_s - replica.queue_delay_s, now)
            if replica.kv is not None:
                self._claim_kv(request.request_id, replica.replica_id,
                               max(0, request.prompt_tokens - record.hbm_tokens), now)
        record.decision_latency_s = self._timer() - t0
        if self.audit is not None:
            self.audit.add(record, None if ranking.explained else lambda: ranking.reason)
        if self.metrics is not None:
            self.metrics.observe_decision(record)
        return record

    def _least_recent(self, cands: Sequence[Candidate], k: int) -> int:
        """Index of the candidate among the first ``k`` whose replica this runner chose least recently (at random
        among the replicas it never chose, or several candidates on one replica)."""
        last = self._chosen_seq
        seqs = [last.get(c.replica_id, -1) for c in cands[:k]]
        oldest = min(seqs)
        ties = [j for j, q in enumerate(seqs) if q == oldest]
        return ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]

    def _note_chosen(self, replica_id: str, live_replicas: int) -> None:
        if len(self._chosen_seq) > 2 * live_replicas + 64:  # replicas gone long ago: forget them all, once
            self._chosen_seq.clear()
        self._seq += 1
        self._chosen_seq[replica_id] = self._seq

    def record_actual(self, request_id: str, ttft_s: float) -> DecisionRecord | None:
        """The request's first token arrived after ``ttft_s``: regret and error into the record and metrics; its
        prefill is done, so it no longer counts as this router's in-flight load (the KV it holds does, until
        ``acknowledge``)."""
        self._drop_pending(request_id)
        if self.audit is None:
            return None
        record = self.audit.record_actual(request_id, ttft_s)
        if record is not None and self.metrics is not None:
            self.metrics.observe_actual(record)
        return record

    # ---- anti-herding: this router's assignments the replicas have not reported yet ----------------------------

    def acknowledge(self, request_id: str) -> None:
        """The replica's load report now counts ``request_id`` (or it finished): stop adding it."""
        self._drop_pending(request_id)
        c = self._kv_claims.pop(request_id, None)
        if c is not None:
            self._unclaim(c)

    def _drop_pending(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is not None:
            self._unaccount(p)

    def acknowledge_replica(self, replica_id: str, decided_before: float) -> None:
        """A load report from ``replica_id`` that counts everything this router sent it before ``decided_before``
        (this runner's clock) arrived."""
        done = [rid for rid, p in self._pending.items() if p.replica_id == replica_id and p.decided_at < decided_before]
        done += [rid for rid, c in self._kv_claims.items()
                 if c.replica_id == replica_id and c.decided_at < decided_before and rid not in self._pending]
        for rid in done:
            self.acknowledge(rid)

    def inflight(self, replica_id: str) -> int:
        """This router's unacknowledged assignments on ``replica_id`` (after expiry at the clock's now)."""
        self._expire(self._clock())
        return self._per_replica.get(replica_id, (0, 0.0))[0]

    def _track(self, request_id: str, replica: ReplicaState, added_s: float, now: float) -> None:
        self.acknowledge(request_id)  # a retried request id replaces its earlier assignment
        p = _Pending(replica.replica_id, now, now + self.inflight_ttl_s, max(0.0, added_s))
        self._pending[request_id] = p
        n, s = self._per_replica.get(p.replica_id, (0, 0.0))
        self._per_replica[p.replica_id] = (n + 1, s + p.added_s)
        self._next_expiry = min(self._next_expiry, p.expires_at)
        if self.metrics is not None:
            self.metrics.set_inflight(p.replica_id, n + 1)

    def kv_claimed(self, replica_id: str) -> int:
        """KV tokens this router's unacknowledged assignments on ``replica_id`` will hold (after expiry)."""
        self._expire(self._clock())
        return self._kv_per_replica.get(replica_id, 0)

    def _claim_kv(self, request_id: str, replica_id: str, tokens: int, now: float) -> None:
        c = _KvClaim(replica_id, tokens, now, now + self.inflight_ttl_s)
        self._kv_claims[request_id] = c
        claimed = self._kv_per_replica[replica_id] = self._kv_per_replica.get(replica_id, 0) + tokens
        self._next_expiry = min(self._next_expiry, c.expires_at)
        if self.metrics is not None:
            self.metrics.set_kv_claimed(replica_id, claimed)

    def _unclaim(self, c: _KvClaim) -> None:
        left = self._kv_per_replica.get(c.replica_id, 0) - c.tokens
        if left > 0:
            self._kv_per_replica[c.replica_id] = left
        else:
            left = 0
            self._kv_per_replica.pop(c.replica_id, None)
        if self.metrics is not None:
            self.metrics.set_kv_claimed(c.replica_id, left)

    def _unaccount(self, p: _Pending) -> None:
        n, s = self._per_replica[p.replica_id]
        if n <= 1:
            del self._per_replica[p.replica_id]
        else:
            self._per_replica[p.replica_id] = (n - 1, max(0.0, s - p.added_s))
        if self.metrics is not None:
            self.metrics.set_inflight(p.replica_id, n - 1)

    def _expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        expired = [rid for rid, p in self._pending.items() if p.expires_at <= now]
        for rid in expired:
            self._unaccount(self._pending.pop(rid))
        for rid in [rid for rid, c in self._kv_claims.items() if c.expires_at <= now]:
            self._unclaim(self._kv_claims.pop(rid))
        self._next_expiry = min(min((p.expires_at for p in self._pending.values()), default=float("inf")),
                                min((c.expires_at for c in self._kv_claims.values()), default=float("inf")))

    def _with_inflight(self, snapshot: ClusterSnapshot, now: float) -> ClusterSnapshot:
        self._expire(now)
        extra = self._per_replica
        claims = self._kv_per_replica
        if not extra and not claims:
            return snapshot
        replicas = list(snapshot.replicas)
        cols = snapshot.columns
        ids = cols.ids if cols is not None else [r.replica_id for r in replicas]  # unique in a snapshot
        queues = cols.queues[:] if cols is not None and extra else None
        kvs = cols.kv[:] if cols is not None and claims else None
        frees = cols.kv_free[:] if cols is not None and claims else None
        for rid, (count, added_s) in extra.items():  # a few replicas: their positions found by C scans
            if rid in ids:
                i = ids.index(rid)
                r = replicas[i]
                replicas[i] = replace_struct(r, waiting=r.waiting + count, queue_delay_s=r.queue_delay_s + added_s)
                if queues is not None:
                    queues[i] = replicas[i].queue_delay_s
        for rid, tokens in claims.items():
            if rid in ids:
                i = ids.index(rid)
                r = replicas[i]
                if r.kv is not None:
                    replicas[i] = replace_struct(r, kv=r.kv.claimed(tokens))
                    if kvs is not None and frees is not None:
                        kvs[i] = replicas[i].kv
                        frees[i] = kv_free_tokens(replicas[i].kv)
        return ClusterSnapshot(replicas, snapshot.pool_hits,
                               None if cols is None else cols.with_changes(queues=queues, kv=kvs, kv_free=frees))


def _find(replicas: Sequence[ReplicaState], replica_id: str) -> ReplicaState | None:
    for r in replicas:
        if r.replica_id == replica_id:
            return r
    return None
