"""Same-host transfers through shared memory: a peer's exported regions are mapped into this process and block ops
are plain memory copies (one copy, no socket, no NIXL, no kernel-mediated CMA: ``kvpool.transfer.block_copy``).

Who calls what: a pool shard (``kvpool.shard.actor``) allocates its DRAM arena in a memfd (``kvpool.arena``,
``shared=True``) and exports it here next to its NIXL/TCP endpoint (``register_shared``, same region id); a client
on the same host and node (the connector's worker: loads, and the saver's writes to its own node's shard) registers
its local memory (the KV cache) with ``register`` and reads / writes the shard's slots with the same ``BlockOp``s it
would give NIXL. Held to the transport conformance suite (``tests/integration/test_transport_conformance.py``).

Rules (on top of ``kvpool.transfer.base`` / ``common``: versioned metadata, epochs, admission, op validation):
- A peer is only admitted on the same host: the metadata carries the kernel's boot id and the exporting process's
  pid and start time; another host (or boot) is ``StaleMetadataError``. Each exported region is opened through
  ``/proc/<pid>/fd/<fd>`` of the exporter (same user only: the kernel's ptrace-read check, the one CMA needs too) and
  mapped shared; a region whose size differs from the metadata is refused.
- A peer that is gone (its pid no longer runs the process that exported: start time differs) fails every op, like a
  dead NIXL peer; a frozen peer does not matter (its memory is readable without it) — what a slot holds is the
  shard's business (leases pin it, checksums verify it).
- Every call takes a deadline, checked between ops (every 64): the ops not started when it expires fail.
- Nothing is ever mapped from another user, another host or a file path that is not the exporter's memfd.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

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
from kvpool.transfer.block_copy import copy_blocks
from kvpool.transfer.common import Admission, Deadline, OpTable, admit, all_failed, buffer_address, new_epoch
from kvpool.transfer.metrics import TransferMetrics, transfer_metrics

SHM_PAYLOAD_VERSION = 1


class ShmPayload(msgspec.Struct, frozen=True):
    """What a same-host peer needs to map the exported regions."""

    version: int
    boot_id: str  # /proc/sys/kernel/random/boot_id of the exporter's host
    pid: int
    start_ticks: int  # the exporter's start time (/proc/<pid>/stat field 22): a reused pid is another process
    fds: dict[int, int]  # exported region id -> the exporter's file descriptor of its memfd


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), or None when no such process runs (a zombie does
    not run: it is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass
class _Peer:
    meta: AgentMetadata
    payload: ShmPayload
    maps: dict[int, mmap.mmap] = field(default_factory=dict)
    arrays: dict[int, np.ndarray] = field(default_factory=dict)

    def close(self) -> None:
        self.arrays.clear()
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
        self.maps.clear()


class ShmEndpoint(TransferEndpoint):
    backend = "shm"

    def __init__(self, agent_name: str, *, metrics: TransferMetrics | None = None) -> None:
        self._name = agent_name
        self._epoch = new_epoch()
        self._metrics = metrics or transfer_metrics()
        self._lock = threading.Lock()
        self._regions: dict[int, np.ndarray] = {}  # region id -> uint8 view of local memory
        self._fds: dict[int, int] = {}  # exported region id -> memfd of this process
        self._peers: dict[str, _Peer] = {}
        self._boot_id = boot_id()
        self._start_ticks = process_start_ticks(os.getpid()) or 0
        self._closed = False

    # ---- TransferEndpoint -----------------------------------------------------------------------------------
    def register(self, buffer: memoryview) -> int:
        """Local memory ops copy into or out of (not exported)."""
        return self._add_region(buffer, None)

    def register_shared(self, buffer: memoryview, fd: int) -> int:
        """Local memory that is also exported: ``buffer`` is a shared mapping of the memfd ``fd`` (the caller keeps
        both open until ``close``)."""
        if os.fstat(fd).st_size < buffer.nbytes:
            raise ValueError(f"memfd {fd} is smaller than the {buffer.nbytes}-byte buffer it should back")
        return self._add_region(buffer, fd)

    def _add_region(self, buffer: memoryview, fd: int | None) -> int:
        view, _, _, _ = buffer_address(buffer)
        with self._lock:
            self._check_open()
            region_id = len(self._regions)
            self._regions[region_id] = view
            if fd is not None:
                self._fds[region_id] = fd
        return region_id

    def metadata(self) -> AgentMetadata:
        with self._lock:
            regions = [RegionDesc(rid, int(self._regions[rid].nbytes)) for rid in sorted(self._fds)]
            payload = ShmPayload(SHM_PAYLOAD_VERSION, self._boot_id, os.getpid(), self._start_ticks, dict(self._fds))
        return AgentMetadata(version=TRANSFER_WIRE_VERSION, backend=self.backend, agent_name=self._name,
                             epoch=self._epoch, regions=regions, payload=msgspec.msgpack.encode(payload))

    def add_peer(self, meta: AgentMetadata) -> None:
        with self._lock:
            self._check_open()
            current = self._peers.get(meta.agent_name)
            action = admit(meta, self.backend, current.meta if current else None)
            if action is Admission.KEEP:
                return
        peer = self._map_peer(meta)  # outside the lock: opens and maps files
        with self._lock:
            old = self._peers.get(meta.agent_name)
            self._peers[meta.agent_name] = peer
        if old is not None:
            old.close()

    def _map_peer(self, meta: AgentMetadata) -> _Peer:
        try:
            payload = msgspec.msgpack.decode(meta.payload, type=ShmPayload)
        except msgspec.DecodeError as exc:
            raise StaleMetadataError(f"peer {meta.agent_name!r}: unreadable shm payload: {exc}") from None
        if payload.version != SHM_PAYLOAD_VERSION:
            raise StaleMetadataError(f"peer {meta.agent_name!r}: shm payload version {payload.version}, expected "
                                     f"{SHM_PAYLOAD_VERSION}")
        if payload.boot_id != self._boot_id:
            raise StaleMetadataError(f"peer {meta.agent_name!r} is on another host: no shared memory path to it")
        if process_start_ticks(payload.pid) != payload.start_ticks:
            raise StaleMetadataError(f"peer {meta.agent_name!r}: its process {payload.pid} is gone")
        peer = _Peer(meta=meta, payload=payload)
        try:
            for region in meta.regions:
                fd_no = payload.fds.get(region.region_id)
                if fd_no is None:
                    raise StaleMetadataError(f"peer {meta.agent_name!r}: region {region.region_id} has no memfd")
                path = f"/proc/{payload.pid}/fd/{fd_no}"
                if not os.readlink(path).startswith("/memfd:"):
                    raise StaleMetadataError(f"peer {meta.agent_name!r}: {path} is not a memfd")
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    if os.fstat(fd).st_size != region.length:
                        raise StaleMetadataError(f"peer {meta.agent_name!r}: region {region.region_id} is "
                                                 f"{os.fstat(fd).st_size} bytes, metadata says {region.length}")
                    m = mmap.mmap(fd, region.length)
                finally:
                    os.close(fd)
                peer.maps[region.region_id] = m
                peer.arrays[region.region_id] = np.frombuffer(m, dtype=np.uint8)
        except OSError as exc:
            peer.close()
            raise StaleMetadataError(f"peer {meta.agent_name!r}: cannot map its memory: {exc}") from None
        except BaseException:
            peer.close()
            raise
        return peer

    def remove_peer(self, agent_name: str) -> None:
        with self._lock:
            peer = self._peers.pop(agent_name, None)
        if peer is not None:
            peer.close()

    def read(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
             ) -> TransferResult:
        return self._transfer("read", peer, ops, deadline_s)

    def write(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
              ) -> TransferResult:
        return self._transfer("write", peer, ops, deadline_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            self._regions.clear()
            self._fds.clear()
        for p in peers:
            p.close()

    # ---- internals ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"endpoint {self._name!r} is closed")

    def _transfer(self, direction: str, peer_name: str, ops: Sequence[BlockOp], deadline_s: float) -> TransferResult:
        deadline = Deadline(deadline_s)
        table = OpTable(ops)
        with self._lock:
            self._check_open()
            local = dict(self._regions)
            peer = self._peers.get(peer_name)
        table.check_local({rid: int(v.nbytes) for rid, v in local.items()})
        if peer is None:
            result = all_failed(len(table), deadline.elapsed(), f"unknown peer {peer_name!r}")
        else:
            table.check_remote({r.region_id: r.length for r in peer.meta.regions}, peer_name)
            if process_start_ticks(peer.payload.pid) != peer.payload.start_ticks:
                result = all_failed(len(table), deadline.elapsed(), f"peer {peer_name!r} is gone")
            elif deadline.expired() and len(table):
                result = all_failed(len(table), deadline.elapsed(), "deadline expired before the transfer started")
            else:
                # dict(): our own references to the mapped arrays, so a concurrent remove_peer cannot unmap them
                # under the copy (an mmap with exported buffers refuses to close).
                result = copy_blocks(direction, table, local, dict(peer.arrays), deadline)
        self._metrics.observe(self.backend, direction, result)
        return result

