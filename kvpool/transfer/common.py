"""Mechanism shared by every transfer backend: epochs, the peer-admission rule, op validation, deadlines.

Called by ``kvpool.transfer.nixl`` and ``kvpool.transfer.tcp`` (and the tests' in-process loopback,
``tests.fakes.transfer``, which the conformance suite holds to the same rules); callers of the transfer layer use
``kvpool.transfer.base``. Keeping these rules in one place is what makes the two backends behave the same under
the one conformance suite.

- Epoch: ``"<16 hex digits of wall-clock ns>-<8 random hex digits>"``, fresh per endpoint instance. The time
  prefix makes epochs of one name orderable, so metadata of an *older* incarnation that arrives late (a cached actor
  reply, a slow Ray call) is rejected instead of replacing the newer peer. Epochs that do not parse are only
  compared for equality.
- Admission (``admit``): version / backend mismatch or an older epoch -> ``StaleMetadataError``; same epoch and
  same regions -> ``KEEP`` (no-op); same epoch with changed regions (the peer registered more memory) ->
  ``REFRESH``; new name -> ``ADD``; newer epoch -> ``REPLACE`` (drop the old peer first, then add).
- Ops are validated up front (``OpTable``): a local or remote region that does not exist or a byte range outside
  it raises ``ValueError`` naming the op. That is a caller bug, not a transfer failure. Transfer failures (dead,
  frozen or unknown peer, deadline) are data: ``TransferResult.failed``.
"""

from __future__ import annotations

import enum
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvpool.transfer.base import TRANSFER_WIRE_VERSION, AgentMetadata, BlockOp, StaleMetadataError, TransferResult

Clock = Callable[[], float]


def new_epoch(clock_ns: Callable[[], int] = time.time_ns) -> str:
    """A fresh, time-ordered epoch id for one endpoint incarnation."""
    return f"{clock_ns():016x}-{secrets.token_hex(4)}"


def epoch_time(epoch: str) -> int | None:
    """The wall-clock ns prefix of an epoch made by ``new_epoch``; None when it has another shape."""
    head, sep, tail = epoch.partition("-")
    if not sep or len(head) != 16 or not tail:
        return None
    try:
        return int(head, 16)
    except ValueError:
        return None


class Admission(enum.Enum):
    ADD = "add"
    KEEP = "keep"
    REFRESH = "refresh"
    REPLACE = "replace"


def admit(meta: AgentMetadata, backend: str, current: AgentMetadata | None) -> Admission:
    """Decide what ``add_peer(meta)`` does given the metadata currently held for that name (see module doc)."""
    if meta.version != TRANSFER_WIRE_VERSION:
        raise StaleMetadataError(
            f"peer {meta.agent_name!r}: metadata version {meta.version}, expected {TRANSFER_WIRE_VERSION}"
        )
    if meta.backend != backend:
        raise StaleMetadataError(
            f"peer {meta.agent_name!r}: metadata of backend {meta.backend!r}, this endpoint is {backend!r}"
        )
    if current is None:
        return Admission.ADD
    if meta.epoch == current.epoch:
        return (
            Admission.KEEP if meta.regions == current.regions and meta.payload == current.payload else Admission.REFRESH
        )
    new_t, cur_t = epoch_time(meta.epoch), epoch_time(current.epoch)
    if new_t is not None and cur_t is not None and new_t < cur_t:
        raise StaleMetadataError(
            f"peer {meta.agent_name!r}: epoch {meta.epoch} is older than the held epoch {current.epoch}"
        )
    return Admission.REPLACE


class Deadline:
    """A point in time on a monotonic clock; every wait in the transfer layer is bounded by one."""

    __slots__ = ("_at", "_clock", "_start")

    def __init__(self, seconds: float, clock: Clock = time.monotonic) -> None:
        if math.isnan(seconds):
            raise ValueError("deadline_s is NaN")
        self._clock = clock
        self._start = clock()
        self._at = self._start + seconds

    def remaining(self) -> float:
        return self._at - self._clock()

    def expired(self) -> bool:
        return self._clock() >= self._at

    def elapsed(self) -> float:
        return self._clock() - self._start


# Columns of OpTable.arr
REMOTE_REGION, REMOTE_OFFSET, LOCAL_REGION, LOCAL_OFFSET, LENGTH = range(5)


class OpTable:
    """The ops of one call as rows and an (N, 5) int64 array (columns as in ``BlockOp``), validated up front.

    Small batches are checked row by row in Python (numpy's per-call overhead dominates there); large ones with a
    vectorized mask, and only the first offending row is explained.
    """

    __slots__ = ("_arr", "rows")

    SMALL = 32

    def __init__(self, ops: Sequence[BlockOp]) -> None:
        self.rows = [(o.remote_region, o.remote_offset, o.local_region, o.local_offset, o.length) for o in ops]
        self._arr: np.ndarray | None = None

    @property
    def arr(self) -> np.ndarray:
        if self._arr is None:
            self._arr = np.array(self.rows, dtype=np.int64).reshape(-1, 5)
        return self._arr

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(row[LENGTH] for row in self.rows)

    def check_local(self, regions: Mapping[int, int]) -> None:
        self._check(LOCAL_REGION, LOCAL_OFFSET, regions, "local", "")

    def check_remote(self, regions: Mapping[int, int], peer: str) -> None:
        self._check(REMOTE_REGION, REMOTE_OFFSET, regions, "remote", f" of peer {peer!r}")

    def _check(self, region_col: int, offset_col: int, regions: Mapping[int, int], side: str, where: str) -> None:
        if len(self.rows) <= self.SMALL:
            for i, row in enumerate(self.rows):
                _check_row(i, row, region_col, offset_col, regions, side, where)
            return
        arr = self.arr
        region, start, length = arr[:, region_col], arr[:, offset_col], arr[:, LENGTH]
        if len(regions) == 1:
            ((only_id, only_size),) = regions.items()
            bad = (region != only_id) | (start + length > only_size)
        else:
            ids = np.array(sorted(regions), dtype=np.int64)
            sizes = np.array([regions[int(i)] for i in ids], dtype=np.int64)
            pos = np.minimum(np.searchsorted(ids, region), max(len(ids) - 1, 0))
            if len(ids):
                bad = (ids[pos] != region) | (start + length > sizes[pos])
            else:
                bad = np.ones(len(arr), dtype=bool)
        bad |= (length <= 0) | (start < 0)
        if bad.any():
            i = int(np.argmax(bad))
            _check_row(i, self.rows[i], region_col, offset_col, regions, side, where)


def _check_row(
    i: int,
    row: tuple[int, int, int, int, int],
    region_col: int,
    offset_col: int,
    regions: Mapping[int, int],
    side: str,
    where: str,
) -> None:
    region, start, length = row[region_col], row[offset_col], row[LENGTH]
    if length <= 0:
        raise ValueError(f"op {i}: length {length} must be > 0")
    size = regions.get(region)
    if size is None:
        raise ValueError(f"op {i}: unknown {side} region {region}{where} (known: {sorted(regions)})")
    if start < 0 or start + length > size:
        raise ValueError(
            f"op {i}: {side} range [{start}, {start + length}) is outside region {region}{where} of {size} bytes"
        )


def all_failed(n: int, seconds: float, error: str, *, settled: bool = True) -> TransferResult:
    return TransferResult(ok=[], failed=list(range(n)), bytes_moved=0, seconds=seconds, error=error,
                          settled=settled)


def all_ok(table: OpTable, seconds: float) -> TransferResult:
    return TransferResult(ok=list(range(len(table))), failed=[], bytes_moved=table.total_bytes, seconds=seconds)


def buffer_address(buffer: memoryview) -> tuple[np.ndarray, memoryview, int, int]:
    """A uint8 array and a flat byte memoryview over a writable, C-contiguous buffer, plus its address and length."""
    if not isinstance(buffer, memoryview):
        raise TypeError(f"register() takes a memoryview, got {type(buffer).__name__}")
    if buffer.readonly:
        raise ValueError("register() needs a writable buffer")
    if not buffer.c_contiguous:
        raise ValueError("register() needs a C-contiguous buffer")
    if buffer.nbytes == 0:
        raise ValueError("register() needs a non-empty buffer")
    flat = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
    view = np.frombuffer(flat, dtype=np.uint8)
    return view, flat, int(view.ctypes.data), int(view.nbytes)
