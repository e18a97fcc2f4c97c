"""``kvpool.transfer.block_copy``: every path copies exactly the bytes a per-op copy would, and a deadline that
expires mid-batch leaves the ops after it untouched and failed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvpool.transfer import BlockOp
from kvpool.transfer.block_copy import CHUNK_OPS, copy_blocks
from kvpool.transfer.common import Deadline, OpTable

L = 256
FAR = 1 << 40  # a region id a peer registered: ids are the peer's, not 0..n-1


def _regions(seed: int) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    local = {0: rng.integers(0, 256, 400 * L, dtype=np.uint8), 1: rng.integers(0, 256, 100 * L, dtype=np.uint8)}
    remote = {0: rng.integers(0, 256, 300 * L, dtype=np.uint8),
              FAR: rng.integers(0, 256, 300 * L, dtype=np.uint8)}
    return local, remote


def _expected(direction: str, ops: list[BlockOp], local: dict[int, np.ndarray], remote: dict[int, np.ndarray],
              upto: int | None = None) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """What copying the first ``upto`` ops one by one with slices leaves in the regions."""
    local = {k: v.copy() for k, v in local.items()}
    remote = {k: v.copy() for k, v in remote.items()}
    for op in ops[:upto]:
        r = remote[op.remote_region][op.remote_offset: op.remote_offset + op.length]
        lo = local[op.local_region][op.local_offset: op.local_offset + op.length]
        if direction == "read":
            lo[:] = r
        else:
            r[:] = lo
    return local, remote


def _shapes(seed: int) -> dict[str, list[BlockOp]]:
    rng = np.random.default_rng(seed)
    slots = rng.permutation(300)
    return {
        "small": [BlockOp(0, int(s) * L, 0, i * L, L) for i, s in enumerate(slots[:20])],
        "gather": [BlockOp(0, int(s) * L, 0, 7 * L + i * L, L) for i, s in enumerate(slots[:200])],
        "scatter": [BlockOp(FAR, 5 * L + i * L, 0, int(s) * L, L) for i, s in enumerate(slots[:200])],
        "scattered both": [BlockOp(0, int(s) * L, 0, int(d) * L, L)
                           for s, d in zip(slots[:150], rng.permutation(400)[:150], strict=True)],
        "unaligned": [BlockOp(0, int(s) * L + 3, 0, i * L, L) for i, s in enumerate(slots[:100])],
        "mixed regions and lengths": [  # distinct slots on both sides: the order of the copies does not matter
            BlockOp(int(r), int(s) * L, i % 2, (i // 2) * L, int(n))
            for i, (r, s, n) in enumerate(zip(rng.choice([0, FAR], 120), slots[:120], rng.integers(1, L + 1, 120),
                                              strict=True))
        ],
        "adjacent runs": [BlockOp(0, (base + k) * L // 2, 0, (6 * j + k) * L // 2, L // 2)
                          for j, base in enumerate(range(0, 400, 8)) for k in range(4)],
    }


@pytest.mark.parametrize("direction", ["read", "write"])
@pytest.mark.parametrize("shape", list(_shapes(0)))
def test_every_path_copies_what_a_per_op_copy_does(direction: str, shape: str) -> None:
    ops = _shapes(1)[shape]
    local, remote = _regions(2)
    want_local, want_remote = _expected(direction, ops, local, remote)
    result = copy_blocks(direction, OpTable(ops), local, remote, Deadline(60.0))
    assert result.all_ok and result.ok == list(range(len(ops)))
    assert result.bytes_moved == sum(op.length for op in ops)
    for got, want in itertools.chain(zip(local.values(), want_local.values()),
                                     zip(remote.values(), want_remote.values())):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("direction", ["read", "write"])
@pytest.mark.parametrize("shape", ["gather", "scatter", "scattered both"])
def test_an_expired_deadline_fails_the_ops_not_started(direction: str, shape: str) -> None:
    ops = _shapes(3)[shape]
    local, remote = _regions(4)
    ticks = iter([0.0, 0.5, 2.0])  # start; the first check is in time, the second one late
    deadline = Deadline(1.0, clock=lambda: next(ticks, 3.0))
    want_local, want_remote = _expected(direction, ops, local, remote, upto=2 * CHUNK_OPS)
    result = copy_blocks(direction, OpTable(ops), local, remote, deadline)
    assert result.ok == list(range(2 * CHUNK_OPS))
    assert result.failed == list(range(2 * CHUNK_OPS, len(ops)))
    assert result.error == "deadline expired"
    assert result.bytes_moved == 2 * CHUNK_OPS * L
    for got, want in itertools.chain(zip(local.values(), want_local.values()),
                                     zip(remote.values(), want_remote.values())):
        assert np.array_equal(got, want)


@pytest.mark.parametrize(("shape", "moves"), [("gather", 0), ("scatter", 0), ("adjacent runs", 50),
                                              ("scattered both", 150)])
def test_the_loop_runs_in_c_or_merges_what_continues(shape: str, moves: int, monkeypatch) -> None:
    """Gathers and scatters make no per-op call; ops that continue each other on both sides are one memmove."""
    import ctypes

    calls = []
    real = ctypes.memmove
    monkeypatch.setattr(ctypes, "memmove", lambda d, s, n: calls.append(n) or real(d, s, n))
    ops = _shapes(5)[shape]
    local, remote = _regions(6)
    assert copy_blocks("read", OpTable(ops), local, remote, Deadline(60.0)).all_ok
    assert len(calls) == moves
    assert sum(calls) == (sum(op.length for op in ops) if moves else 0)


def test_a_small_batch_checks_the_deadline_too() -> None:
    ops = [BlockOp(0, i * 8, 0, i * 8, 8) for i in range(OpTable.SMALL)]
    local, remote = {0: np.zeros(1024, np.uint8)}, {0: np.ones(1024, np.uint8)}
    ticks = iter([0.0])
    result = copy_blocks("read", OpTable(ops), local, remote, Deadline(1.0, clock=lambda: next(ticks, 2.0)))
    assert result.all_ok  # 32 ops: fewer than a chunk, no check falls between them
    assert CHUNK_OPS > OpTable.SMALL


def test_a_direction_is_read_or_write() -> None:
    with pytest.raises(ValueError, match="direction"):
        copy_blocks("pull", OpTable([]), {}, {}, Deadline(1.0))
