"""``LoopbackEndpoint``: the ``kvpool.transfer.base.TransferEndpoint`` interface over memory of this one process.

Endpoints that share a ``LoopbackFabric`` reach each other's registered buffers by agent name; a fabric can mark an
agent dead (its ops fail, like a dead peer), frozen (its ops wait out their deadline, then fail), unsettled (its
ops move the bytes, then report every op failed with ``settled=False``: a late transfer whose cancel was refused,
as NIXL can report) or fail chosen op indices of every call (a partial failure, as TCP can report); an agent
with a grant check refuses every call whose grants do not cover its spans in that agent's memory, as the shard's
TCP server does (``kvpool.transfer.tcp``, "Grants"). Used where the transfer is a neighbour of what is
tested (the shard pull: tests/unit/test_shard_pull.py, and ``tests.fakes.shard``); it follows the rules the real
backends share, checked by running it through the transport conformance suite
(tests/integration/test_transport_conformance.py) with the real backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvpool.transfer.base import (
    TRANSFER_WIRE_VERSION,
    AgentMetadata,
    BlockOp,
    RegionDesc,
    StaleMetadataError,
    TransferEndpoint,
    TransferResult,
)
from kvpool.transfer.common import Deadline, OpTable, admit, all_failed, new_epoch
from kvpool.transfer.metrics import TransferMetrics


class LoopbackFabric:
    """The shared memory of loopback endpoints: registered buffers by agent name, dead agents, failing op indices."""

    def __init__(self) -> None:
        self.buffers: dict[str, list[memoryview]] = {}
        self.dead: set[str] = set()
        self.frozen: set[str] = set()  # ops to a frozen agent wait out their deadline, then fail
        self.fail_ops: set[int] = set()
        self.unsettled: set[str] = set()  # ops to these agents land, then are reported failed and unsettled
        # agent -> (write?, the call's grants, its (offset, length) spans in the agent's memory) -> serve it?
        self.grant_checks: dict[str, Callable[[bool, Sequence[bytes], list[tuple[int, int]]], bool]] = {}


class LoopbackEndpoint(TransferEndpoint):
    """Runs through the transport conformance suite like the real backends: peers admitted by the shared rule
    (``kvpool.transfer.common.admit``: version, backend, epoch order), ops validated up front (``OpTable``), every
    call bounded by its deadline, failures as data, ``TransferMetrics`` observed per call."""

    backend = "loopback"

    def __init__(self, fabric: LoopbackFabric, agent_name: str, epoch: str | None = None,
                 metrics: TransferMetrics | None = None) -> None:
        self.fabric = fabric
        self.name = agent_name
        self.epoch = epoch if epoch is not None else new_epoch()
        self.peers: dict[str, AgentMetadata] = {}
        self.reads = 0
        self.metrics = metrics
        fabric.buffers[agent_name] = []

    def register(self, buffer: memoryview) -> int:
        self.fabric.buffers[self.name].append(memoryview(buffer).cast("B"))
        return len(self.fabric.buffers[self.name]) - 1

    def metadata(self) -> AgentMetadata:
        regions = [RegionDesc(i, len(b)) for i, b in enumerate(self.fabric.buffers[self.name])]
        return AgentMetadata(TRANSFER_WIRE_VERSION, self.backend, self.name, self.epoch, regions)

    def add_peer(self, meta: AgentMetadata) -> None:
        admit(meta, self.backend, self.peers.get(meta.agent_name))
        if meta.payload:
            raise StaleMetadataError(f"peer {meta.agent_name!r}: loopback metadata carries no payload")
        self.peers[meta.agent_name] = meta

    def remove_peer(self, agent_name: str) -> None:
        self.peers.pop(agent_name, None)

    def _move(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, read: bool, grants: Sequence[bytes] = ()
              ) -> TransferResult:
        deadline = Deadline(deadline_s)
        table = OpTable(ops)
        mine = self.fabric.buffers.get(self.name, [])
        table.check_local({i: len(b) for i, b in enumerate(mine)})
        meta = self.peers.get(peer)
        if meta is not None:
            table.check_remote({r.region_id: r.length for r in meta.regions}, peer)
        check = self.fabric.grant_checks.get(peer)
        if check is not None and not check(not read, grants, [(op.remote_offset, op.length) for op in ops]):
            result = all_failed(len(ops), deadline.elapsed(), f"peer {peer!r}: not granted")
        else:
            result = self._transfer(peer, meta, ops, deadline, read)
        if self.metrics is not None:
            self.metrics.observe(self.backend, "read" if read else "write", result)
        return result

    def _transfer(self, peer: str, meta: AgentMetadata | None, ops: Sequence[BlockOp], deadline: Deadline,
                  read: bool) -> TransferResult:
        theirs = self.fabric.buffers.get(peer)
        if meta is None or peer in self.fabric.dead or theirs is None:
            return all_failed(len(ops), deadline.elapsed(), f"peer {peer!r} is gone")
        if peer in self.fabric.frozen:
            time.sleep(max(0.0, deadline.remaining()))
            return all_failed(len(ops), deadline.elapsed(), f"peer {peer!r} did not answer before the deadline")
        if deadline.expired():
            return all_failed(len(ops), deadline.elapsed(), "deadline expired before the transfer started")
        mine = self.fabric.buffers[self.name]
        moved = 0
        failed = sorted(i for i in self.fabric.fail_ops if i < len(ops))
        for i, op in enumerate(ops):
            if i in self.fabric.fail_ops:
                continue
            src = theirs[op.remote_region] if read else mine[op.local_region]
            dst = mine[op.local_region] if read else theirs[op.remote_region]
            s_off, d_off = (op.remote_offset, op.local_offset) if read else (op.local_offset, op.remote_offset)
            dst[d_off : d_off + op.length] = src[s_off : s_off + op.length]
            moved += op.length
        if peer in self.fabric.unsettled:
            return all_failed(len(ops), deadline.elapsed(), "injected: the cancel was refused", settled=False)
        ok = [i for i in range(len(ops)) if i not in self.fabric.fail_ops]
        return TransferResult(ok, failed, moved, deadline.elapsed(), "injected" if failed else "")

    def read(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
             ) -> TransferResult:
        self.reads += 1
        return self._move(peer, ops, deadline_s, read=True, grants=grants)

    def write(self, peer: str, ops: Sequence[BlockOp], deadline_s: float, grants: Sequence[bytes] = ()
              ) -> TransferResult:
        return self._move(peer, ops, deadline_s, read=False, grants=grants)

    def close(self) -> None:
        self.fabric.buffers.pop(self.name, None)
