"""Mechanism shared by every transfer backend: epochs, the peer-admission rule, op validation, deadlines.

Called by ``kvpool.transfer.nixl`` and ``kvpool.transfer.tcp`` only; callers of the transfer layer use
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
        return Admission.KEEP if meta.regions == current.regions and meta.payload == current.payload else Admission.REFRESH
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
    """The ops of one call as an (N, 5) int64 array (columns as in ``BlockOp``), validated against region sizes."""

    __slots__ = ("arr",)

    def __init__(self, ops: Sequence[BlockOp]) -> None:
        if ops:
            self.arr = np.array(
                [(o.remote_region, o.remote_offset, o.local_region, o.local_offset, o.length) for o in ops],
                dtype=np.int64,
            )
        else:
            self.arr = np.zeros((0, 5), dtype=np.int64)

    def __len__(self) -> int:
        return int(self.arr.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.arr[:, LENGTH].sum())

    def check_local(self, regions: Mapping[int, int]) -> None:
        self._check(LOCAL_REGION, LOCAL_OFFSET, regions, "local", "")

    def check_remote(self, regions: Mapping[int, int], peer: str) -> None:
        self._check(REMOTE_REGION, REMOTE_OFFSET, regions, "remote", f" of peer {peer!r}")

    def _check(self, region_col: int, offset_col: int, regions: Mapping[int, int], side: str, where: str) -> None:
        if not len(self):
            return
        arr = self.arr
        bad_len = np.flatnonzero(arr[:, LENGTH] <= 0)
        if bad_len.size:
            i = int(bad_len[0])
            raise ValueError(f"op {i}: length {int(arr[i, LENGTH])} must be > 0")
        ids = np.fromiter(regions.keys(), dtype=np.int64, count=len(regions))
        sizes = np.fromiter(regions.values(), dtype=np.int64, count=len(regions))
        order = np.argsort(ids)
        ids, sizes = ids[order], sizes[order]
        pos = np.searchsorted(ids, arr[:, region_col])
        pos_clipped = np.minimum(pos, max(len(ids) - 1, 0))
        known = (pos < len(ids)) & (ids[pos_clipped] == arr[:, region_col]) if len(ids) else np.zeros(len(arr), bool)
        unknown = np.flatnonzero(~known)
        if unknown.size:
            i = int(unknown[0])
            raise ValueError(
                f"op {i}: unknown {side} region {int(arr[i, region_col])}{where} (known: {sorted(int(x) for x in ids)})"
            )
        size = sizes[pos_clipped]
        start = arr[:, offset_col]
        out = np.flatnonzero((start < 0) | (start + arr[:, LENGTH] > size))
        if out.size:
            i = int(out[0])
            raise ValueError(
                f"op {i}: {side} range [{int(start[i])}, {int(start[i] + arr[i, LENGTH])}) is outside region "
                f"{int(arr[i, region_col])}{where} of {int(size[i])} bytes"
            )


def all_failed(n: int, seconds: float, error: str) -> TransferResult:
    return TransferResult(ok=[], failed=list(range(n)), bytes_moved=0, seconds=seconds, error=error)


def all_ok(table: OpTable, seconds: float) -> TransferResult:
    return TransferResult(ok=list(range(len(table))), failed=[], bytes_moved=table.total_bytes, seconds=seconds)


def buffer_address(buffer: memoryview) -> tuple[np.ndarray, int, int]:
    """A uint8 view over a writable, C-contiguous buffer, its address and byte length (for registration)."""
    if not isinstance(buffer, memoryview):
        raise TypeError(f"register() takes a memoryview, got {type(buffer).__name__}")
    if buffer.readonly:
        raise ValueError("register() needs a writable buffer")
    if not buffer.c_contiguous:
        raise ValueError("register() needs a C-contiguous buffer")
    if buffer.nbytes == 0:
        raise ValueError("register() needs a non-empty buffer")
    view = np.frombuffer(buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer, dtype=np.uint8)
    return view, int(view.ctypes.data), int(view.nbytes)
