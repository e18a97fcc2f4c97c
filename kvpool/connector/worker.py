"""The connector's worker role: register the KV memory, pull leased blocks into it, push new blocks to the pool.

vLLM's model runner (one per worker process; in-process engines: the engine-core process) calls, through
``KvPoolConnector``:
- ``register_kv_caches(kv_caches)`` once after allocating the KV cache: derives the ``KvLayout`` from the tensors
  and the KV cache config (``kvpool.connector.layout``) and REFUSES to start (raises) on an unknown layout kind,
  a layout it cannot describe exactly, or a local shard whose slots are too small for one block. Then it registers
  every KV storage with a transfer endpoint (``kvpool.transfer``), so bytes move straight between the shard's
  arena and the KV cache blocks.
- ``get_handshake_metadata()`` right after: the layout, for the scheduler role.
- ``start_load_kv`` every step (after the forward; before it when the step has a synchronous load): queues the
  step's ``LoadSpec``s with the background loader (``kvpool.connector.loader``) and returns; an inline one
  (``LoadSpec.inline``, "Inline loads" in ``kvpool.connector.scheduler``) it reads there and then, through shared
  memory only. On the loader's thread: one transfer read per shard for all queued loads, straight into the cache
  blocks, then a checksum check per pool slot. A block that fails (peer dead, deadline, checksum, not leased, its
  shard's breaker open) is a load error: ``get_block_ids_with_load_errors``
  (dense) or the whole request in ``failed_recving`` (hybrids, where vLLM cannot take block-level errors); vLLM
  recomputes.
- ``wait_for_save`` every step after the forward: copies the blocks to save into the background saver's staging
  slots and returns (``kvpool.connector.saver``: its thread reserves on the local shard, writes, and commits with
  the checksums, which the shard verifies). A failed or dropped save is a future miss, never an error or a wait.
- ``get_transfer_results`` every step: the requests whose load finished since the last step (failed ones included),
  with their failed block ids taken at the same moment (for ``get_block_ids_with_load_errors`` right after).

Tensor parallelism: every TP rank runs a worker role over its own share of the heads. It saves its blocks under its
rank's keys (``kvpool.keys.rank_key``: the scheduler plans saves under rank 0's) and reports them back under rank
0's, so the engine's aggregated ``SaveReport`` counts a block saved only when no rank failed it; it loads its
own slots of a ``LoadSpec`` (the scheduler leased every rank's). vLLM waits for every rank's load before it
schedules the request. Pipeline parallelism is refused (``check_parallelism``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvpool.checksum import slot_checksum
from kvpool.connector.config import ConnectorConfig
from kvpool.connector.loader import BlockLoader
from kvpool.connector.layout import (
    GroupSpans,
    PoolGeometry,
    derive_layout,
    group_kinds,
    model_digest,
    pool_plan,
    tensor_info,
)
from kvpool.connector.meta import KvPoolHandshake, KvPoolMetadata, LoadBlock, LoadSpec, SaveReport, TransferRecord
from kvpool.connector.pool import KnownPeers, PoolShards
from kvpool.connector.saver import BlockSaver, SaveStats
from kvpool.connector.weights import weights_identity
from kvpool.keys import rank_key
from kvpool.layout import KvLayout, LayoutError
from kvpool.transfer.base import BlockOp, TransferEndpoint

log = logging.getLogger(__name__)

TRANSFER_RECORDS = 512  # finished loads kept for the replica's calibration reports (older ones are dropped)


@dataclass
class WorkerStats:
    """Load counters (the save counters are the saver's ``SaveStats``)."""

    loads: int = 0
    load_failures: int = 0
    loads_skipped: int = 0  # failed at once: their shard's breaker was open (it failed recently)
    blocks_loaded: int = 0
    blocks_failed: int = 0
    checksum_failures: int = 0
    bytes_read: int = 0
    bytes_read_shm: int = 0  # of bytes_read: through shared memory (the own node's shard, kvpool.transfer.shm)
    read_seconds: float = 0.0
    load_fences: int = 0  # reads that might still land after their deadline: the endpoint was closed and remade
    loads_inline: int = 0  # of loads: read before the forward of their step (``LoadSpec.inline``)
    inline_unready: int = 0  # of those: failed at once, the shard not yet mapped here (its mapping is fetched)


def make_client_endpoint(cfg: ConnectorConfig, agent_name: str) -> TransferEndpoint:
    """The worker's transfer endpoint (client side: it never serves). NIXL runs without its progress thread here:
    only a passive side needs one (the shards), an initiator progresses its own transfers while it polls them, and
    the thread would wake every ``progress_delay_us`` on the engine's own core (~3% of it per agent, two agents per
    worker: loads and saves)."""
    if cfg.backend == "nixl":
        from kvpool.transfer.nixl import NixlEndpoint, NixlOptions

        opts = {"progress_thread": False, **cfg.endpoint_options}
        return NixlEndpoint(agent_name, options=msgspec.convert(opts, NixlOptions))
    from kvpool.transfer.tcp import TcpEndpoint, TcpOptions

    opts = {"serve": False, **cfg.endpoint_options}
    return TcpEndpoint(agent_name, options=msgspec.convert(opts, TcpOptions))


def make_same_host_endpoint(cfg: ConnectorConfig, agent_name: str) -> TransferEndpoint | None:
    """The worker's shared-memory endpoint for its own node's shard (``kvpool.transfer.shm``), None when off."""
    if not cfg.shared_memory:
        return None
    from kvpool.transfer.shm import ShmEndpoint

    return ShmEndpoint(f"{agent_name}-shm")


def check_parallelism(parallel_config: Any) -> int:
    """The engine's tensor-parallel world size (each rank keys its heads apart: module docstring). Refuses
    (``LayoutError``, the engine does not start) a pipeline-parallel engine: each stage holds other layers of the
    same blocks, and the pool keys and checks one layout per engine, so such an engine runs without the pool rather
    than on KV it cannot describe."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise LayoutError(f"the kvpool connector keys the KV of a whole layer stack per rank; "
                          f"pipeline_parallel_size={pp} splits the layers over stages: run this engine with "
                          "app.pool.enabled: false")
    return tp


def tensor_parallel_rank(world: int) -> int:
    """This worker's tensor-parallel rank (vLLM's process group; 0 for a single-rank engine)."""
    if world <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.tp_world = check_parallelism(vllm_config.parallel_config)
        self.tp_rank = tensor_parallel_rank(self.tp_world)
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.plan = pool_plan(group_kinds(kv_cache_config))  # unknown kinds refuse here already
        name = vllm_config.model_config.served_model_name
        self.model_id = cfg.model_id or (name[0] if isinstance(name, list) else str(name))
        hf = vllm_config.model_config.hf_config
        hf_json = hf.to_json_string(use_diff=False) if hasattr(hf, "to_json_string") else repr(hf)
        mc = vllm_config.model_config
        self.digest = model_digest(hf_json, kv_cache_config, str(vllm_config.cache_config.cache_dtype),
                                   weights=weights_identity(mc.model, getattr(mc, "revision", None)),
                                   quantization=str(getattr(mc, "quantization", None) or ""),
                                   tensor_parallel=self.tp_world)
        self.layout: KvLayout | None = None
        self.geometry: PoolGeometry | None = None
        self.agent_name = f"kvpool-engine-{uuid.uuid4().hex[:12]}"
        self.shards = PoolShards(cfg)
        self.saver_shards: PoolShards | None = None
        self.stats = WorkerStats()
        self._arrays: list[np.ndarray] = []  # uint8 views of the KV storages (kept alive while registered)
        self._regions: list[int] = []  # endpoint region id per storage index
        self.saver: BlockSaver | None = None
        self.peers: KnownPeers | None = None  # the shards whose transfer metadata ``endpoint`` holds
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()  # of loads posted but not yet reported
        self._harvested_invalid: set[int] = set()  # of loads the last transfer_results reported
        self._results_lock = threading.Lock()  # the loader thread posts, the model runner's thread takes
        self.loader: BlockLoader | None = None
        self._records: deque[TransferRecord] = deque(maxlen=TRANSFER_RECORDS)
        self._meta: KvPoolMetadata | None = None
        self._mapping: set[tuple[str, str]] = set()  # (agent, epoch) being mapped for inline loads (loader thread)
        self.shm_shard = ""  # the own node's shard, mapped through shared memory at startup (the handshake says so)
        # a TP rank > 0's own key -> (the planned rank-0 key, saves staged and not yet reported)
        self._planned_key: dict[bytes, tuple[bytes, int]] = {}

    @property
    def endpoint(self) -> TransferEndpoint | None:
        """The load endpoint: ``peers``' transfer endpoint (a fence replaces it), None before the KV caches."""
        return self.peers.transfer_endpoint if self.peers is not None else None

    # ------------------------------------------------------------------ startup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        import torch

        infos = {name: tensor_info(t) for name, t in kv_caches.items()}
        layout, geometry, storages = derive_layout(self.model_id, self.digest, self.kv_cache_config, infos)
        self.layout, self.geometry = layout, geometry
        log.info("kvpool connector: layout %s, %d-byte blocks, %d-byte states, %d storage(s)",
                 layout.fingerprint, geometry.block_payload, geometry.state_payload, len(storages))
        if not self.plan.usable:
            return
        local = self._check_local_slot(geometry.slot_bytes_needed)
        self.peers = self._peers_of(self.agent_name)
        by_ptr = {info.storage_ptr: kv_caches[name] for name, info in infos.items()}
        for ptr, nbytes in storages:
            storage = by_ptr[ptr].untyped_storage()
            u8 = torch.empty(0, dtype=torch.uint8)
            u8.set_(storage, 0, (nbytes,), (1,))
            arr = u8.numpy()
            self._arrays.append(arr)
            self._regions.append(self.peers.register(memoryview(arr)))
        if local is not None and self.cfg.inline_load_max_bytes > 0:
            # the own node's shard, mapped now: an inline load must find it so (it never fetches on the forward)
            try:
                self._ensure_peer(local.shard_id, local.agent_name, local.epoch)
            except Exception as exc:  # noqa: BLE001 - no inline loads then (the handshake names no shard)
                log.warning("kvpool connector: local shard %s not mapped at startup: %s", local.shard_id, exc)
            if self.peers.shared(local.agent_name, local.epoch):
                self.shm_shard = local.shard_id
        if self.cfg.save:
            # its own clients (and breaker): the saver's thread shares nothing with the loads
            self.saver_shards = saver_shards = PoolShards(self.cfg)
            name = f"{self.agent_name}-saver"
            peers = self._peers_of(name)
            # a lowered saver gets a catch-up lane (its own endpoints) for the saves it leaves waiting too long
            lagged = self.cfg.saver_nice > 0 and self.cfg.saver_max_lag_s > 0
            self.saver = BlockSaver(peers, saver_shards.client, saver_shards.forget,
                                    slot_bytes=geometry.slot_bytes_needed, staging_bytes=self.cfg.save_staging_bytes,
                                    deadline_s=self.cfg.save_deadline_s, model=self.model_id,
                                    nice=self.cfg.saver_nice,
                                    catch_up_peers=self._peers_of(f"{name}-catch-up") if lagged else None,
                                    max_lag_s=self.cfg.saver_max_lag_s)

    def _peers_of(self, agent_name: str) -> KnownPeers:
        """Endpoints for ``agent_name``: a transfer endpoint (remade by a fence) and the shared-memory one."""
        def make() -> TransferEndpoint:
            return make_client_endpoint(self.cfg, agent_name)

        return KnownPeers(make(), make_same_host_endpoint(self.cfg, agent_name), remake=make)

    def _check_local_slot(self, needed: int) -> Any:
        """Refuse to start when the local shard's slots cannot hold one block (a misconfigured pool). Returns its
        ``ShardInfo`` (None: no local shard, or it did not answer)."""
        local = self.shards.local_shard_id()
        if local is None:
            return None
        try:
            info = self.shards.client(local).info()
        except Exception as exc:  # an unreachable shard is a runtime miss, not a startup error
            log.warning("kvpool connector: local shard %s unreachable at startup: %s", local, exc)
            return None
        if info.slot_bytes < needed:
            raise LayoutError(
                f"kvpool shard {local} has {info.slot_bytes}-byte slots but one pool block of this model needs "
                f"{needed} bytes (layout {self.layout.fingerprint if self.layout else '?'}); refusing to start"
            )
        return info

    def handshake(self) -> KvPoolHandshake | None:
        if self.layout is None or self.geometry is None:
            return None
        return KvPoolHandshake(self.layout.encode(), self.geometry.slot_bytes_needed, self.shm_shard)

    # ------------------------------------------------------------------ per step
    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, KvPoolMetadata) else None

    def clear(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Hand this step's loads to the background loader (``kvpool.connector.loader``) and return: the reads and
        checksums run on its thread; ``transfer_results`` reports each request once its load is done. Inline loads
        (``LoadSpec.inline``: vLLM did not make their requests wait, and calls this before the forward) are read
        here: one shared-memory copy from the own node's shard and the checksums, never a call to the shard (one not
        mapped yet fails at once — vLLM recomputes those blocks — and is mapped on the loader's thread for the
        next)."""
        meta = self._meta
        if meta is None or not meta.loads:
            return
        inline = [spec for spec in meta.loads if spec.inline]
        if inline:
            self._load_batch(inline, inline=True)
            queued = [spec for spec in meta.loads if not spec.inline]
        else:
            queued = list(meta.loads)
        if queued:
            self._background().submit(queued)

    def _background(self) -> BlockLoader:
        if self.loader is None:
            self.loader = BlockLoader(self._load_batch, name=f"{self.agent_name}-loader")
        return self.loader

    def wait_loads(self, timeout_s: float) -> bool:
        """Wait (bounded) until every load handed over so far has run (tests, fault injection)."""
        return self.loader is None or self.loader.wait_idle(timeout_s)

    def _ensure_peer(self, shard_id: str, agent_name: str, epoch: str) -> None:
        """Trust the shard's current transfer metadata (refetched when the shard restarted); the own node's shard
        also through shared memory when it exports its arena. The caller (``_load_group``) already passed the
        shard's breaker for this load: the metadata calls do not ask it again (a second ask refused the breaker's
        own half-open probe: after a shard restarted under its name — a new epoch, so its metadata is fetched —
        loads from it failed forever)."""
        assert self.peers is not None
        same_node = shard_id == self.shards.local_shard_id(wait=False)
        self.peers.ensure(agent_name, epoch, lambda: self.shards.client(shard_id, allowed=True).transfer_metadata(),
                          (lambda: self.shards.client(shard_id, allowed=True).shm_metadata()) if same_node else None)

    def _items(self, spec: LoadSpec) -> list[tuple[LoadBlock, list[GroupSpans]]]:
        geo = self.geometry
        if geo is None:
            return []
        world, rank = max(spec.world, 1), self.tp_rank
        if world != self.tp_world:  # never expected: a spec planned for another engine shape is a failed load
            return [(LoadBlock({}, None), geo.block_groups)]
        items = [(b, geo.block_groups) for b in spec.blocks[rank::world]]
        items += [(b, geo.state_groups) for b in spec.states[rank::world]]
        return items

    def _load_batch(self, specs: list[LoadSpec], inline: bool = False) -> None:
        """The loader thread (``inline``: the model runner's, before the forward): every spec of the batch, one
        transfer read per shard (loads from one shard overlap in one transfer). Every spec gets its outcome, whatever
        happens; the batch's outcomes are published together (one ``transfer_results`` reports all of them:
        requests loaded together are scheduled together)."""
        groups: dict[tuple[str, str, str, int], list[LoadSpec]] = {}
        for spec in specs:
            groups.setdefault((spec.shard_id, spec.agent_name, spec.shard_epoch, spec.region_id), []).append(spec)
        outcomes: list[tuple[LoadSpec, list[tuple[LoadBlock, list[GroupSpans]]], set[int]]] = []
        for group in groups.values():
            done: dict[int, tuple[LoadSpec, list[tuple[LoadBlock, list[GroupSpans]]], set[int]]] = {}
            try:
                self._load_group(group, done, inline)
            except Exception as exc:  # noqa: BLE001 - a bug is a failed load (recomputed), never a hung request
                log.exception("kvpool connector: load from %s failed: %s", group[0].shard_id or "?", exc)
            for i, spec in enumerate(group):
                if i not in done:
                    items = self._items(spec)
                    done[i] = (spec, items, set(range(len(items))) or {-1})
            outcomes += [done[i] for i in range(len(group))]
        with self._results_lock:
            for spec, items, failed in outcomes:
                self._post(spec, items, failed)

    def _load_group(self, group: list[LoadSpec],
                    done: dict[int, tuple[LoadSpec, list[tuple[LoadBlock, list[GroupSpans]]], set[int]]],
                    inline: bool = False) -> None:
        """Loads of one shard (same agent, epoch and region): one read for all of their slots, then the checksums."""
        geo = self.geometry
        head = group[0]
        items = [self._items(spec) for spec in group]
        failed: list[set[int]] = [set() for _ in group]
        if geo is None or self.endpoint is None or not head.shard_id:
            failed = [set(range(len(it))) or {-1} for it in items]
        elif not self.shards.breaker.allow(head.shard_id):  # it failed recently: a miss at once, no deadline
            self.stats.loads_skipped += len(group)
            failed = [set(range(len(it))) or {-1} for it in items]
        moved, read_s = 0, 0.0
        if geo is not None and self.endpoint is not None and head.shard_id and not any(failed):
            moved, read_s = self._read(group, items, failed, geo, inline)
            for its, f in zip(items, failed, strict=True):
                self._verify(its, f, geo)
        ok_blocks = sum(len(its) for its, f in zip(items, failed, strict=True) if not f)
        if moved and ok_blocks:
            self._records.append(TransferRecord(head.shard_id, ok_blocks, moved, max(s.lease_s for s in group),
                                                read_s, sum(s.ssd_blocks for s in group),
                                                max(s.wait_s for s in group)))
        for k, spec in enumerate(group):
            done[k] = (spec, items[k], failed[k])

    def _read(self, group: list[LoadSpec], items: list[list[tuple[LoadBlock, list[GroupSpans]]]],
              failed: list[set[int]], geo: PoolGeometry, inline: bool = False) -> tuple[int, float]:
        """One transfer read of every leased slot of ``group`` (marks the slots that failed); (bytes, seconds).
        ``inline``: only through a shared-memory mapping already made (no call to the shard: see
        ``start_load_kv``)."""
        assert self.endpoint is not None
        head = group[0]
        ops: list[BlockOp] = []
        owner: list[tuple[int, int]] = []
        for k, its in enumerate(items):
            for idx, (blk, groups) in enumerate(its):
                if blk.remote is None:
                    failed[k].add(idx)
                    continue
                off = blk.remote.offset
                for region, loff, length in geo.pieces(groups, blk.block_ids):
                    ops.append(BlockOp(head.region_id, off, self._regions[region], loff, length))
                    owner.append((k, idx))
                    off += length
                if off - blk.remote.offset > blk.remote.length:
                    failed[k].add(idx)  # the shard's slot is smaller than our block: never data
        if not ops:
            return 0, 0.0
        if inline and (self.peers is None or not self.peers.shared(head.agent_name, head.shard_epoch)):
            self.stats.inline_unready += len(group)
            self._map_later(head)
            for k, its in enumerate(items):
                failed[k].update(range(len(its)))
            return 0, 0.0
        try:
            if not inline:
                self._ensure_peer(head.shard_id, head.agent_name, head.shard_epoch)
            assert self.peers is not None
            endpoint = self.peers.endpoint_for(head.agent_name)
            t0 = time.perf_counter()
            result = endpoint.read(head.agent_name, ops, self.cfg.transfer_deadline_s,
                                   grants=[spec.grant for spec in group if spec.grant])
            read_s = time.perf_counter() - t0
        except Exception as exc:  # peer metadata unavailable, shard dead: every block of these loads failed
            log.warning("kvpool connector: read from %s failed: %s", head.shard_id, exc)
            if self.peers is not None:
                self.peers.forget(head.agent_name)
            self.shards.forget(head.shard_id)
            for k, its in enumerate(items):
                failed[k].update(range(len(its)))
            return 0, 0.0
        if not result.settled:
            # The late read may still land in these KV blocks: end it (close the endpoint) before vLLM is told to
            # recompute into them.
            log.warning("kvpool connector: a read from %s may still land after its deadline: fencing the endpoint",
                        head.shard_id)
            self.peers.fence()
            self.stats.load_fences += 1
        if result.failed and not result.ok:  # it served nothing (a deadline, a dead peer): skip it for a while
            self.shards.breaker.failure(head.shard_id)
        else:
            self.shards.breaker.success(head.shard_id)
        self.stats.read_seconds += read_s
        self.stats.bytes_read += result.bytes_moved
        if endpoint.backend == "shm":
            self.stats.bytes_read_shm += result.bytes_moved
        for i in result.failed:
            k, idx = owner[i]
            failed[k].add(idx)
        return result.bytes_moved, read_s

    def _map_later(self, spec: LoadSpec) -> None:
        """Map the shard of an inline load that found it unmapped, on the loader's thread (once per epoch at a
        time): the next inline load from it reads at once."""
        key = (spec.agent_name, spec.shard_epoch)
        if key in self._mapping:
            return
        self._mapping.add(key)

        def ensure() -> None:
            try:
                self._ensure_peer(spec.shard_id, spec.agent_name, spec.shard_epoch)
            except Exception as exc:  # noqa: BLE001 - the next inline load asks again
                log.warning("kvpool connector: mapping shard %s failed: %s", spec.shard_id, exc)
            finally:
                self._mapping.discard(key)

        self._background().call(ensure)

    def _verify(self, items: list[tuple[LoadBlock, list[GroupSpans]]], failed: set[int], geo: PoolGeometry) -> None:
        """Checksum every slot that arrived (a mismatch is a failed slot: never data)."""
        for idx, (blk, groups) in enumerate(items):
            if idx in failed or blk.remote is None:
                continue
            if self._checksum(geo.pieces(groups, blk.block_ids), blk.remote.length) != blk.remote.checksum:
                self.stats.checksum_failures += 1
                failed.add(idx)

    def _post(self, spec: LoadSpec, items: list[tuple[LoadBlock, list[GroupSpans]]], failed: set[int]) -> None:
        """Publish one request's load outcome for ``transfer_results`` (the caller holds the results lock). An
        inline load's request did not wait: only its failed blocks are published (invalid block ids of this step)."""
        self.stats.loads += 1
        if spec.inline:
            self.stats.loads_inline += 1
            bad = [i for i in failed if 0 <= i < len(items)]
            self.stats.blocks_loaded += len(items) - len(bad)
            if bad:
                self.stats.load_failures += 1
                self.stats.blocks_failed += len(bad)
                log.warning("kvpool connector: inline load of %s from %s: %d of %d slot(s) failed; vLLM recomputes "
                            "them", spec.req_id, spec.shard_id or "?", len(bad), len(items))
                self._invalid_blocks.update(b for i in bad for b in items[i][0].block_ids.values())
            return
        if not failed:
            self.stats.blocks_loaded += len(items)
            self._finished_recving.add(spec.req_id)
            return
        self.stats.load_failures += 1
        self.stats.blocks_failed += len(failed)
        log.warning("kvpool connector: load of %s from %s: %d of %d slot(s) failed; vLLM recomputes them",
                    spec.req_id, spec.shard_id or "?", len(failed), len(items))
        if spec.all_or_nothing:
            self._failed_recving.add(spec.req_id)
            return
        self._finished_recving.add(spec.req_id)
        for idx in failed:
            if 0 <= idx < len(items):
                self._invalid_blocks.update(items[idx][0].block_ids.values())

    def _checksum(self, pieces: list[tuple[int, int, int]], slot_bytes: int) -> int:
        return slot_checksum(self._pieces(pieces), slot_bytes)

    def wait_for_save(self) -> None:
        """Stage this step's new blocks with the background saver (a copy each; the writes happen later on the
        saver's thread, ``kvpool.connector.saver``). Never waits on the pool."""
        meta = self._meta
        if meta is None or not meta.saves or self.geometry is None or self.saver is None:
            return
        local = self.shards.local_shard_id(wait=False)
        if local is None:
            return
        geo = self.geometry
        blocks: list[tuple[bytes, list[np.ndarray]]] = []
        for spec in meta.saves:
            for key, ids in zip(spec.keys, spec.blocks, strict=True):
                blocks.append((self._own_key(key), self._pieces(geo.pieces(geo.block_groups, ids))))
            if spec.state_key is not None and spec.state_block is not None:
                blocks.append((self._own_key(spec.state_key),
                               self._pieces(geo.pieces(geo.state_groups, spec.state_block))))
        if blocks:
            self.saver.stage(local, meta.fingerprint, blocks)

    def _own_key(self, planned: bytes) -> bytes:
        """The key this rank saves a planned block under (the planned key itself on rank 0)."""
        if self.tp_rank == 0:
            return planned
        own = bytes(rank_key(planned, self.tp_rank, self.tp_world))
        entry = self._planned_key.get(own)
        self._planned_key[own] = (planned, entry[1] + 1 if entry else 1)
        return own

    def _planned(self, keys: list[bytes]) -> list[bytes]:
        """Reported keys back under the keys the scheduler planned (the saver reports every staged key once)."""
        if self.tp_rank == 0:
            return keys
        out: list[bytes] = []
        for k in keys:
            entry = self._planned_key.get(k)
            if entry is None:  # never expected: report it under its own key (the scheduler ignores unknown keys)
                out.append(k)
                continue
            out.append(entry[0])
            if entry[1] > 1:
                self._planned_key[k] = (entry[0], entry[1] - 1)
            else:
                del self._planned_key[k]
        return out

    def _pieces(self, pieces: list[tuple[int, int, int]]) -> list[np.ndarray]:
        return [self._arrays[region][off : off + length] for region, off, length in pieces]

    def wait_saves(self, deadline_s: float) -> bool:
        """Wait until the staged saves are written and committed (or failed); False at the deadline."""
        return self.saver is None or self.saver.wait_idle(deadline_s)

    def stats_dict(self) -> dict[str, Any]:
        """The load counters and the save counters, one flat dict."""
        out: dict[str, Any] = dataclasses.asdict(self.stats)
        out.update(dataclasses.asdict(self.saver.stats if self.saver is not None else SaveStats()))
        return out

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving incl. failed, failed_recving) since the last call. The failed block ids of those loads
        are taken with them, for ``take_load_errors`` right after (vLLM asks for both in the same pass)."""
        with self._results_lock:
            done, failed = self._finished_recving, self._failed_recving
            self._finished_recving, self._failed_recving = set(), set()
            self._harvested_invalid |= self._invalid_blocks
            self._invalid_blocks = set()
        return done | failed, failed

    def save_report(self) -> SaveReport | None:
        """What became of the planned saves since the last call (for the scheduler role), None when nothing."""
        if self.saver is None:
            return None
        saved, failed = self.saver.take_outcomes()
        skipped = self.saver.take_skipped()
        if not (saved or failed or skipped):
            return None
        return SaveReport(self._planned(saved), self._planned(failed), self._planned(skipped))

    def take_transfer_records(self) -> list[TransferRecord]:
        """The finished loads since the last call (oldest first; at most ``TRANSFER_RECORDS`` are kept)."""
        out = list(self._records)
        self._records.clear()
        return out

    def take_load_errors(self) -> set[int]:
        """The failed block ids of the loads the last ``transfer_results`` reported."""
        errors, self._harvested_invalid = self._harvested_invalid, set()
        return errors

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close(self.cfg.transfer_deadline_s)
            self.loader = None
        if self.saver is not None:
            self.saver.close(self.cfg.save_deadline_s)
            self.saver = None
        if self.peers is not None:
            self.peers.close()  # the transfer endpoint and the shared-memory one
            self.peers = None
