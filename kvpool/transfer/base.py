"""Transfer contract: move byte ranges between registered memory regions of two processes.

One interface, two implementations run against one conformance suite (``tests/integration/test_transport_conformance.py``):
``kvpool.transfer.nixl.NixlEndpoint`` (NIXL over UCX) and ``kvpool.transfer.tcp.TcpEndpoint`` (plain TCP fallback).

Who calls what:
- A pool shard (``kvpool.shard.actor``) creates an endpoint, registers its DRAM arena, and publishes ``metadata()``
  through Ray (an actor method). It initiates transfers only when asked to ``pull`` blocks from a peer shard
  (``kvpool.shard.pull``: it then reads from the peer into its own arena, like any client).
- A client (the vLLM connector's worker side, a test actor, the transfer bench) creates its own endpoint,
  registers its destination/source memory, ``add_peer(shard_metadata)``, then ``read``/``write`` block ops.

Rules:
- Every call that waits takes a ``deadline_s`` (seconds from now). On expiry the ops not yet done are returned in
  ``TransferResult.failed``: a dead or frozen peer is failed blocks, never a hang and never an exception that
  kills a request (recoverable failure is data).
- Peers are identified by ``agent_name`` and an ``epoch`` (a fresh random id per process incarnation). ``add_peer``
  with the same name and a new epoch removes the old peer and adds the new one (a restarted peer is never trusted
  on stale metadata); an epoch equal to the current one is a no-op; ``remove_peer`` forgets it. A metadata message of
  another ``version`` or another backend is rejected with ``StaleMetadataError``.
- Messages crossing processes are versioned msgspec structs (this module).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import msgspec

TRANSFER_WIRE_VERSION = 1


class StaleMetadataError(ValueError):
    """Peer metadata of an unknown version / another backend / an older epoch than the one we hold."""


class RegionDesc(msgspec.Struct, frozen=True):
    """A registered memory region: its id (unique within one endpoint) and length in bytes."""

    region_id: int
    length: int


class AgentMetadata(msgspec.Struct, frozen=True, tag="agent_meta"):
    """Everything a peer needs to reach an endpoint's registered regions. Sent through Ray, then ``add_peer``."""

    version: int
    backend: str  # "nixl" | "tcp"
    agent_name: str
    epoch: str
    regions: list[RegionDesc]
    payload: bytes = b""  # backend specific: NIXL agent metadata + serialized descriptors, or "host:port" for TCP


class BlockOp(msgspec.Struct, frozen=True, array_like=True):
    """Copy ``length`` bytes between (remote_region, remote_offset) and (local_region, local_offset)."""

    remote_region: int
    remote_offset: int
    local_region: int
    local_offset: int
    length: int


class TransferResult(msgspec.Struct, frozen=True):
    """Indices (into the ops list) that completed / failed, bytes moved and wall seconds.

    ``settled``: no op of the call can still touch memory once it returned. False only when a backend could not
    confirm that a late transfer was cancelled (NIXL refused to release its request): its local (READ) or remote
    (WRITE) bytes may still change. The caller must fence before that memory is used again: close the endpoint
    (``kvpool.connector.pool.KnownPeers.fence``: destroying the agent ends every transfer it started)."""

    ok: list[int]
    failed: list[int]
    bytes_moved: int
    seconds: float
    error: str = ""
    settled: bool = True

    @property
    def all_ok(self) -> bool:
        return not self.failed


class TransferEndpoint(abc.ABC):
    """One process's side of the transfer layer."""

    backend: str

    @abc.abstractmethod
    def register(self, buffer: memoryview) -> int:
        """Register a writable, contiguous buffer (e.g. ``memoryview(numpy_array).cast('B')``); returns region id.

        The caller keeps the buffer alive until ``close()``.
        """

    @abc.abstractmethod
    def metadata(self) -> AgentMetadata:
        """This endpoint's current metadata (name, epoch, regions)."""

    @abc.abstractmethod
    def add_peer(self, meta: AgentMetadata) -> None:
        """Start trusting a peer (see the epoch rules in the module docstring)."""

    @abc.abstractmethod
    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer; later ops to it fail."""

    @abc.abstractmethod
    def read(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
             ) -> TransferResult:
        """Pull remote bytes into local regions. ``grants``: the leases' / reservations' grants that cover the
        remote spans (``kvpool.store``, "Grants"); a server that checks them (the shard's TCP server) refuses spans
        no grant covers. NIXL and shared memory carry none: UCX memory keys and a mapped segment cannot be checked
        per span (README, Security)."""

    @abc.abstractmethod
    def write(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
              ) -> TransferResult:
        """Push local bytes into remote regions; ``grants`` as for ``read`` (a reservation's)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister memory, drop peers, stop background threads. Idempotent."""


def encode_metadata(meta: AgentMetadata) -> bytes:
    return msgspec.msgpack.encode(meta)


def decode_metadata(raw: bytes) -> AgentMetadata:
    """Decode and check the wire version (``StaleMetadataError`` on mismatch)."""
    try:
        meta = msgspec.msgpack.decode(raw, type=AgentMetadata)
    except msgspec.DecodeError as exc:
        raise StaleMetadataError(f"undecodable agent metadata: {exc}") from exc
    if meta.version != TRANSFER_WIRE_VERSION:
        raise StaleMetadataError(f"agent metadata version {meta.version}, expected {TRANSFER_WIRE_VERSION}")
    return meta
