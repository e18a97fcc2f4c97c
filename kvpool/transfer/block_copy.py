"""The same-host data path: a validated batch of block ops copied between memory mapped into this process.

Called by ``kvpool.transfer.shm`` (its ``read`` / ``write``, after ``OpTable`` validated every op against the
regions and the peer was found alive): ``copy_blocks(direction, table, local, remote, deadline)`` copies and returns
the ``TransferResult`` (indices into the caller's ops). Nothing here checks bounds: the table did.

How the bytes move, cheapest first:
- **gather / scatter**: the ops have one length L, one side of the copy is one ascending run of them in one region
  (a contiguous staging buffer, or the KV cache's consecutive blocks) and the other side's offsets are multiples of
  L in one region (a shard's slots): one ``numpy.take`` (gather into the run) or one indexed assignment (scatter
  from it) per chunk of ops — the per-block loop runs in C, at the speed of one large copy.
- otherwise, one ``memmove`` per op, with the addresses computed for the whole batch at once and the ops that
  continue the previous one on both sides merged into it (consecutive slots into consecutive blocks).
- batches of ``OpTable.SMALL`` ops or fewer: one ``memmove`` per op straight from the rows (numpy's per-call cost
  would outweigh what it saves).

The deadline is checked between chunks of ``CHUNK_OPS`` ops: the ops not started when it expires fail, the ones
before succeeded. Source and destination must not overlap (they are different mappings; ``memmove`` semantics are
kept per op either way).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvpool.transfer.base import TransferResult
from kvpool.transfer.common import LENGTH, LOCAL_OFFSET, LOCAL_REGION, REMOTE_OFFSET, REMOTE_REGION, Deadline, OpTable

#: Ops copied between two deadline checks.
CHUNK_OPS = 64


def copy_blocks(direction: str, table: OpTable, local: dict[int, np.ndarray], remote: dict[int, np.ndarray],
                deadline: Deadline) -> TransferResult:
    """``direction`` "read" copies remote -> local, "write" local -> remote; ``local`` / ``remote``: region id ->
    the uint8 array over it (referenced by the caller for the whole call)."""
    if direction not in ("read", "write"):
        raise ValueError(f"direction must be 'read' or 'write', got {direction!r}")
    n = len(table)
    if n <= OpTable.SMALL:
        return _per_row(direction, table, local, remote, deadline)
    arr = table.arr
    if direction == "read":
        src_side, dst_side = (REMOTE_REGION, REMOTE_OFFSET, remote), (LOCAL_REGION, LOCAL_OFFSET, local)
    else:
        src_side, dst_side = (LOCAL_REGION, LOCAL_OFFSET, local), (REMOTE_REGION, REMOTE_OFFSET, remote)
    lengths = arr[:, LENGTH]
    length = int(lengths[0])
    if (lengths == length).all():
        done = _strided(arr, n, length, src_side, dst_side, deadline)
        if done is not None:
            return done
    src = _addresses(arr, *src_side)
    dst = _addresses(arr, *dst_side)
    return _merged(src, dst, lengths, deadline)


def _per_row(direction: str, table: OpTable, local: dict[int, np.ndarray], remote: dict[int, np.ndarray],
             deadline: Deadline) -> TransferResult:
    lbase = {rid: int(a.ctypes.data) for rid, a in local.items()}
    rbase = {rid: int(a.ctypes.data) for rid, a in remote.items()}
    move = ctypes.memmove
    rows = table.rows
    moved = 0
    for i, (rr, ro, lr, lo, n) in enumerate(rows):
        if i and not i % CHUNK_OPS and deadline.expired():
            return _expired(i, len(rows), moved, deadline)
        if direction == "read":
            move(lbase[lr] + lo, rbase[rr] + ro, n)
        else:
            move(rbase[rr] + ro, lbase[lr] + lo, n)
        moved += n
    return _all_ok(len(rows), moved, deadline)


def _strided(arr: np.ndarray, n: int, length: int, src_side: tuple, dst_side: tuple,
             deadline: Deadline) -> TransferResult | None:
    """The gather / scatter path (module docstring), or None when the ops do not have its shape."""
    src_regions, dst_regions = arr[:, src_side[0]], arr[:, dst_side[0]]
    src_off, dst_off = arr[:, src_side[1]], arr[:, dst_side[1]]
    if (src_regions != src_regions[0]).any() or (dst_regions != dst_regions[0]).any():
        return None
    src_arr, dst_arr = src_side[2][int(src_regions[0])], dst_side[2][int(dst_regions[0])]
    ascending = np.arange(n, dtype=np.int64) * length
    if (dst_off == dst_off[0] + ascending).all() and not (src_off % length).any():  # gather into a run
        slots, run, index = _slots(src_arr, length), _run(dst_arr, int(dst_off[0]), n, length), src_off // length

        def step(k: int, j: int) -> None:  # mode="clip": the table checked the bounds; "raise" buffers the copy
            np.take(slots, index[k:j], axis=0, out=run[k:j], mode="clip")
    elif (src_off == src_off[0] + ascending).all() and not (dst_off % length).any():  # scatter from a run
        slots, run, index = _slots(dst_arr, length), _run(src_arr, int(src_off[0]), n, length), dst_off // length

        def step(k: int, j: int) -> None:
            slots[index[k:j]] = run[k:j]
    else:
        return None
    for k in range(0, n, CHUNK_OPS):
        if k and deadline.expired():
            return _expired(k, n, k * length, deadline)
        step(k, k + CHUNK_OPS)
    return _all_ok(n, n * length, deadline)


def _slots(region: np.ndarray, length: int) -> np.ndarray:
    """The region as rows of ``length`` bytes (the slots at offsets that are multiples of it)."""
    return region[: region.size // length * length].reshape(-1, length)


def _run(region: np.ndarray, start: int, n: int, length: int) -> np.ndarray:
    """``n`` consecutive blocks of ``length`` bytes from ``start`` as rows."""
    return region[start: start + n * length].reshape(n, length)


def _addresses(arr: np.ndarray, region_col: int, offset_col: int, arrays: dict[int, np.ndarray]) -> np.ndarray:
    """Each op's address on one side: its region's base plus its offset (the table checked that every region is
    one of ``arrays``; a peer's region ids are whatever it registered, so they index a sorted list, not a table)."""
    ids = sorted(arrays)
    bases = np.array([arrays[rid].ctypes.data for rid in ids], dtype=np.int64)
    return bases[np.searchsorted(np.array(ids, dtype=np.int64), arr[:, region_col])] + arr[:, offset_col]


def _merged(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, deadline: Deadline) -> TransferResult:
    """One memmove per run of ops that continue each other on both sides."""
    n = len(lengths)
    ends_src, ends_dst = src[:-1] + lengths[:-1], dst[:-1] + lengths[:-1]
    starts = np.flatnonzero(np.concatenate(([True], (src[1:] != ends_src) | (dst[1:] != ends_dst))))
    run_bytes = np.add.reduceat(lengths, starts)
    move = ctypes.memmove
    first, src_l, dst_l, len_l = starts.tolist(), src[starts].tolist(), dst[starts].tolist(), run_bytes.tolist()
    moved = 0
    last_check = 0
    for k, (d, s, m) in enumerate(zip(dst_l, src_l, len_l)):
        op = first[k]
        if op - last_check >= CHUNK_OPS:
            last_check = op
            if deadline.expired():
                return _expired(op, n, moved, deadline)
        move(d, s, m)
        moved += m
    return _all_ok(n, moved, deadline)


def _all_ok(n: int, moved: int, deadline: Deadline) -> TransferResult:
    return TransferResult(ok=list(range(n)), failed=[], bytes_moved=moved, seconds=deadline.elapsed())


def _expired(done: int, n: int, moved: int, deadline: Deadline) -> TransferResult:
    return TransferResult(ok=list(range(done)), failed=list(range(done, n)), bytes_moved=moved,
                          seconds=deadline.elapsed(), error="deadline expired")
