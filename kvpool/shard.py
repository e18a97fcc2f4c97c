"""The pool shard: a Ray actor per node wrapping a ``BlockStore``, its DRAM arena registered with a transfer endpoint.

Who calls what:
- ``start_shards`` (called by the cluster bootstrap / app builder / tests) starts one ``PoolShard`` actor on every
  alive node that passes the filter, pinned with a hard ``NodeAffinitySchedulingStrategy``, and waits (with a
  deadline) until each is ready.
- The vLLM connector's scheduler side calls ``lookup`` (side-effect free), ``lease`` / ``release``; its save path
  calls ``reserve``, writes the blocks with its own transfer endpoint into the shard's arena at the reserved
  offsets, then ``commit`` (or ``abort``). Its worker side ``add_peer``s ``transfer_metadata()`` and reads leased
  blocks at the returned offsets of ``region_id``.
- A replica ``touch``es the pool blocks of a prefix its engine served from its own HBM (without waiting), so a
  prefix that stays hot in HBM does not age out of the pool meanwhile.
- A replica (the router's SPLIT action: fetch the tail while the head is computed) or an operator asks a shard to
  ``pull`` blocks from a peer shard (``ShardClient.pull`` / ``AsyncShardClient.pull``). This is the ONLY time a
  shard initiates a transfer: it leases the blocks on the source, reads them with its own endpoint into reserved
  slots of its arena, commits the ones whose checksums match and always releases the lease
  (``kvpool.shard_pull``). Every other transfer is initiated by a client.
- The router's directory sync (``kvpool.directory``) pulls ``events_since`` / ``snapshot`` through
  ``ShardEventSource``.
- Operators / Prometheus read ``stats`` and ``metrics_text`` (or the HTTP exporter when ``metrics_port`` > 0).

Across processes every request and reply is a versioned msgspec struct encoded with msgpack (the actor methods take
and return ``bytes``; ``ShardClient`` does the encoding). A request of another wire version is refused
(``WireVersionError``). Every client call has a deadline; a dead or unresponsive shard raises
``ShardUnavailableError`` on the control path (the data path reports failed blocks, see ``kvpool.transfer``).

The actor is threaded (``max_concurrency``); one lock serializes the store. Lease and reservation expiry run on a
background sweeper thread every ``sweep_interval_s``, so expiry does not wait for the next request. ``pull`` runs
in its own concurrency group (``PULL_CONCURRENCY`` threads; more pulls queue there): a pull waits on its source for
up to its deadline, and pulls stuck on a frozen source must not starve ``lookup`` / ``lease`` of the connectors.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.checksum import CHECKSUM_ALGO
from kvpool.events import EventBatch, ShardSnapshot
from kvpool.metrics import PoolMetrics
from kvpool.shard_registry import SHARD_NAMESPACE
from kvpool.store import BlockStore, CommitResult, Lease, LookupResult, Reservation, StoreConfig, StoreStats
from kvpool.transfer.nixl import NixlOptions
from kvpool.transfer.tcp import TcpOptions

log = logging.getLogger(__name__)

POOL_WIRE_VERSION = 1
PULL_LEASE_TTL_S = 30.0  # default lease a pull takes on its source (must cover the pull's deadline)
PULL_REPLY_GRACE_S = 2.0  # a pull client waits deadline_s + this for the reply (queueing, the lease release)
PULL_CONCURRENCY = 4  # pulls run in their own Ray concurrency group of this many threads (see the module doc)
BACKENDS = ("nixl", "tcp", "none")  # "none": no transfer endpoint (control-plane only; nothing can move bytes)


class WireVersionError(ValueError):
    """A request or reply of a pool wire version this build does not speak."""


class ShardUnavailableError(RuntimeError):
    """The shard did not answer within the deadline, or its actor is dead."""


class ShardDeadError(ShardUnavailableError):
    """The shard's actor is dead (a handle to a restarted shard must be resolved again)."""


class ShardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    shard_id: str
    store: StoreConfig
    backend: str = "nixl"
    sweep_interval_s: float = 0.5
    metrics_port: int = 0  # > 0: serve this shard's registry over HTTP on that port
    registry_namespace: str = SHARD_NAMESPACE  # where ``pull`` finds source shards by id (``kvpool.shard_registry``)
    nixl: NixlOptions | None = None  # backend "nixl": None = NixlOptions() defaults
    tcp: TcpOptions | None = None  # backend "tcp": None = listen on this node's IP, any free port

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown transfer backend {self.backend!r}; known: {', '.join(BACKENDS)}")
        if self.sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s must be positive, got {self.sweep_interval_s}")
        if not self.shard_id:
            raise ValueError("shard_id must not be empty")


# ---------------------------------------------------------------------------------------------- wire structs
class LookupRequest(msgspec.Struct, frozen=True, tag="lookup"):
    keys: list[bytes]
    fingerprint: str
    version: int = POOL_WIRE_VERSION


class LeaseRequest(msgspec.Struct, frozen=True, tag="lease"):
    keys: list[bytes]
    fingerprint: str
    ttl_s: float
    version: int = POOL_WIRE_VERSION


class TouchRequest(msgspec.Struct, frozen=True, tag="touch"):
    """``keys`` were just used from an engine's own HBM: refresh them for eviction (``BlockStore.touch``)."""

    keys: list[bytes]
    fingerprint: str
    version: int = POOL_WIRE_VERSION


class ReleaseRequest(msgspec.Struct, frozen=True, tag="release"):
    lease_id: int
    version: int = POOL_WIRE_VERSION


class ReserveRequest(msgspec.Struct, frozen=True, tag="reserve"):
    n: int
    version: int = POOL_WIRE_VERSION


class CommitRequest(msgspec.Struct, frozen=True, tag="commit"):
    reservation_id: int
    keys: list[bytes]
    checksums: list[int]
    fingerprint: str
    checksum_algo: str = CHECKSUM_ALGO
    version: int = POOL_WIRE_VERSION


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    reservation_id: int
    version: int = POOL_WIRE_VERSION


class EventsRequest(msgspec.Struct, frozen=True, tag="events"):
    after_seq: int
    max_events: int = 4096
    version: int = POOL_WIRE_VERSION


class PullRequest(msgspec.Struct, frozen=True, tag="pull"):
    """Copy ``keys`` (those not held here yet) from shard ``source_shard_id`` into this shard's DRAM, within
    ``deadline_s`` seconds of the shard starting on it; the source's lease on them lasts ``lease_ttl_s``."""

    source_shard_id: str
    keys: list[bytes]
    fingerprint: str
    deadline_s: float
    lease_ttl_s: float = PULL_LEASE_TTL_S
    version: int = POOL_WIRE_VERSION


class LookupReply(msgspec.Struct, frozen=True, tag="lookup_reply"):
    shard_id: str
    epoch: str
    result: LookupResult
    version: int = POOL_WIRE_VERSION


class LeaseReply(msgspec.Struct, frozen=True, tag="lease_reply"):
    """``lease.blocks[i]`` lies at ``offset`` in region ``region_id`` of transfer agent ``agent_name``."""

    shard_id: str
    epoch: str
    agent_name: str
    region_id: int
    lease: Lease
    version: int = POOL_WIRE_VERSION


class ReserveReply(msgspec.Struct, frozen=True, tag="reserve_reply"):
    shard_id: str
    epoch: str
    agent_name: str
    region_id: int
    reservation: Reservation
    version: int = POOL_WIRE_VERSION


class CommitReply(msgspec.Struct, frozen=True, tag="commit_reply"):
    shard_id: str
    epoch: str
    result: CommitResult
    version: int = POOL_WIRE_VERSION


class AckReply(msgspec.Struct, frozen=True, tag="ack_reply"):
    """Reply of release / abort: ``ok`` False = the lease / reservation was unknown (already ended)."""

    shard_id: str
    epoch: str
    ok: bool
    version: int = POOL_WIRE_VERSION


class PullReply(msgspec.Struct, frozen=True, tag="pull_reply"):
    """What a pull did. ``requested`` = ``present`` + ``pulled`` + ``failed`` + ``missing``:
    ``present`` already held here (skipped, or committed meanwhile by another writer); ``pulled`` committed now;
    ``failed`` not committed although asked for: source unreachable / dead / too slow, transfer failed, checksum
    mismatch, no free slot here; ``missing`` not held by the source (beyond the prefix its lease pinned).
    ``error`` says why when anything failed ("" otherwise). ``seconds``: wall time of the pull in the shard;
    ``read_seconds``: of that, the one transfer read (the rest is the lease / release round trips and the store)."""

    shard_id: str
    epoch: str
    requested: int
    present: int
    pulled: int
    failed: int
    missing: int
    bytes_moved: int
    seconds: float
    error: str = ""
    read_seconds: float = 0.0
    version: int = POOL_WIRE_VERSION


class ShardInfo(msgspec.Struct, frozen=True, tag="shard_info"):
    shard_id: str
    epoch: str
    node_id: str
    node_ip: str
    backend: str
    agent_name: str
    region_id: int
    slot_bytes: int
    version: int = POOL_WIRE_VERSION


_R = TypeVar("_R")
_ENC = msgspec.msgpack.Encoder()


def _decode(raw: bytes, typ: type[_R]) -> _R:
    try:
        msg = msgspec.msgpack.decode(raw, type=typ)
    except msgspec.ValidationError as exc:
        raise WireVersionError(f"undecodable {typ.__name__}: {exc}") from exc
    version = getattr(msg, "version", None)
    if version != POOL_WIRE_VERSION:
        raise WireVersionError(f"{typ.__name__} of wire version {version}, this build speaks {POOL_WIRE_VERSION}")
    return msg


# ---------------------------------------------------------------------------------------------- the actor
class PoolShard:
    """Ray actor body (see ``PoolShardActor``). Methods take and return msgpack bytes of the structs above."""

    def __init__(self, config: bytes) -> None:
        cfg = msgspec.msgpack.decode(config, type=ShardConfig)
        self.config = cfg
        self.metrics = PoolMetrics(cfg.shard_id)
        self.store = BlockStore(cfg.store, shard_id=cfg.shard_id, metrics=self.metrics)
        self._lock = threading.Lock()
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.agent_name = f"kvpool-{cfg.shard_id}"
        self.endpoint: Any = None
        self.region_id = -1
        if cfg.backend != "none":
            from kvpool.transfer import make_endpoint

            options: NixlOptions | TcpOptions
            if cfg.backend == "nixl":
                options = cfg.nixl or NixlOptions()
            else:
                options = cfg.tcp or TcpOptions(bind_host=self.node_ip)
            self.endpoint = make_endpoint(cfg.backend, self.agent_name, options=options)
            self.region_id = self.endpoint.register(self.store.arena.buffer)
        from kvpool.shard_pull import Puller, named_shard_resolver

        self._puller = Puller(
            self.store, self._lock, self.endpoint, self.region_id, named_shard_resolver(cfg.registry_namespace)
        )
        self._http: Any = None
        if cfg.metrics_port > 0:
            from prometheus_client import start_http_server

            self._http, _ = start_http_server(cfg.metrics_port, registry=self.metrics.registry)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name=f"sweep-{cfg.shard_id}", daemon=True)
        self._sweeper.start()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            try:
                with self._lock:
                    self.store.sweep()
            except Exception:  # keep sweeping; a failing sweep is logged, never fatal
                log.exception("shard %s: sweep failed", self.config.shard_id)

    def info(self) -> bytes:
        return _ENC.encode(
            ShardInfo(
                self.config.shard_id, self.store.epoch, self.node_id, self.node_ip, self.config.backend,
                self.agent_name, self.region_id, self.config.store.slot_bytes,
            )
        )

    def transfer_metadata(self) -> bytes:
        """``kvpool.transfer.encode_metadata`` of this shard's endpoint (peers ``add_peer`` it)."""
        if self.endpoint is None:
            raise RuntimeError(f"shard {self.config.shard_id} runs without a transfer endpoint (backend 'none')")
        from kvpool.transfer import encode_metadata

        return encode_metadata(self.endpoint.metadata())

    def lookup(self, raw: bytes) -> bytes:
        req = _decode(raw, LookupRequest)
        with self._lock:
            res = self.store.lookup(req.keys, req.fingerprint)
        return _ENC.encode(LookupReply(self.config.shard_id, self.store.epoch, res))

    def lease(self, raw: bytes) -> bytes:
        req = _decode(raw, LeaseRequest)
        with self._lock:
            lease = self.store.lease(req.keys, req.fingerprint, req.ttl_s)
        return _ENC.encode(LeaseReply(self.config.shard_id, self.store.epoch, self.agent_name, self.region_id, lease))

    def touch(self, raw: bytes) -> int:
        """``TouchRequest`` → how many of its keys are held here (callers usually do not wait for it)."""
        req = _decode(raw, TouchRequest)
        with self._lock:
            return self.store.touch(req.keys, req.fingerprint)

    def release(self, raw: bytes) -> bytes:
        req = _decode(raw, ReleaseRequest)
        with self._lock:
            ok = self.store.release(req.lease_id)
        return _ENC.encode(AckReply(self.config.shard_id, self.store.epoch, ok))

    def reserve(self, raw: bytes) -> bytes:
        req = _decode(raw, ReserveRequest)
        with self._lock:
            res = self.store.reserve(req.n)
        return _ENC.encode(
            ReserveReply(self.config.shard_id, self.store.epoch, self.agent_name, self.region_id, res)
        )

    def commit(self, raw: bytes) -> bytes:
        req = _decode(raw, CommitRequest)
        if req.checksum_algo != CHECKSUM_ALGO:
            raise WireVersionError(f"checksum algorithm {req.checksum_algo!r}, this shard uses {CHECKSUM_ALGO!r}")
        with self._lock:
            res = self.store.commit(req.reservation_id, req.keys, req.checksums, req.fingerprint)
        return _ENC.encode(CommitReply(self.config.shard_id, self.store.epoch, res))

    def abort(self, raw: bytes) -> bytes:
        req = _decode(raw, AbortRequest)
        with self._lock:
            ok = self.store.abort(req.reservation_id)
        return _ENC.encode(AckReply(self.config.shard_id, self.store.epoch, ok))

    def events_since(self, raw: bytes) -> bytes:
        req = _decode(raw, EventsRequest)
        with self._lock:
            return _ENC.encode(self.store.events_since(req.after_seq, req.max_events))

    def snapshot(self) -> bytes:
        with self._lock:
            return _ENC.encode(self.store.snapshot())

    @ray.method(concurrency_group="pull")
    def pull(self, raw: bytes) -> bytes:
        """``PullRequest`` → ``PullReply`` (see ``kvpool.shard_pull``); the store lock is not held while bytes move."""
        req = _decode(raw, PullRequest)
        return _ENC.encode(self._puller.pull(req))

    def stats(self) -> bytes:
        with self._lock:
            st = self.store.stats()
        return _ENC.encode(msgspec.structs.replace(st, counters={**st.counters, **self._puller.counters()}))

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def entry_info(self, key: bytes) -> bytes:
        """Where one block lies (tests and debugging; e.g. the slab path and offset of an SSD block)."""
        with self._lock:
            return _ENC.encode(self.store.entry_info(key))

    def demote(self, keys: list[bytes]) -> int:
        """Move these unpinned DRAM blocks to SSD now (draining, tests)."""
        with self._lock:
            return self.store.demote(keys)

    def close(self) -> None:
        """Stop the sweeper, close the endpoint and the store. Idempotent; the actor can be killed afterwards."""
        self._stop.set()
        self._sweeper.join(timeout=5.0)
        self._puller.close()
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        with self._lock:
            self.store.close()


PoolShardActor = ray.remote(concurrency_groups={"pull": PULL_CONCURRENCY})(PoolShard)


# ---------------------------------------------------------------------------------------------- client side
def _get(ref: Any, deadline_s: float, what: str) -> bytes:
    try:
        return ray.get(ref, timeout=deadline_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise ShardUnavailableError(f"{what}: no answer within {deadline_s}s") from exc
    except ray.exceptions.RayActorError as exc:
        raise ShardDeadError(f"{what}: shard actor is dead ({exc})") from exc


async def _aget(ref: Any, deadline_s: float, what: str) -> bytes:
    try:
        return await asyncio.wait_for(ref, timeout=deadline_s)
    except TimeoutError as exc:
        raise ShardUnavailableError(f"{what}: no answer within {deadline_s}s") from exc
    except ray.exceptions.RayActorError as exc:
        raise ShardDeadError(f"{what}: shard actor is dead ({exc})") from exc


class ShardClient:
    """Typed, deadline-bounded calls to one shard actor (sync: for the connector's scheduler side and tests)."""

    def __init__(self, handle: Any, shard_id: str, *, deadline_s: float = 5.0) -> None:
        self.handle = handle
        self.shard_id = shard_id
        self.deadline_s = deadline_s

    def _call(self, method: str, *args: Any, deadline_s: float | None = None) -> bytes:
        ref = getattr(self.handle, method).remote(*args)
        return _get(ref, deadline_s or self.deadline_s, f"shard {self.shard_id}.{method}")

    def info(self) -> ShardInfo:
        return _decode(self._call("info"), ShardInfo)

    def transfer_metadata(self) -> bytes:
        return self._call("transfer_metadata")

    def lookup(self, keys: Sequence[bytes], fingerprint: str) -> LookupReply:
        return _decode(self._call("lookup", _ENC.encode(LookupRequest(list(keys), fingerprint))), LookupReply)

    def lease(self, keys: Sequence[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
        raw = self._call("lease", _ENC.encode(LeaseRequest(list(keys), fingerprint, ttl_s)))
        return _decode(raw, LeaseReply)

    def release(self, lease_id: int) -> bool:
        return _decode(self._call("release", _ENC.encode(ReleaseRequest(lease_id))), AckReply).ok

    def reserve(self, n: int) -> ReserveReply:
        return _decode(self._call("reserve", _ENC.encode(ReserveRequest(n))), ReserveReply)

    def commit(
        self, reservation_id: int, keys: Sequence[bytes], checksums: Sequence[int], fingerprint: str
    ) -> CommitResult:
        req = CommitRequest(reservation_id, list(keys), [int(c) for c in checksums], fingerprint)
        return _decode(self._call("commit", _ENC.encode(req)), CommitReply).result

    def abort(self, reservation_id: int) -> bool:
        return _decode(self._call("abort", _ENC.encode(AbortRequest(reservation_id))), AckReply).ok

    def stats(self) -> StoreStats:
        return msgspec.msgpack.decode(self._call("stats"), type=StoreStats)

    def metrics_text(self) -> str:
        return self._call("metrics_text").decode()

    def events_since(self, after_seq: int, max_events: int = 4096) -> EventBatch:
        return msgspec.msgpack.decode(self._call("events_since", _ENC.encode(EventsRequest(after_seq, max_events))),
                                      type=EventBatch)

    def snapshot(self) -> ShardSnapshot:
        return msgspec.msgpack.decode(self._call("snapshot"), type=ShardSnapshot)

    def entry_info(self, key: bytes) -> Any:
        from kvpool.store import EntryInfo

        return msgspec.msgpack.decode(self._call("entry_info", bytes(key)), type=EntryInfo | None)

    def demote(self, keys: Sequence[bytes]) -> int:
        ref = self.handle.demote.remote([bytes(k) for k in keys])
        return int(_get(ref, self.deadline_s, f"shard {self.shard_id}.demote"))  # type: ignore[arg-type]

    def pull(
        self,
        source_shard_id: str,
        keys: Sequence[bytes],
        fingerprint: str,
        *,
        deadline_s: float,
        lease_ttl_s: float = PULL_LEASE_TTL_S,
    ) -> PullReply:
        """Ask this shard to copy ``keys`` from ``source_shard_id`` (see ``PullReply``). Failures on the source side
        are data (``reply.failed`` / ``reply.error``); this shard not answering within ``deadline_s`` +
        ``PULL_REPLY_GRACE_S`` raises ``ShardUnavailableError``; an invalid request raises ``ValueError``."""
        req = pull_request(self.shard_id, source_shard_id, keys, fingerprint, deadline_s, lease_ttl_s)
        raw = self._call("pull", _ENC.encode(req), deadline_s=deadline_s + PULL_REPLY_GRACE_S)
        return _decode(raw, PullReply)


class AsyncShardClient:
    """Async, deadline-bounded calls to one shard actor, for code on an event loop (a replica asking its node's shard
    to ``pull`` the tail of a prefix while vLLM computes the head). Never blocks the loop."""

    def __init__(self, handle: Any, shard_id: str) -> None:
        self.handle = handle
        self.shard_id = shard_id

    def touch_nowait(self, keys: Sequence[bytes], fingerprint: str) -> None:
        """Send a ``TouchRequest`` and do not wait for it (a lost touch only ages a hot block a little sooner)."""
        self.handle.touch.remote(_ENC.encode(TouchRequest([bytes(k) for k in keys], fingerprint)))

    async def pull(
        self,
        source_shard_id: str,
        keys: Sequence[bytes],
        fingerprint: str,
        *,
        deadline_s: float,
        lease_ttl_s: float = PULL_LEASE_TTL_S,
    ) -> PullReply:
        """Like ``ShardClient.pull``."""
        req = pull_request(self.shard_id, source_shard_id, keys, fingerprint, deadline_s, lease_ttl_s)
        ref = self.handle.pull.remote(_ENC.encode(req))
        raw = await _aget(ref, deadline_s + PULL_REPLY_GRACE_S, f"shard {self.shard_id}.pull")
        return _decode(raw, PullReply)


def pull_request(
    target_shard_id: str,
    source_shard_id: str,
    keys: Sequence[bytes],
    fingerprint: str,
    deadline_s: float,
    lease_ttl_s: float,
) -> PullRequest:
    """A checked ``PullRequest`` (``ValueError`` on a request the shard would refuse; it checks again)."""
    from kvpool.shard_pull import check_pull

    req = PullRequest(source_shard_id, [bytes(k) for k in keys], fingerprint, float(deadline_s), float(lease_ttl_s))
    check_pull(target_shard_id, req)
    return req


class ShardEventSource:
    """A shard's event stream for ``kvpool.directory.DirectorySync`` (async, deadline-bounded)."""

    def __init__(self, handle: Any, shard_id: str) -> None:
        self.handle = handle
        self.shard_id = shard_id

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float) -> EventBatch:
        ref = self.handle.events_since.remote(_ENC.encode(EventsRequest(after_seq, max_events)))
        raw = await _aget(ref, deadline_s, f"shard {self.shard_id}.events_since")
        return msgspec.msgpack.decode(raw, type=EventBatch)

    async def snapshot(self, deadline_s: float) -> ShardSnapshot:
        raw = await _aget(self.handle.snapshot.remote(), deadline_s, f"shard {self.shard_id}.snapshot")
        return msgspec.msgpack.decode(raw, type=ShardSnapshot)


# ---------------------------------------------------------------------------------------------- placement
class ShardHandle(msgspec.Struct, frozen=True):
    shard_id: str
    node_id: str
    node_ip: str
    actor: Any

    def client(self, deadline_s: float = 5.0) -> ShardClient:
        return ShardClient(self.actor, self.shard_id, deadline_s=deadline_s)

    def event_source(self) -> ShardEventSource:
        return ShardEventSource(self.actor, self.shard_id)

    def async_client(self) -> AsyncShardClient:
        return AsyncShardClient(self.actor, self.shard_id)


def alive_nodes(include: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
    """Alive Ray nodes passing ``include`` (default: nodes with CPU > 0, i.e. not a 0-CPU control-plane head)."""
    pred = include or (lambda n: n.get("Resources", {}).get("CPU", 0) > 0)
    return [n for n in ray.nodes() if n.get("Alive") and pred(n)]


def start_shards(
    config_for_node: Callable[[str, str], ShardConfig],
    *,
    include: Callable[[dict[str, Any]], bool] | None = None,
    max_concurrency: int = 8,
    ready_deadline_s: float = 60.0,
    actor_options: dict[str, Any] | None = None,
    actor_name: Callable[[str], str] | None = None,
    namespace: str | None = None,
) -> list[ShardHandle]:
    """Start one shard per alive node (``config_for_node(node_id, node_ip)``), each hard-pinned to its node.

    ``actor_name(node_id)`` names each actor (in ``namespace``) so other processes find it
    (``kvpool.shard_registry``). Waits until every shard answered ``info`` within ``ready_deadline_s``; on failure
    kills what it started and raises ``ShardUnavailableError``.
    """
    handles: list[ShardHandle] = []
    try:
        for node in alive_nodes(include):
            node_id, node_ip = node["NodeID"], node["NodeManagerAddress"]
            cfg = config_for_node(node_id, node_ip)
            named = {"name": actor_name(node_id), "namespace": namespace} if actor_name is not None else {}
            actor = PoolShardActor.options(
                num_cpus=0,
                max_concurrency=max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                **named,
                **(actor_options or {}),
            ).remote(_ENC.encode(cfg))
            handles.append(ShardHandle(cfg.shard_id, node_id, node_ip, actor))
    except BaseException:
        for h in handles:
            ray.kill(h.actor, no_restart=True)
        raise
    if not handles:
        raise ShardUnavailableError("no alive node passed the filter: no pool shard started")
    refs = [h.actor.info.remote() for h in handles]
    try:
        infos = [_decode(raw, ShardInfo) for raw in ray.get(refs, timeout=ready_deadline_s)]
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        stop_shards(handles)
        raise ShardUnavailableError(f"pool shards not ready within {ready_deadline_s}s: {exc}") from exc
    for h, info in zip(handles, infos, strict=True):
        if info.node_id != h.node_id:
            stop_shards(handles)
            raise ShardUnavailableError(f"shard {h.shard_id} landed on node {info.node_id}, not {h.node_id}")
    return handles


def stop_shards(handles: Sequence[ShardHandle], deadline_s: float = 10.0) -> None:
    """Close every shard (bounded by ``deadline_s``), then kill the actors."""
    refs = [h.actor.close.remote() for h in handles]
    try:
        ray.get(refs, timeout=deadline_s)
    except Exception as exc:  # a dead or stuck shard is killed below regardless
        log.warning("stop_shards: close did not finish cleanly: %s", exc)
    for h in handles:
        ray.kill(h.actor, no_restart=True)
