"""NixlEndpoint: ``kvpool.transfer.base.TransferEndpoint`` on NIXL (UCX backend), host (DRAM) memory.

Created by a pool shard (passive side: registers its DRAM arena, publishes ``metadata()`` through Ray; it reads from a
peer shard only for a ``pull``, ``kvpool.shard.pull``) and by clients (the connector's worker side, test actors, the
transfer bench) that ``add_peer`` and ``read``/``write``. Conformance:
``tests/integration/test_transport_conformance.py`` (shared with ``TcpEndpoint``).

Mechanism:
- One ``nixl_agent`` per endpoint, named ``"<agent_name>@<epoch>"`` so a restarted process never collides with
  what its peers still hold for the previous incarnation; ``add_peer`` with a newer epoch calls
  ``remove_remote_agent`` on the old one (which also disconnects it) before ``add_remote_agent``.
- ``AgentMetadata.payload`` is a msgpack ``NixlPayload``: the NIXL agent metadata blob plus, per region, its id,
  base address and length, so the client builds remote descriptors itself (no pickled descriptor lists).
- A call is one NIXL transfer request however many ops it has. Uniform batches (every op ``L`` bytes at
  ``L``-aligned offsets: KV blocks) use prepared descriptor lists (``prep_xfer_dlist`` once per block size and
  side, cached; ``make_prepped_xfer`` by index); anything else uses ``initialize_xfer`` with Nx3 descriptor arrays.
- Completion is polled (``check_xfer_state``) with a short backoff until the deadline. On expiry the request is
  released, which asks NIXL/UCX to cancel it; every op of it is reported failed. A refused cancel is retried (the
  request polled, then released again) for ``fence_s``; a request still not released then is kept (released again
  at ``close()``) and the result says ``settled=False``: the transfer may still land, and the caller fences (closes
  this endpoint: destroying the agent ends its transfers) before the memory is used again. The bytes of failed READ
  ops in local memory are undefined (a cancelled transfer may have written part of them): the caller treats them
  as not loaded.

NIXL / UCX facts this relies on (nixl-cu12 1.5.1, measured here):
- The UCX backend init param ``ucx_devices`` is UCX_NET_DEVICES (tests: ``"lo"``); ``ucx_error_handling_mode``
  ``"peer"`` (default) is what turns a dead peer into an error instead of a hang, and it needs a transport with a
  peer-failure handler for active messages (tcp): ``UCX_TLS=sm,self`` alone fails backend creation. With UCX_TLS
  unset UCX uses tcp for wire-up/AM and CMA (``process_vm_readv``) for same-host RMA.
- NIXL's python logger writes INFO to stdout; ``load_nixl`` sends it to stderr at WARNING (``python_log_level``).
- The passive side needs the progress thread (connection wire-up is handled there). The python wrapper hard-codes
  ``pthrDelay=0``, which spins ~35% of a core per idle agent; ``progress_delay_us`` sets it (100 us: ~2%).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

from kvpool.transfer.base import (
    TRANSFER_WIRE_VERSION,
    AgentMetadata,
    BlockOp,
    RegionDesc,
    StaleMetadataError,
    TransferEndpoint,
    TransferResult,
)
from kvpool.transfer.common import (
    LENGTH,
    LOCAL_OFFSET,
    LOCAL_REGION,
    REMOTE_OFFSET,
    REMOTE_REGION,
    Admission,
    Deadline,
    OpTable,
    admit,
    all_failed,
    all_ok,
    buffer_address,
    new_epoch,
)
from kvpool.transfer.metrics import TransferMetrics, transfer_metrics

log = logging.getLogger(__name__)

NIXL_PAYLOAD_VERSION = 1
_DRAM = "DRAM"
_LOCAL = "NIXL_INIT_AGENT"
_DRAIN_S = 0.02  # how long ``close`` progresses the worker after closing its peers' endpoints


class NixlOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Typed options of ``NixlEndpoint`` (defaults in one place)."""

    backend: Literal["UCX"] = "UCX"  # the NIXL plugin that moves the bytes
    ucx_devices: str = ""  # UCX_NET_DEVICES for this agent ("" = UCX default; tests: "lo")
    ucx_error_handling: Literal["peer", "none"] = "peer"  # "peer": a dead peer is an error, not a hang
    progress_thread: bool = True  # required on the passive (shard) side
    progress_delay_us: int = 100  # progress thread poll delay; 0 = busy spin (the nixl python default)
    prepped: bool = True  # prepared descriptor lists for uniform block batches
    max_prepped_descs: int = 1 << 20  # per side and block size; larger regions fall back to initialize_xfer
    poll_max_sleep_s: float = 0.0005  # ceiling of the completion-poll backoff
    fence_s: float = 1.0  # a late transfer whose cancel NIXL refuses is retried this long, then reported unsettled
    python_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"  # NIXL's python logger ("nixl")

    def __post_init__(self) -> None:
        if self.progress_delay_us < 0:
            raise ValueError("progress_delay_us must be >= 0")
        if self.max_prepped_descs <= 0:
            raise ValueError("max_prepped_descs must be > 0")
        if not 0 < self.poll_max_sleep_s <= 0.1:
            raise ValueError("poll_max_sleep_s must be in (0, 0.1]")
        if self.fence_s < 0:
            raise ValueError("fence_s must be >= 0")


class NixlRegion(msgspec.Struct, frozen=True, array_like=True):
    region_id: int
    addr: int
    length: int


class NixlPayload(msgspec.Struct, frozen=True, tag="nixl_payload"):
    """``AgentMetadata.payload`` of the NIXL backend."""

    version: int
    nixl_agent: str
    plugin: str
    agent_md: bytes
    regions: list[NixlRegion]


def load_nixl(python_log_level: str = "WARNING") -> types.ModuleType:
    """The NIXL python API module (``nixl_cu12`` wheel, or the ``nixl`` meta package).

    NIXL's python logger ("nixl") logs INFO lines to *stdout* on every agent and backend creation, which corrupts
    machine-readable output (``kvstack bench transfer --json``). Its handlers are pointed at stderr and its level set
    to ``python_log_level`` (process-wide, idempotent).
    """
    try:
        import nixl_cu12._api as api
    except ImportError:
        try:
            import nixl._api as api  # type: ignore[no-redef]
        except ImportError as exc:
            raise RuntimeError("NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)") from exc
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.setLevel(python_log_level)
    for handler in nixl_logger.handlers:
        if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
            handler.setStream(sys.stderr)
    return api


def nixl_errors(api: types.ModuleType) -> tuple[type[BaseException], ...]:
    """Every exception type the NIXL bindings raise (they share no base class)."""
    bind = getattr(api, "nixlBind")  # noqa: B009 (module attribute the stubs do not know)
    return tuple(obj for obj in vars(bind).values() if isinstance(obj, type) and issubclass(obj, Exception)) or (
        Exception,
    )


def make_agent(api: types.ModuleType, name: str, *, progress_thread: bool, progress_delay_us: int) -> Any:
    """A ``nixl_agent`` without backends, with the progress-thread delay the wrapper does not expose.

    ``nixl_agent.__init__`` builds ``nixlBind.nixlAgentConfig`` itself and sets ``pthrDelay = 0``. For the length of
    the constructor the module-level ``nixlBind`` is swapped for a proxy whose ``nixlAgent`` sets our delay; the
    proxy forwards everything else, so a concurrent user of the module sees no difference.
    """
    real = getattr(api, "nixlBind")  # noqa: B009

    def agent_ctor(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = progress_delay_us
        return real.nixlAgent(agent_name, cfg)

    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    proxy.nixlAgent = agent_ctor
    conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
    with _AGENT_CTOR_LOCK:
        setattr(api, "nixlBind", proxy)  # noqa: B010
        try:
            return api.nixl_agent(name, conf)
        finally:
            setattr(api, "nixlBind", real)  # noqa: B010


_AGENT_CTOR_LOCK = threading.Lock()


@dataclass
class _Region:
    view: np.ndarray
    addr: int
    length: int
    reg: Any  # nixlRegDList, for deregistration


@dataclass
class _Prepped:
    """A prepared descriptor list over all regions of one side, cut in blocks of ``block`` bytes."""

    handle: Any
    block: int
    region_ids: np.ndarray  # sorted region ids
    first_index: np.ndarray  # index of each region's first block, aligned with region_ids
    first_of: dict[int, int]  # the same as a dict (small batches)


@dataclass
class _Peer:
    meta: AgentMetadata
    nixl_name: str
    regions: dict[int, NixlRegion]
    prepped: dict[int, _Prepped | None] = field(default_factory=dict)


class NixlEndpoint(TransferEndpoint):
    backend = "nixl"

    def __init__(
        self, agent_name: str, options: NixlOptions | None = None, metrics: TransferMetrics | None = None
    ) -> None:
        if not agent_name:
            raise ValueError("agent_name must be non-empty")
        self._name = agent_name
        self._options = options or NixlOptions()
        self._metrics = metrics or transfer_metrics()
        self._epoch = new_epoch()
        self._api = load_nixl(self._options.python_log_level)
        self._errors = nixl_errors(self._api)
        self._nixl_name = f"{agent_name}@{self._epoch}"
        opts = self._options
        self._agent = make_agent(
            self._api, self._nixl_name, progress_thread=opts.progress_thread, progress_delay_us=opts.progress_delay_us
        )
        params = dict(self._agent.get_plugin_params(opts.backend))
        if opts.ucx_devices:
            params["ucx_devices"] = opts.ucx_devices
        params["ucx_error_handling_mode"] = opts.ucx_error_handling
        self._agent.create_backend(opts.backend, params)
        self._lock = threading.RLock()
        self._regions: dict[int, _Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._local_prepped: dict[int, _Prepped | None] = {}
        self._orphans: list[Any] = []  # xfer handles whose cancel was refused; released again at close()
        self._closed = False

    # ---- TransferEndpoint -----------------------------------------------------------------------------------
    def register(self, buffer: memoryview) -> int:
        view, _, addr, length = buffer_address(buffer)
        with self._lock:
            self._check_open()
            reg = self._agent.register_memory([(addr, length, 0, "")], _DRAM, backends=[self._options.backend])
            region_id = len(self._regions)
            self._regions[region_id] = _Region(view=view, addr=addr, length=length, reg=reg)
            self._release_prepped(self._local_prepped)  # they cover the old set of regions
        return region_id

    def metadata(self) -> AgentMetadata:
        with self._lock:
            self._check_open()
            regions = [NixlRegion(rid, r.addr, r.length) for rid, r in sorted(self._regions.items())]
            payload = NixlPayload(
                version=NIXL_PAYLOAD_VERSION,
                nixl_agent=self._nixl_name,
                plugin=self._options.backend,
                agent_md=self._agent.get_agent_metadata(),
                regions=regions,
            )
        return AgentMetadata(
            version=TRANSFER_WIRE_VERSION,
            backend=self.backend,
            agent_name=self._name,
            epoch=self._epoch,
            regions=[RegionDesc(r.region_id, r.length) for r in regions],
            payload=msgspec.msgpack.encode(payload),
        )

    def add_peer(self, meta: AgentMetadata) -> None:
        with self._lock:
            self._check_open()
            current = self._peers.get(meta.agent_name)
            action = admit(meta, self.backend, current.meta if current else None)
            if action is Admission.KEEP:
                return
            payload = _decode_payload(meta, self._options.backend)
            if current is not None:
                self._drop_peer(current)
            try:
                loaded = self._agent.add_remote_agent(payload.agent_md)
            except self._errors as exc:
                raise StaleMetadataError(f"peer {meta.agent_name!r}: NIXL refused its metadata: {exc}") from exc
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != payload.nixl_agent:
                self._agent.remove_remote_agent(loaded_name)
                raise StaleMetadataError(
                    f"peer {meta.agent_name!r}: NIXL metadata is for agent {loaded_name!r}, payload says "
                    f"{payload.nixl_agent!r}"
                )
            self._peers[meta.agent_name] = _Peer(
                meta=meta, nixl_name=payload.nixl_agent, regions={r.region_id: r for r in payload.regions}
            )

    def remove_peer(self, agent_name: str) -> None:
        with self._lock:
            peer = self._peers.pop(agent_name, None)
            if peer is not None:
                self._drop_peer(peer)

    def read(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
             ) -> TransferResult:
        return self._transfer("READ", peer, ops, deadline_s)

    def write(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
              ) -> TransferResult:
        return self._transfer("WRITE", peer, ops, deadline_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in list(self._peers.values()):
                self._drop_peer(peer)
            self._peers.clear()
            self._drain()
            self._release_prepped(self._local_prepped)
            for handle in self._orphans:
                try:
                    handle.release()
                except self._errors:
                    pass
            self._orphans.clear()
            for region in self._regions.values():
                try:
                    self._agent.deregister_memory(region.reg, backends=[self._options.backend])
                except self._errors:
                    pass
            self._regions.clear()
            self._agent = None

    # ---- internals ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"endpoint {self._name!r} is closed")

    def _drain(self) -> None:
        """Progress the UCX worker for ``_DRAIN_S`` before the agent is destroyed. ``remove_remote_agent`` closes a
        peer's UCX endpoint without waiting for the close to finish, and only progress finishes it; a client endpoint
        has no progress thread. Destroying a worker whose endpoint closes are still in flight can crash in UCX's
        teardown (mercury-hpc/mercury#855 progresses its workers for the same reason): once, in CI, destroying the
        agent right after its peer was killed aborted the process."""
        drain = Deadline(_DRAIN_S)
        while True:
            try:
                self._agent.get_new_notifs()  # NIXL's Python entry to the backend's progress loop
            except self._errors:
                return
            if drain.expired():
                return
            time.sleep(0.001)

    def _drop_peer(self, peer: _Peer) -> None:
        self._release_prepped(peer.prepped)
        try:
            self._agent.remove_remote_agent(peer.nixl_name)
        except self._errors:
            pass  # already gone (NIXL forgets agents it saw disconnect)

    def _release_prepped(self, cache: dict[int, _Prepped | None]) -> None:
        for prepped in cache.values():
            if prepped is not None:
                try:
                    prepped.handle.release()
                except self._errors:
                    pass
        cache.clear()

    def _transfer(self, op: str, peer_name: str, ops: Sequence[BlockOp], deadline_s: float) -> TransferResult:
        direction = "read" if op == "READ" else "write"
        deadline = Deadline(deadline_s)
        table = OpTable(ops)
        with self._lock:
            self._check_open()
            table.check_local({rid: r.length for rid, r in self._regions.items()})
            peer = self._peers.get(peer_name)
            if peer is not None:
                table.check_remote({rid: r.length for rid, r in peer.regions.items()}, peer_name)
        if peer is None:
            result = all_failed(len(table), deadline.elapsed(), f"unknown peer {peer_name!r}")
        elif not len(table):
            result = all_ok(table, 0.0)
        elif deadline.expired():
            result = all_failed(len(table), deadline.elapsed(), "deadline expired before the transfer started")
        else:
            result = self._run(op, peer, table, deadline)
        self._metrics.observe(self.backend, direction, result)
        return result

    def _run(self, op: str, peer: _Peer, table: OpTable, deadline: Deadline) -> TransferResult:
        n = len(table)
        handle = None
        try:
            with self._lock:
                if self._peers.get(peer.meta.agent_name) is not peer:
                    return all_failed(n, deadline.elapsed(), f"peer {peer.meta.agent_name!r} was removed")
                handle = self._make_request(op, peer, table)
                state = self._agent.transfer(handle)
        except self._errors as exc:
            # A post that fails part way (the peer disconnected after the request was made) may have started some of
            # its UCX operations: the request is cancelled and released like a late one, never left to the GC.
            settled = True if handle is None else self._abandon(handle)
            return all_failed(n, deadline.elapsed(), f"peer {peer.meta.agent_name!r}: NIXL {type(exc).__name__}: {exc}",
                              settled=settled)
        sleep = 0.0
        while state == "PROC":
            if deadline.expired():
                settled = self._abandon(handle)
                return all_failed(n, deadline.elapsed(), f"peer {peer.meta.agent_name!r}: deadline expired",
                                  settled=settled)
            if sleep:
                time.sleep(min(sleep, max(deadline.remaining(), 0.0)))
            sleep = min(self._options.poll_max_sleep_s, sleep * 2 if sleep else 0.00002)
            try:
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            except self._errors as exc:
                settled = self._abandon(handle)
                return all_failed(n, deadline.elapsed(), f"peer {peer.meta.agent_name!r}: NIXL {exc}",
                                  settled=settled)
        if state == "DONE":
            self._release(handle)
            return all_ok(table, deadline.elapsed())
        settled = self._abandon(handle)
        return all_failed(n, deadline.elapsed(), f"peer {peer.meta.agent_name!r}: transfer error", settled=settled)

    def _release(self, handle: Any, *, keep: bool = True) -> bool:
        """Release a request (cancelling it if it still runs); True when NIXL took it. A refused release keeps the
        handle for ``close()`` unless ``keep`` is False (the caller retries)."""
        with self._lock:
            try:
                handle.release()
            except self._errors:
                if keep:
                    self._orphans.append(handle)
                return False
        return True

    def _abandon(self, handle: Any) -> bool:
        """Cancel a transfer that is late or broken: released, or retried (polled, released again) for
        ``fence_s``; True when it is released (nothing of it can land any more), False when it is kept for
        ``close()`` and may still land."""
        fence = Deadline(self._options.fence_s)
        while not self._release(handle, keep=False):
            if fence.expired():
                with self._lock:
                    self._orphans.append(handle)
                log.warning("NIXL refused to cancel a late transfer for %.1f s: reported unsettled",
                            self._options.fence_s)
                return False
            time.sleep(min(0.01, max(fence.remaining(), 0.0)))
            try:
                with self._lock:
                    self._agent.check_xfer_state(handle)  # progress: a finished request can be released
            except self._errors:
                pass
        return True

    def _make_request(self, op: str, peer: _Peer, table: OpTable) -> Any:
        rows = table.rows
        block = rows[0][LENGTH]
        small = len(rows) <= OpTable.SMALL  # plain Python beats numpy's per-call overhead on a few rows
        if small:
            uniform = all(
                r[LENGTH] == block and r[LOCAL_OFFSET] % block == 0 and r[REMOTE_OFFSET] % block == 0 for r in rows
            )
        else:
            arr = table.arr
            uniform = bool(
                (arr[:, LENGTH] == block).all()
                and not (arr[:, LOCAL_OFFSET] % block).any()
                and not (arr[:, REMOTE_OFFSET] % block).any()
            )
        if self._options.prepped and uniform:
            local = self._prepped(self._local_prepped, _LOCAL, block, self._regions_as_nixl())
            remote = self._prepped(peer.prepped, peer.nixl_name, block, peer.regions)
            if local is not None and remote is not None:
                if small:
                    lfirst, rfirst = local.first_of, remote.first_of
                    local_idx: Any = [lfirst[r[LOCAL_REGION]] + r[LOCAL_OFFSET] // block for r in rows]
                    remote_idx: Any = [rfirst[r[REMOTE_REGION]] + r[REMOTE_OFFSET] // block for r in rows]
                else:
                    local_idx = _indices(local, arr[:, LOCAL_REGION], arr[:, LOCAL_OFFSET])
                    remote_idx = _indices(remote, arr[:, REMOTE_REGION], arr[:, REMOTE_OFFSET])
                return self._agent.make_prepped_xfer(
                    op, local.handle, local_idx, remote.handle, remote_idx, backends=[self._options.backend]
                )
        arr = table.arr
        lengths = arr[:, LENGTH]
        local_base = _bases(arr[:, LOCAL_REGION], {rid: r.addr for rid, r in self._regions.items()})
        remote_base = _bases(arr[:, REMOTE_REGION], {rid: r.addr for rid, r in peer.regions.items()})
        local_descs = _descs(local_base + arr[:, LOCAL_OFFSET].astype(np.uint64), lengths)
        remote_descs = _descs(remote_base + arr[:, REMOTE_OFFSET].astype(np.uint64), lengths)
        return self._agent.initialize_xfer(
            op,
            self._agent.get_xfer_descs(local_descs, _DRAM),
            self._agent.get_xfer_descs(remote_descs, _DRAM),
            peer.nixl_name,
            backends=[self._options.backend],
        )

    def _regions_as_nixl(self) -> dict[int, NixlRegion]:
        return {rid: NixlRegion(rid, r.addr, r.length) for rid, r in self._regions.items()}

    def _prepped(
        self, cache: dict[int, _Prepped | None], agent: str, block: int, regions: dict[int, NixlRegion]
    ) -> _Prepped | None:
        if block in cache:
            return cache[block]
        counts = {rid: r.length // block for rid, r in sorted(regions.items())}
        total = sum(counts.values())
        if total == 0 or total > self._options.max_prepped_descs:
            cache[block] = None  # remember the miss: initialize_xfer for this size
            return None
        descs = np.zeros((total, 3), dtype=np.uint64)
        first: dict[int, int] = {}
        at = 0
        for rid, count in counts.items():
            first[rid] = at
            descs[at : at + count, 0] = regions[rid].addr + np.arange(count, dtype=np.uint64) * np.uint64(block)
            at += count
        descs[:, 1] = block
        handle = self._agent.prep_xfer_dlist(agent, descs, _DRAM, backends=[self._options.backend])
        ids = np.array(sorted(first), dtype=np.int64)
        prepped = _Prepped(
            handle=handle,
            block=block,
            region_ids=ids,
            first_index=np.array([first[int(i)] for i in ids], np.int64),
            first_of=first,
        )
        cache[block] = prepped
        return prepped


def _decode_payload(meta: AgentMetadata, plugin: str) -> NixlPayload:
    try:
        payload = msgspec.msgpack.decode(meta.payload, type=NixlPayload)
    except msgspec.DecodeError as exc:
        raise StaleMetadataError(f"peer {meta.agent_name!r}: undecodable NIXL payload: {exc}") from exc
    if payload.version != NIXL_PAYLOAD_VERSION:
        raise StaleMetadataError(
            f"peer {meta.agent_name!r}: NIXL payload version {payload.version}, expected {NIXL_PAYLOAD_VERSION}"
        )
    if payload.plugin != plugin:
        raise StaleMetadataError(
            f"peer {meta.agent_name!r}: NIXL plugin {payload.plugin!r}, this endpoint uses {plugin!r}"
        )
    if payload.nixl_agent != f"{meta.agent_name}@{meta.epoch}":
        raise StaleMetadataError(
            f"peer {meta.agent_name!r}: NIXL agent {payload.nixl_agent!r} does not match its epoch"
        )
    described = {(r.region_id, r.length) for r in payload.regions}
    if described != {(r.region_id, r.length) for r in meta.regions}:
        raise StaleMetadataError(f"peer {meta.agent_name!r}: NIXL payload regions differ from the metadata regions")
    return payload


def _bases(region_ids: np.ndarray, addr: dict[int, int]) -> np.ndarray:
    ids = np.fromiter(addr.keys(), dtype=np.int64, count=len(addr))
    addrs = np.fromiter(addr.values(), dtype=np.uint64, count=len(addr))
    order = np.argsort(ids)
    return addrs[order][np.searchsorted(ids[order], region_ids)]


def _descs(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    descs = np.zeros((len(addrs), 3), dtype=np.uint64)
    descs[:, 0] = addrs
    descs[:, 1] = lengths.astype(np.uint64)
    return descs


def _indices(prepped: _Prepped, region_ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if len(prepped.region_ids) == 1:
        base: np.ndarray | int = int(prepped.first_index[0])
    else:
        base = prepped.first_index[np.searchsorted(prepped.region_ids, region_ids)]
    return (base + offsets // prepped.block).astype(np.int32)
