"""Batched block I/O between files (the pool's SSD tier) and registered host memory.

Called by the transfer bench's file section (``bench/transfer_probes.py``), which measures the engines below for the SSD
tier (the shard's SSD tier itself is ``kvpool.ssd``). The caller owns the files: it opens them with ``open_block_file``
(O_DIRECT where the file system allows it) and passes file descriptors in ``FileOp``.

Engine choice (measured by ``kvstack bench transfer``, "file" section; this 2-core VM, virtio disk, cold cache,
blocks in random file order, 256 MiB per run):
  64 KiB blocks: NIXL POSIX (O_DIRECT, one batch of async I/O) ~1.1 GB/s; ``os.preadv`` O_DIRECT 0.46 (1 thread),
                 0.56 (4-8 threads); buffered ``preadv`` 0.32-0.39.
  1 MiB blocks:  NIXL POSIX 1.15; ``preadv`` O_DIRECT 1.25-1.45; buffered 0.46-0.56.
NIXL POSIX queues the whole batch to the kernel at once, which is what small random reads need; a Python loop of
``preadv`` is one I/O in flight per thread. So the default engine is ``nixl_posix``; ``preadv`` remains for
machines without NIXL and gives per-op failures (NIXL reports a failed batch as a whole).

Rules: every op is validated up front (``ValueError`` on unknown region / out-of-range / misaligned O_DIRECT);
I/O failures and deadlines are data (``TransferResult.failed``). With O_DIRECT, memory addresses, file offsets
and lengths must be multiples of ``DIRECT_ALIGN``; ``aligned_buffer`` returns a page-aligned arena.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from kvpool.transfer.base import TransferResult
from kvpool.transfer.common import Deadline, all_failed, buffer_address
from kvpool.transfer.metrics import TransferMetrics, transfer_metrics

DIRECT_ALIGN = 4096


class FileOp(msgspec.Struct, frozen=True, array_like=True):
    """Move ``length`` bytes between (fd, file_offset) and (region, offset) of registered memory."""

    fd: int
    file_offset: int
    region: int
    offset: int
    length: int


class FileIOOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: Literal["nixl_posix", "preadv"] = "nixl_posix"
    poll_max_sleep_s: float = 0.0005

    def __post_init__(self) -> None:
        if not 0 < self.poll_max_sleep_s <= 0.1:
            raise ValueError("poll_max_sleep_s must be in (0, 0.1]")


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned (mmap-backed) uint8 array: usable as an O_DIRECT source/destination."""
    if nbytes <= 0:
        raise ValueError("nbytes must be > 0")
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def open_block_file(path: str, *, create: bool = False, direct: bool = True) -> tuple[int, bool]:
    """Open ``path`` read-write; returns (fd, is_direct). Falls back to buffered I/O where O_DIRECT is refused."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError:
            pass  # e.g. tmpfs: no O_DIRECT
    return os.open(path, flags, 0o644), False


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


class BlockFileIO:
    """Reads and writes batches of ``FileOp``; one instance per process side (the shard's SSD tier)."""

    def __init__(self, options: FileIOOptions | None = None, metrics: TransferMetrics | None = None) -> None:
        self._options = options or FileIOOptions()
        self._metrics = metrics or transfer_metrics()
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[np.ndarray, memoryview, int]] = {}  # id -> (array, bytes view, address)
        self._agent: Any = None
        self._errors: tuple[type[BaseException], ...] = ()
        self._file_regs: dict[int, Any] = {}
        self._dram_regs: list[Any] = []
        self._closed = False
        if self._options.engine == "nixl_posix":
            from kvpool.transfer.nixl import load_nixl, make_agent, nixl_errors

            api = load_nixl()
            self._errors = nixl_errors(api)
            self._agent = make_agent(
                api, f"file-io-{os.getpid()}-{id(self):x}", progress_thread=False, progress_delay_us=0
            )
            self._agent.create_backend("POSIX", {})

    @property
    def engine(self) -> str:
        return self._options.engine

    def register(self, buffer: memoryview) -> int:
        view, flat, addr, length = buffer_address(buffer)
        with self._lock:
            if self._closed:
                raise RuntimeError("BlockFileIO is closed")
            if self._agent is not None:
                self._dram_regs.append(self._agent.register_memory([(addr, length, 0, "")], "DRAM"))
            region_id = len(self._regions)
            self._regions[region_id] = (view, flat, addr)
        return region_id

    def read(self, ops: Sequence[FileOp], deadline_s: float) -> TransferResult:
        return self._io("read", ops, deadline_s)

    def write(self, ops: Sequence[FileOp], deadline_s: float) -> TransferResult:
        return self._io("write", ops, deadline_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._agent is not None:
                for reg in [*self._file_regs.values(), *self._dram_regs]:
                    try:
                        self._agent.deregister_memory(reg)
                    except self._errors:
                        pass
                self._agent = None
            self._file_regs.clear()
            self._dram_regs.clear()
            self._regions.clear()

    # ---- internals ------------------------------------------------------------------------------------------
    def _validate(self, ops: Sequence[FileOp]) -> np.ndarray:
        arr = np.array([(o.fd, o.file_offset, o.region, o.offset, o.length) for o in ops], dtype=np.int64).reshape(
            -1, 5
        )
        direct_fds = {fd: _is_direct(fd) for fd in {int(x) for x in arr[:, 0]}}
        for i, (fd, file_offset, region, offset, length) in enumerate(arr.tolist()):
            entry = self._regions.get(region)
            if entry is None:
                raise ValueError(f"op {i}: unknown region {region}")
            size = entry[0].nbytes
            if length <= 0 or offset < 0 or offset + length > size:
                raise ValueError(f"op {i}: range [{offset}, {offset + length}) outside region {region} of {size} bytes")
            if file_offset < 0:
                raise ValueError(f"op {i}: negative file offset {file_offset}")
            if direct_fds[fd] and ((entry[2] + offset) | file_offset | length) % DIRECT_ALIGN:
                raise ValueError(
                    f"op {i}: fd {fd} is O_DIRECT: memory address, file offset and length must be multiples of "
                    f"{DIRECT_ALIGN}"
                )
        return arr

    def _io(self, direction: str, ops: Sequence[FileOp], deadline_s: float) -> TransferResult:
        deadline = Deadline(deadline_s)
        with self._lock:
            if self._closed:
                raise RuntimeError("BlockFileIO is closed")
            arr = self._validate(ops)
        if not len(arr):
            result = TransferResult(ok=[], failed=[], bytes_moved=0, seconds=0.0)
        elif deadline.expired():
            result = all_failed(len(arr), deadline.elapsed(), "deadline expired before the I/O started")
        elif self._agent is not None:
            result = self._nixl(direction, arr, deadline)
        else:
            result = self._preadv(direction, arr, deadline)
        self._metrics.observe(self.engine, direction, result)
        return result

    def _preadv(self, direction: str, arr: np.ndarray, deadline: Deadline) -> TransferResult:
        ok: list[int] = []
        failed: list[int] = []
        moved = 0
        error = ""
        for i, (fd, file_offset, region, offset, length) in enumerate(arr.tolist()):
            if deadline.expired():
                failed.extend(range(i, len(arr)))
                error = error or "deadline expired"
                break
            view = self._regions[region][1][offset : offset + length]
            try:
                if direction == "read":
                    n = os.preadv(fd, [view], file_offset)
                else:
                    n = os.pwritev(fd, [view], file_offset)
            except OSError as exc:
                n, error = -1, error or f"op {i}: {exc}"
            if n == length:
                ok.append(i)
                moved += length
            else:
                failed.append(i)
                error = error or f"op {i}: short {direction} ({n} of {length} bytes)"
        return TransferResult(ok=ok, failed=failed, bytes_moved=moved, seconds=deadline.elapsed(), error=error)

    def _nixl(self, direction: str, arr: np.ndarray, deadline: Deadline) -> TransferResult:
        agent = self._agent
        n = len(arr)
        addrs = np.array([self._regions[int(r)][2] for r in arr[:, 2]], dtype=np.uint64)
        mem = np.zeros((n, 3), dtype=np.uint64)
        mem[:, 0] = addrs + arr[:, 3].astype(np.uint64)
        mem[:, 1] = arr[:, 4].astype(np.uint64)
        files = np.zeros((n, 3), dtype=np.uint64)
        files[:, 0] = arr[:, 1].astype(np.uint64)
        files[:, 1] = arr[:, 4].astype(np.uint64)
        files[:, 2] = arr[:, 0].astype(np.uint64)
        try:
            with self._lock:
                for fd in {int(x) for x in arr[:, 0]} - self._file_regs.keys():
                    self._file_regs[fd] = agent.register_memory([(0, 0, fd, "")], "FILE")
                handle = agent.initialize_xfer(
                    "READ" if direction == "read" else "WRITE",
                    agent.get_xfer_descs(mem, "DRAM"),
                    agent.get_xfer_descs(files, "FILE"),
                    agent.name,
                )
                state = agent.transfer(handle)
        except self._errors as exc:
            return all_failed(n, deadline.elapsed(), f"NIXL POSIX {type(exc).__name__}: {exc}")
        sleep = 0.0
        try:
            while state == "PROC":
                if deadline.expired():
                    _release(handle, self._errors)
                    return all_failed(n, deadline.elapsed(), "deadline expired")
                if sleep:
                    time.sleep(min(sleep, max(deadline.remaining(), 0.0)))
                sleep = min(self._options.poll_max_sleep_s, sleep * 2 if sleep else 0.00002)
                with self._lock:
                    state = agent.check_xfer_state(handle)
        except self._errors as exc:
            _release(handle, self._errors)
            return all_failed(n, deadline.elapsed(), f"NIXL POSIX {type(exc).__name__}: {exc} (short or failed I/O)")
        _release(handle, self._errors)
        if state != "DONE":
            return all_failed(n, deadline.elapsed(), "NIXL POSIX transfer error (short or failed I/O)")
        return TransferResult(
            ok=list(range(n)), failed=[], bytes_moved=int(arr[:, 4].sum()), seconds=deadline.elapsed()
        )


def _release(handle: Any, errors: tuple[type[BaseException], ...]) -> None:
    try:
        handle.release()
    except errors:
        pass
