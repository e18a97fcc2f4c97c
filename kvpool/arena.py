"""The DRAM tier's memory: one preallocated, page-aligned byte arena cut into fixed-size slots, and a slot allocator.

Who calls what: the block store (``kvpool.store``) allocates and frees slots and reads/writes slot views; the
shard actor registers ``buffer`` with its transfer endpoint once, so remote peers read and write slots in place
(offset = ``slot * slot_bytes``); a shared arena (a memfd) is also mapped by same-host clients
(``kvpool.transfer.shm``). The arena never moves or grows, so registered offsets stay valid for the
process's lifetime. Not thread-safe: the store calls the allocator under its own lock; a slot's bytes are copied
outside it only by the one operation that holds the slot (``kvpool.tiering``).
"""

from __future__ import annotations

import mmap
import os

import numpy as np


class DramArena:
    def __init__(self, slot_bytes: int, n_slots: int, *, shared: bool = False) -> None:
        """``shared``: back the arena with a memfd (``fd``) that same-host processes can map
        (``kvpool.transfer.shm``); else an anonymous private mapping."""
        if slot_bytes <= 0 or n_slots <= 0:
            raise ValueError(f"arena needs positive slot_bytes and n_slots, got {slot_bytes} x {n_slots}")
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.fd: int | None = None
        if shared:
            # A memfd: gone with the last process that holds it (nothing to leak in /dev/shm when a shard is
            # killed), page-aligned and zero-filled like the anonymous mapping.
            self.fd = os.memfd_create("kvstack-dram-arena", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, slot_bytes * n_slots)
            self._mmap = mmap.mmap(self.fd, slot_bytes * n_slots)
        else:
            # Anonymous mmap: page-aligned (RDMA registration, O_DIRECT) and zero-filled by the kernel.
            self._mmap = mmap.mmap(-1, slot_bytes * n_slots)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.buffer = memoryview(self._mmap)
        self._free: list[int] = list(range(n_slots - 1, -1, -1))  # stack: pops lowest slot first

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when the arena is short)."""
        take = min(max(n, 0), len(self._free))
        return [self._free.pop() for _ in range(take)]

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if not 0 <= s < self.n_slots:
                raise ValueError(f"slot {s} out of range [0, {self.n_slots})")
            self._free.append(s)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.buffer[start : start + self.slot_bytes]

    def close(self) -> None:
        """Unmap now if nothing else holds a view; otherwise the mapping goes when the last view (e.g. one a transfer
        endpoint registered) is dropped."""
        self._free.clear()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass
        if self.fd is not None:
            os.close(self.fd)  # the mapping (and any peer's) keeps the memory until it goes
            self.fd = None
