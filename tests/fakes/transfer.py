"""``LoopbackEndpoint``: the ``kvpool.transfer.base.TransferEndpoint`` interface over memory of this one process.

Endpoints that share a ``LoopbackFabric`` reach each other's registered buffers by agent name; a fabric can mark an
agent dead (its ops fail, like a dead peer) or fail chosen op indices of every call (a partial failure, as TCP can
report). Used where the transfer is a neighbour of what is tested (the shard pull: tests/unit/test_shard_pull.py,
and ``tests.fakes.shard``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvpool.transfer.base import (
    TRANSFER_WIRE_VERSION,
    AgentMetadata,
    BlockOp,
    RegionDesc,
    TransferEndpoint,
    TransferResult,
)


class LoopbackFabric:
    """The shared memory of loopback endpoints: registered buffers by agent name, dead agents, failing op indices."""

    def __init__(self) -> None:
        self.buffers: dict[str, list[memoryview]] = {}
        self.dead: set[str] = set()
        self.fail_ops: set[int] = set()


class LoopbackEndpoint(TransferEndpoint):
    backend = "loopback"

    def __init__(self, fabric: LoopbackFabric, agent_name: str, epoch: str = "e1") -> None:
        self.fabric = fabric
        self.name = agent_name
        self.epoch = epoch
        self.peers: dict[str, AgentMetadata] = {}
        self.reads = 0
        fabric.buffers[agent_name] = []

    def register(self, buffer: memoryview) -> int:
        self.fabric.buffers[self.name].append(memoryview(buffer).cast("B"))
        return len(self.fabric.buffers[self.name]) - 1

    def metadata(self) -> AgentMetadata:
        regions = [RegionDesc(i, len(b)) for i, b in enumerate(self.fabric.buffers[self.name])]
        return AgentMetadata(TRANSFER_WIRE_VERSION, self.backend, self.name, self.epoch, regions)

    def add_peer(self, meta: AgentMetadata) -> None:
        self.peers[meta.agent_name] = meta

    def remove_peer(self, agent_name: str) -> None:
        self.peers.pop(agent_name, None)

    def _move(self, peer: str, ops: Sequence[BlockOp], read: bool) -> TransferResult:
        t0 = time.monotonic()
        if peer not in self.peers or peer in self.fabric.dead or peer not in self.fabric.buffers:
            return TransferResult([], list(range(len(ops))), 0, time.monotonic() - t0, f"peer {peer!r} is gone")
        mine, theirs = self.fabric.buffers[self.name], self.fabric.buffers[peer]
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
        ok = [i for i in range(len(ops)) if i not in self.fabric.fail_ops]
        return TransferResult(ok, failed, moved, time.monotonic() - t0, "injected" if failed else "")

    def read(self, peer: str, ops: Sequence[BlockOp], deadline_s: float) -> TransferResult:
        self.reads += 1
        return self._move(peer, ops, read=True)

    def write(self, peer: str, ops: Sequence[BlockOp], deadline_s: float) -> TransferResult:
        return self._move(peer, ops, read=False)

    def close(self) -> None:
        self.fabric.buffers.pop(self.name, None)
