"""ClusterViewHub: the named Ray actor through which replicas publish routing stats and ingresses read them.

Who calls what:
- Each ``deployments.replica.VLLMReplica`` calls ``publish_replica(encoded ReplicaReport)`` every ~0.5 s: its
  load, the delta of HBM block keys since its last report (``full=True``: a whole snapshot, sent first and
  after any publish failure) and the pool fetches its connector finished since then (``TransferSample``, for the
  routers' tier calibration; a snapshot carries none, so no fetch is counted twice) and where its engine threads
  run (``ReplicaPlacement``, shown by ``kvstack serve`` and ``kvstack status``).
- Each ``router.ingress.OpenAIIngress`` replica calls ``poll(cursor)`` every ~0.1 s and applies the returned
  reports, in order, to its own ``router.index`` view. A cursor older than the hub's bounded log gets a snapshot
  (one full report per live replica) instead of deltas, so no reader ever applies a delta on top of a gap.
- A replica that has not published for ``REPLICA_SILENCE_S`` (dead, or frozen) is forgotten by the hub itself:
  a ``gone`` report goes to every reader, and no later snapshot holds it. Without it, a snapshot (a reader's
  resync, a new router, a cursor behind the log) handed out a dead replica's last report as news, and a router
  counted it live for its TTL again (seen in CI: a killed replica back in the routers' view after they had dropped
  it). ``forget_replica`` forgets one at once. The ingress also drops replicas it has not heard from within its
  TTL.
- ``publish_replica`` answers whether the hub holds the replica's whole key set: False after it forgot the
  replica (or restarted) and got a delta — the replica then sends a full report next.

Several ingress replicas read the same stream, so they hold the same view; herding is prevented in the policy
runner (own in-flight counts + randomised tie-breaks), not here. Messages are versioned msgspec structs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Literal

import msgspec

HUB_WIRE_VERSION = 2  # 2: a replica reports its layout fingerprint, not one key root (roots are per salt)
# How a replica's engine threads claim cores (``deployments.cpu_placement``): cores of their own, shared ones, or
# none (the threads unbound: the OS scheduler moves them, as vLLM's ``nobind``).
CpuBinding = Literal["exclusive", "shared", "unbound"]
DEFAULT_HUB_NAME = "kvstack-cluster-view"
# A replica publishes every ~0.5 s; one silent this long is forgotten (the routers' default replica_ttl_s, so the
# hub never holds a replica longer than a router would count it live).
REPLICA_SILENCE_S = 10.0


class TransferSample(msgspec.Struct, frozen=True, array_like=True):
    """One pool fetch a replica's connector finished: from which shard, whether the shard had to promote blocks
    from SSD, its cost to the request end to end (its wait on the pool from the engine's first ask, then the
    read: ``kvpool.connector.meta.TransferRecord.seconds``) and the read alone within it (``read_s``; None: not
    reported — the field is newer than the wire version, and decoders on both sides take a sample with or without
    it). The routers fit their tier prices to these (``router.calibration.TierEstimator``)."""

    shard_id: str
    ssd: bool
    bytes_moved: int
    seconds: float
    read_s: float | None = None


class EngineWorkerBinding(msgspec.Struct, frozen=True, array_like=True):
    """One engine worker process as it reports itself (``deployments.engine_worker``): its pid and the CPUs the OS
    lets its main thread run on."""

    pid: int
    cpus: list[int]


class ReplicaPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a replica's engine threads run (``deployments.cpu_placement``): the CPUs it claimed and bound its
    engine to, how many threads, the binding policy, the NUMA node(s) of those CPUs, the CPUs the process could
    have used, the other live claims on the same CPUs (non-empty only under ``binding="shared"``), the pid of
    the replica process holding the claim (its engine processes are its descendants) and, once the engine is up,
    its worker processes as they report their own binding (``engine_workers``; empty until then)."""

    cores: list[int]
    threads: int
    binding: CpuBinding
    numa_nodes: list[int] = []
    allowed: list[int] = []
    shared_with: list[str] = []
    pid: int = 0
    engine_workers: list[EngineWorkerBinding] = []


class PrefillSample(msgspec.Struct, frozen=True, array_like=True):
    """One timed cold prefill of the replica's start-up probe: prompt tokens, seconds to the first token."""

    tokens: int
    seconds: float


class KvRelease(msgspec.Struct, frozen=True, array_like=True):
    """KV cache tokens a replica's in-flight request frees when it ends, ``eta_s`` after the report was sent."""

    eta_s: float
    tokens: int


class KvOccupancy(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's KV cache as its in-flight requests hold it (``deployments.kv_occupancy``): what a new request
    must wait for when it does not fit (vLLM admits a waiting request only when its blocks can be allocated).
    ``held_tokens``: the tokens its requests hold or will hold once admitted (a block shared by several counted
    once), ``releases``: when each of them ends (remaining decode at the replica's decode rate) and what that frees
    (the blocks no request ending later shares), soonest first. ``pinned``: the block keys those requests hold, each
    as its first 8 bytes (an unsigned little-endian int): a new request's cached prefix needs no new blocks only
    while a request holds it (vLLM allocates a cached block no request holds again); None: not sent (too many)."""

    capacity_tokens: int
    held_tokens: int
    releases: list[KvRelease] = []
    pinned: list[int] | None = None


class EngineProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica measured of its engine at start-up (``deployments.replica``): its device (``torch.cuda.
    get_device_name``, or ``cpu``) and cold prefills of several lengths; the routers detect the GPU profile from the
    device (when none is configured) and fit the replica's MFU to the prefills before its first request."""

    device: str
    prefills: list[PrefillSample] = []


class PrefillHead(msgspec.Struct, frozen=True, kw_only=True):
    """The oldest waiting request of a replica (received, no first output yet): the prefill its engine is computing
    now, as vLLM schedules waiting prefills first come, first served. ``tokens`` / ``tokens_sq``: its work, P − c and
    P² − c² (as ``ReplicaReport.waiting_tokens``); ``elapsed_s``: how long the engine has been at it, as far as the
    replica can tell: since the later of its arrival and the replica's last first output (the engine moved on to it
    then). The routers take the elapsed part off the queue they price (``router.replica_book``)."""

    tokens: int
    tokens_sq: int
    elapsed_s: float


class ReplicaReport(msgspec.Struct, frozen=True, kw_only=True):
    version: int = HUB_WIRE_VERSION
    replica_id: str
    node_id: str
    seq: int  # per-replica sequence number, +1 per report
    running: int
    waiting: int  # requests received that have not produced their first token (queued or prefilling)
    # Their prefill work: Σ (P − c) and Σ (P² − c²) over them (P prompt tokens, c the tokens the decision planned
    # to reuse): the routers price it with the replica's fitted prefill rate (``router.replica_book``).
    waiting_tokens: int = 0
    waiting_tokens_sq: int = 0
    head: PrefillHead | None = None  # the oldest of them and how far its prefill has come (None: none waiting)
    # the layout its engine registered (the pool connector's handshake; "" with the pool off): the layout part of
    # the block-key namespace, which the routers adopt so that their keys, per salt, are the replica's and the pool's
    layout_fingerprint: str = ""
    stored: list[bytes] = []
    removed: list[bytes] = []
    full: bool = False  # stored is the replica's whole HBM key set
    sent_at: float = 0.0
    gone: bool = False  # the replica left (forgotten)
    transfers: list[TransferSample] = []  # pool fetches finished since the previous report
    placement: ReplicaPlacement | None = None  # the CPUs the replica's engine threads are bound to
    profile: EngineProfile | None = None  # the engine's device and start-up prefill probe
    kv: KvOccupancy | None = None  # its KV cache's occupancy (None: not known, e.g. before the engine is up)


class PollReply(msgspec.Struct, frozen=True, kw_only=True):
    version: int = HUB_WIRE_VERSION
    cursor: int
    reports: list[ReplicaReport]
    snapshot: bool = False  # reports is a full snapshot: readers must reset their replica view first


class HubState:
    """The hub's logic without Ray (unit-testable): a bounded log of reports plus each replica's full key set."""

    def __init__(self, max_log: int = 4096) -> None:
        self._log: deque[tuple[int, ReplicaReport]] = deque(maxlen=max_log)
        self._next = 1
        self._keys: dict[str, dict[bytes, None]] = {}
        self._last: dict[str, ReplicaReport] = {}
        self._heard: dict[str, float] = {}  # replica -> when its last report came (the caller's clock)
        self._partial: set[str] = set()  # replicas whose key set began with a delta: not their whole set

    def publish(self, report: ReplicaReport, now: float = 0.0) -> bool:
        """Apply a replica's report (received at ``now``); True when the hub now holds its whole key set, False
        when it came as a delta to a replica the hub did not know (forgotten, or the hub restarted): the replica
        should send a full report."""
        if report.version != HUB_WIRE_VERSION:
            raise ValueError(f"ReplicaReport version {report.version}, hub speaks {HUB_WIRE_VERSION}")
        rid = report.replica_id
        if report.full:
            self._partial.discard(rid)
        elif rid not in self._last:
            self._partial.add(rid)
        self._heard[rid] = now
        keys = self._keys.setdefault(rid, {})
        if report.full:
            keys.clear()
        for k in report.removed:
            keys.pop(k, None)
        for k in report.stored:
            keys[k] = None
        self._last[report.replica_id] = report
        self._log.append((self._next, report))
        self._next += 1
        return rid not in self._partial

    def expire(self, now: float, silence_s: float) -> list[str]:
        """Forget every replica not heard from for more than ``silence_s`` before ``now`` (``forget``: readers get
        its ``gone``); the replicas forgotten."""
        silent = [rid for rid, at in self._heard.items() if now - at > silence_s]
        for rid in silent:
            self.forget(rid)
        return silent

    def forget(self, replica_id: str) -> None:
        last = self._last.pop(replica_id, None)
        self._keys.pop(replica_id, None)
        self._heard.pop(replica_id, None)
        self._partial.discard(replica_id)
        if last is not None:
            gone = msgspec.structs.replace(last, stored=[], removed=[], gone=True, transfers=[])
            self._log.append((self._next, gone))
            self._next += 1

    def poll(self, cursor: int, max_reports: int = 2048) -> PollReply:
        oldest = self._log[0][0] if self._log else self._next
        if cursor < oldest - 1 or cursor > self._next - 1:
            return self.snapshot()
        out = [r for seq, r in self._log if seq > cursor][:max_reports]
        return PollReply(cursor=cursor + len(out), reports=out)

    def snapshot(self) -> PollReply:
        reports = [
            msgspec.structs.replace(last, stored=list(self._keys[rid]), removed=[], full=True, transfers=[])
            for rid, last in self._last.items()
        ]
        return PollReply(cursor=self._next - 1, reports=reports, snapshot=True)


class ClusterViewHub:
    """Ray actor wrapper (``ray.remote(ClusterViewHub).options(name=DEFAULT_HUB_NAME, ...)``).

    It also keeps each router's latest decision summaries (``publish_decisions`` / ``decisions``) so that
    ``kvstack status`` sees every router's decisions whichever router answers it.
    """

    def __init__(self, max_log: int = 4096, silence_s: float = REPLICA_SILENCE_S) -> None:
        self._state = HubState(max_log)
        self._silence_s = silence_s
        self._decisions: dict[str, list[dict]] = {}
        self._lock = threading.Lock()  # a threaded actor: publishes and polls run concurrently

    def publish_decisions(self, router_id: str, summaries: list[dict]) -> None:
        with self._lock:
            self._decisions[router_id] = summaries

    def decisions(self, limit: int = 50, tenant: str | None = None) -> list[dict]:
        with self._lock:
            merged = [d for rows in self._decisions.values() for d in rows
                      if tenant is None or d.get("tenant", "") == tenant]
        merged.sort(key=lambda d: d.get("decided_at", 0.0))
        return merged[-limit:]

    def publish_replica(self, raw: bytes) -> bool:
        """True: the hub holds the replica's whole key set; False: send a full report (``HubState.publish``)."""
        report = msgspec.msgpack.decode(raw, type=ReplicaReport)
        with self._lock:
            return self._state.publish(report, time.monotonic())

    def forget_replica(self, replica_id: str) -> None:
        with self._lock:
            self._state.forget(replica_id)

    def poll(self, cursor: int) -> bytes:
        with self._lock:
            self._state.expire(time.monotonic(), self._silence_s)
            reply = self._state.poll(cursor)
        return msgspec.msgpack.encode(reply)

    def ping(self) -> str:
        return "ok"


def get_or_create_hub(name: str = DEFAULT_HUB_NAME, namespace: str | None = None) -> object:
    """The hub actor handle: created on first use (0 CPUs, detached so it outlives any one replica)."""
    import ray

    return (
        ray.remote(ClusterViewHub)
        .options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=0,
                 max_concurrency=64)
        .remote()
    )
