"""The connector's worker role: register the KV memory, pull leased blocks into it, push new blocks to the pool.

vLLM's model runner (one per worker process; in-process engines: the engine-core process) calls, through
``KvPoolConnector``:
- ``register_kv_caches(kv_caches)`` once after allocating the KV cache: derives the ``KvLayout`` from the tensors
  and the KV cache config (``kvpool.connector.layout``) and REFUSES to start (raises) on an unknown layout kind,
  a layout it cannot describe exactly, or a local shard whose slots are too small for one block. Then it registers
  every KV storage with a transfer endpoint (``kvpool.transfer``), so bytes move straight between the shard's
  arena and the KV cache blocks.
- ``get_handshake_metadata()`` right after: the layout, for the scheduler role.
- ``start_load_kv`` every step (after the forward for asynchronous loads): for each ``LoadSpec`` one transfer read
  from the owning shard straight into the cache blocks, then a checksum check per pool slot. A block that fails
  (peer dead, deadline, checksum, not leased) is a load error: ``get_block_ids_with_load_errors`` (dense) or the
  whole request in ``failed_recving`` (hybrids, where vLLM cannot take block-level errors); vLLM recomputes.
- ``wait_for_save`` every step after the forward: copies the blocks to save into the background saver's staging
  slots and returns (``kvpool.connector.saver``: its thread reserves on the local shard, writes, and commits with
  the checksums, which the shard verifies). A failed or dropped save is a future miss, never an error or a wait.
- ``get_transfer_results`` every step: the requests whose load finished this step (failed ones included).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvpool.checksum import slot_checksum
from kvpool.connector.config import ConnectorConfig
from kvpool.connector.layout import (
    GroupSpans,
    PoolGeometry,
    derive_layout,
    group_kinds,
    model_digest,
    pool_plan,
    tensor_info,
)
from kvpool.connector.meta import KvPoolHandshake, KvPoolMetadata, LoadBlock, LoadSpec, TransferRecord
from kvpool.connector.pool import KnownPeers, PoolShards
from kvpool.connector.saver import BlockSaver, SaveStats
from kvpool.connector.weights import weights_identity
from kvpool.layout import KvLayout, LayoutError
from kvpool.transfer.base import BlockOp, TransferEndpoint

log = logging.getLogger(__name__)

TRANSFER_RECORDS = 512  # finished loads kept for the replica's calibration reports (older ones are dropped)


@dataclass
class WorkerStats:
    """Load counters (the save counters are the saver's ``SaveStats``)."""

    loads: int = 0
    load_failures: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0
    checksum_failures: int = 0
    bytes_read: int = 0
    bytes_read_shm: int = 0  # of bytes_read: through shared memory (the own node's shard, kvpool.transfer.shm)
    read_seconds: float = 0.0


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


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
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
                                   quantization=str(getattr(mc, "quantization", None) or ""))
        self.layout: KvLayout | None = None
        self.geometry: PoolGeometry | None = None
        self.endpoint: TransferEndpoint | None = None
        self.agent_name = f"kvpool-engine-{uuid.uuid4().hex[:12]}"
        self.shards = PoolShards(cfg)
        self.stats = WorkerStats()
        self._arrays: list[np.ndarray] = []  # uint8 views of the KV storages (kept alive while registered)
        self._regions: list[int] = []  # endpoint region id per storage index
        self.saver: BlockSaver | None = None
        self.peers: KnownPeers | None = None  # the shards whose transfer metadata ``endpoint`` holds
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._records: deque[TransferRecord] = deque(maxlen=TRANSFER_RECORDS)
        self._meta: KvPoolMetadata | None = None

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
        self._check_local_slot(geometry.slot_bytes_needed)
        self.endpoint = make_client_endpoint(self.cfg, self.agent_name)
        self.peers = KnownPeers(self.endpoint, make_same_host_endpoint(self.cfg, self.agent_name))
        by_ptr = {info.storage_ptr: kv_caches[name] for name, info in infos.items()}
        for ptr, nbytes in storages:
            storage = by_ptr[ptr].untyped_storage()
            u8 = torch.empty(0, dtype=torch.uint8)
            u8.set_(storage, 0, (nbytes,), (1,))
            arr = u8.numpy()
            self._arrays.append(arr)
            self._regions.append(self.peers.register(memoryview(arr)))
        if self.cfg.save:
            saver_shards = PoolShards(self.cfg)  # its own clients: the saver's thread shares nothing with loads
            name = f"{self.agent_name}-saver"
            peers = KnownPeers(make_client_endpoint(self.cfg, name), make_same_host_endpoint(self.cfg, name))
            self.saver = BlockSaver(peers, saver_shards.client, saver_shards.forget,
                                    slot_bytes=geometry.slot_bytes_needed, staging_bytes=self.cfg.save_staging_bytes,
                                    deadline_s=self.cfg.save_deadline_s, model=self.model_id)

    def _check_local_slot(self, needed: int) -> None:
        """Refuse to start when the local shard's slots cannot hold one block (a misconfigured pool)."""
        local = self.shards.local_shard_id()
        if local is None:
            return
        try:
            info = self.shards.client(local).info()
        except Exception as exc:  # an unreachable shard is a runtime miss, not a startup error
            log.warning("kvpool connector: local shard %s unreachable at startup: %s", local, exc)
            return
        if info.slot_bytes < needed:
            raise LayoutError(
                f"kvpool shard {local} has {info.slot_bytes}-byte slots but one pool block of this model needs "
                f"{needed} bytes (layout {self.layout.fingerprint if self.layout else '?'}); refusing to start"
            )

    def handshake(self) -> KvPoolHandshake | None:
        if self.layout is None or self.geometry is None:
            return None
        return KvPoolHandshake(self.layout.encode(), self.geometry.slot_bytes_needed)

    # ------------------------------------------------------------------ per step
    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, KvPoolMetadata) else None

    def clear(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for spec in meta.loads:
            self._load(spec)
            self._finished_recving.add(spec.req_id)

    def _ensure_peer(self, shard_id: str, agent_name: str, epoch: str) -> None:
        """Trust the shard's current transfer metadata (refetched when the shard restarted); the own node's shard
        also through shared memory when it exports its arena."""
        assert self.peers is not None
        same_node = shard_id == self.shards.local_shard_id()
        self.peers.ensure(agent_name, epoch, lambda: self.shards.client(shard_id).transfer_metadata(),
                          (lambda: self.shards.client(shard_id).shm_metadata()) if same_node else None)

    def _load(self, spec: LoadSpec) -> None:
        geo = self.geometry
        self.stats.loads += 1
        items: list[tuple[LoadBlock, list[GroupSpans]]] = []
        if geo is not None:
            items = [(b, geo.block_groups) for b in spec.blocks]
            if spec.state is not None:
                items.append((spec.state, geo.state_groups))
        failed: set[int] = set()
        moved, read_s = 0, 0.0
        if geo is None or self.endpoint is None or not spec.shard_id:
            failed = set(range(len(items))) or {-1}
        else:
            failed, moved, read_s = self._read_and_verify(spec, items, geo)
        if not failed:
            self.stats.blocks_loaded += len(items)
            if moved:
                self._records.append(TransferRecord(spec.shard_id, len(items), moved, spec.lease_s, read_s,
                                                    spec.ssd_blocks))
            return
        self.stats.load_failures += 1
        self.stats.blocks_failed += len(failed)
        log.warning("kvpool connector: load of %s from %s: %d of %d slot(s) failed; vLLM recomputes them",
                    spec.req_id, spec.shard_id or "?", len(failed), len(items))
        if spec.all_or_nothing:
            self._failed_recving.add(spec.req_id)
            return
        for idx in failed:
            if 0 <= idx < len(items):
                self._invalid_blocks.update(items[idx][0].block_ids.values())

    def _read_and_verify(self, spec: LoadSpec, items: list[tuple[LoadBlock, list[GroupSpans]]],
                         geo: PoolGeometry) -> tuple[set[int], int, float]:
        """(indexes of the items that failed, bytes read, seconds the read took)."""
        assert self.endpoint is not None
        failed: set[int] = set()
        moved, read_s = 0, 0.0
        ops: list[BlockOp] = []
        owner: list[int] = []
        for idx, (blk, groups) in enumerate(items):
            if blk.remote is None:
                failed.add(idx)
                continue
            off = blk.remote.offset
            for region, loff, length in geo.pieces(groups, blk.block_ids):
                ops.append(BlockOp(spec.region_id, off, self._regions[region], loff, length))
                owner.append(idx)
                off += length
            if off - blk.remote.offset > blk.remote.length:
                failed.add(idx)  # the shard's slot is smaller than our block: never data
        if ops:
            try:
                self._ensure_peer(spec.shard_id, spec.agent_name, spec.shard_epoch)
                assert self.peers is not None
                endpoint = self.peers.endpoint_for(spec.agent_name)
                t0 = time.perf_counter()
                result = endpoint.read(spec.agent_name, ops, self.cfg.transfer_deadline_s)
                read_s = time.perf_counter() - t0
                moved = result.bytes_moved
                self.stats.read_seconds += read_s
                self.stats.bytes_read += moved
                if endpoint.backend == "shm":
                    self.stats.bytes_read_shm += moved
                failed.update(owner[i] for i in result.failed)
            except Exception as exc:  # peer metadata unavailable, shard dead: every block of this load failed
                log.warning("kvpool connector: read from %s failed: %s", spec.shard_id, exc)
                if self.peers is not None:
                    self.peers.forget(spec.agent_name)
                self.shards.forget(spec.shard_id)
                return set(range(len(items))), 0, 0.0
        for idx, (blk, groups) in enumerate(items):
            if idx in failed or blk.remote is None:
                continue
            if self._checksum(geo.pieces(groups, blk.block_ids), blk.remote.length) != blk.remote.checksum:
                self.stats.checksum_failures += 1
                failed.add(idx)
        return failed, moved, read_s

    def _checksum(self, pieces: list[tuple[int, int, int]], slot_bytes: int) -> int:
        return slot_checksum(self._pieces(pieces), slot_bytes)

    def wait_for_save(self) -> None:
        """Stage this step's new blocks with the background saver (a copy each; the writes happen later on the
        saver's thread, ``kvpool.connector.saver``). Never waits on the pool."""
        meta = self._meta
        if meta is None or not meta.saves or self.geometry is None or self.saver is None:
            return
        local = self.shards.local_shard_id()
        if local is None:
            return
        geo = self.geometry
        blocks: list[tuple[bytes, list[np.ndarray]]] = []
        for spec in meta.saves:
            for key, ids in zip(spec.keys, spec.blocks, strict=True):
                blocks.append((key, self._pieces(geo.pieces(geo.block_groups, ids))))
            if spec.state_key is not None and spec.state_block is not None:
                blocks.append((spec.state_key, self._pieces(geo.pieces(geo.state_groups, spec.state_block))))
        if blocks:
            self.saver.stage(local, meta.fingerprint, blocks)

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
        """(finished_recving incl. failed, failed_recving) since the last call."""
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return done | failed, failed

    def take_transfer_records(self) -> list[TransferRecord]:
        """The finished loads since the last call (oldest first; at most ``TRANSFER_RECORDS`` are kept)."""
        out = list(self._records)
        self._records.clear()
        return out

    def take_load_errors(self) -> set[int]:
        errors, self._invalid_blocks = self._invalid_blocks, set()
        return errors

    def shutdown(self) -> None:
        if self.saver is not None:
            self.saver.close(self.cfg.save_deadline_s)
            self.saver = None
        if self.peers is not None:
            self.peers.close()  # the transfer endpoint and the shared-memory one
            self.peers = None
        elif self.endpoint is not None:
            self.endpoint.close()
        self.endpoint = None
