"""Messages between the connector's two roles (typed, versioned msgspec structs).

Who sends what:
- Worker → scheduler, once at startup: ``KvPoolHandshake`` through vLLM's handshake channel
  (``get_handshake_metadata`` → ``set_xfer_handshake_metadata``): the ``KvLayout`` the worker derived from the
  tensors it registered. The scheduler takes its fingerprint for block keys and pool calls.
- Scheduler → worker, every step: ``KvPoolMetadata`` (``build_connector_meta`` → ``bind_connector_metadata``):
  the loads to run (blocks leased on a shard, and where each goes in the KV cache) and the saves to run after the
  forward (which engine blocks, under which keys).
- Scheduler → replica, once per finished request: ``kvpool.connector.timing.PoolRequestTiming`` (no vLLM import
  there: the router reads it too).
- Worker → scheduler, after a step whose saves finished (``build_connector_worker_meta`` → vLLM aggregates the
  workers' → ``update_connector_output``): ``SaveReport``, the keys the shard committed (or already held) and the
  keys whose save failed (``kvpool.connector.save_book``).
- Worker → replica, on request: ``TransferRecord``s (``kvpool.connector.kv_connector.drain_transfer_records``
  through the engine's ``collective_rpc``): one per finished load — bytes, lease and read seconds, how many blocks the
  shard had to promote from SSD — which the replica publishes for the routers' tier calibration.
vLLM pickles these between processes; they hold only plain values.
"""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

META_VERSION = 2  # 2: LoadSpec.states and .world (tensor-parallel ranks)


class RemoteBlock(msgspec.Struct, frozen=True, array_like=True):
    """One leased pool slot: byte offset in the shard's region, slot length, checksum over the whole slot."""

    offset: int
    length: int
    checksum: int


class LoadBlock(msgspec.Struct, frozen=True, array_like=True):
    """Pull ``remote`` into these engine blocks (group id → block id, in the geometry's group order).

    ``remote`` None: the block was not leased (evicted since the lookup): a load error from the start.
    """

    block_ids: dict[int, int]
    remote: RemoteBlock | None


class LoadSpec(msgspec.Struct, frozen=True):
    """Everything one request's load needs. ``blocks`` are per-block slots (full attention); ``states`` the
    boundary state slot of a hybrid (empty for dense models). Both hold one slot per tensor-parallel rank of the
    engine (``world``), block-major: rank r of a ``world``-rank engine loads ``blocks[r::world]`` and
    ``states[r::world]`` (``kvpool.keys.rank_interleaved``). ``all_or_nothing``: any failure fails the whole request
    (hybrids: vLLM cannot take block-level errors with several groups; a prefix is reusable only with its state
    anyway)."""

    req_id: str
    shard_id: str
    agent_name: str
    shard_epoch: str
    region_id: int
    blocks: list[LoadBlock]
    states: list[LoadBlock]
    all_or_nothing: bool
    lease_s: float = 0.0  # how long the scheduler's lease call took (SSD promotion happens inside it)
    # What the request waited on the pool before this load, from vLLM's first ask about it (>= lease_s): the rest
    # of its lookup, the steps it was skipped ("not yet"), its allocation and the lease.
    wait_s: float = 0.0
    ssd_blocks: int = 0  # leased blocks the shard found on SSD (promoted to DRAM for the lease)
    grant: bytes = b""  # the lease's grant, presented with the read (``kvpool.store``, "Grants")
    world: int = 1  # the engine's tensor-parallel ranks the slots are laid out for
    # vLLM was told this load is synchronous: the worker reads it before this step's forward, and reports a failed
    # block as an invalid block id of this step (never in finished_recving)
    inline: bool = False
    version: int = META_VERSION


class TransferRecord(msgspec.Struct, frozen=True, array_like=True):
    """One finished load (all of its slots read and verified): what it cost the request, end to end from vLLM's
    first ask about its external tokens (the lookup's wait, the lease) to the end of the read."""

    shard_id: str
    blocks: int  # slots read (attention blocks plus a hybrid's state slot)
    bytes_moved: int
    lease_s: float
    read_s: float
    ssd_blocks: int
    wait_s: float = 0.0  # ``LoadSpec.wait_s`` (0: only the lease is known)
    version: int = META_VERSION

    @property
    def seconds(self) -> float:
        return max(self.wait_s, self.lease_s) + self.read_s


class SaveSpec(msgspec.Struct, frozen=True):
    """Write these engine blocks to the local shard after this step's forward; commit under ``keys``.

    ``blocks[i]`` holds the engine block ids of pool block ``keys[i]``; ``state_key``/``state_block`` a state
    snapshot (hybrids) taken at a chunk end on a block boundary."""

    req_id: str
    keys: list[bytes]
    blocks: list[dict[int, int]]
    state_key: bytes | None = None
    state_block: dict[int, int] | None = None
    version: int = META_VERSION


class KvPoolMetadata(KVConnectorMetadata):
    """Per-step scheduler → worker message."""

    def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec], fingerprint: str) -> None:
        self.loads = loads
        self.saves = saves
        self.fingerprint = fingerprint

    def __repr__(self) -> str:
        return f"KvPoolMetadata(loads={len(self.loads)}, saves={len(self.saves)})"


class KvPoolHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler at startup: the encoded ``KvLayout`` (``kvpool.layout.KvLayout.encode``), and the own
    node's shard when the worker reads it through shared memory (where the scheduler may plan inline loads)."""

    def __init__(self, layout: bytes, slot_bytes_needed: int, shm_shard: str = "") -> None:
        self.layout = layout
        self.slot_bytes_needed = slot_bytes_needed
        self.shm_shard = shm_shard  # the shard this worker mapped through shared memory at startup ("": none)
        self.version = META_VERSION


class SaveReport(KVConnectorWorkerMetadata):
    """Worker → scheduler: what became of planned saves since the last report. Aggregated over the workers of one
    engine (tensor-parallel ranks save their own heads): a key is saved only when no rank failed it."""

    def __init__(self, saved: list[bytes], failed: list[bytes], skipped: list[bytes] | None = None) -> None:
        self.saved = saved
        self.failed = failed
        self.skipped = skipped or []  # never attempted: the shard was unreachable (its breaker open, no actor)
        self.version = META_VERSION

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, SaveReport):
            return self
        failed = set(self.failed) | set(other.failed)
        skipped = (set(self.skipped) | set(getattr(other, "skipped", []))) - failed
        saved = [k for k in dict.fromkeys(self.saved + other.saved) if k not in failed and k not in skipped]
        return SaveReport(saved, sorted(failed), sorted(skipped))

    def __repr__(self) -> str:
        return f"SaveReport(saved={len(self.saved)}, failed={len(self.failed)}, skipped={len(self.skipped)})"
