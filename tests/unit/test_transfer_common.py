"""Pure rules shared by the transfer backends (``kvpool.transfer.common``): epochs, admission, op validation."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from kvpool.transfer.base import TRANSFER_WIRE_VERSION, AgentMetadata, BlockOp, RegionDesc, StaleMetadataError
from kvpool.transfer.common import Admission, Deadline, OpTable, admit, epoch_time, new_epoch


def _meta(epoch: str, regions: list[RegionDesc] | None = None, backend: str = "tcp") -> AgentMetadata:
    return AgentMetadata(
        version=TRANSFER_WIRE_VERSION,
        backend=backend,
        agent_name="shard",
        epoch=epoch,
        regions=regions if regions is not None else [RegionDesc(0, 100)],
        payload=b"127.0.0.2:1",
    )


def test_epochs_are_unique_and_time_ordered() -> None:
    clock = itertools.count(1_000)
    a, b = new_epoch(lambda: next(clock)), new_epoch(lambda: next(clock))
    assert a != b
    assert epoch_time(a) == 1_000 and epoch_time(b) == 1_001
    assert epoch_time("not-an-epoch") is None and epoch_time("plain") is None


def test_admission_rules() -> None:
    old, new = new_epoch(lambda: 10), new_epoch(lambda: 20)
    assert admit(_meta(old), "tcp", None) is Admission.ADD
    assert admit(_meta(old), "tcp", _meta(old)) is Admission.KEEP
    assert admit(_meta(old, [RegionDesc(0, 100), RegionDesc(1, 5)]), "tcp", _meta(old)) is Admission.REFRESH
    assert admit(_meta(new), "tcp", _meta(old)) is Admission.REPLACE
    with pytest.raises(StaleMetadataError, match="older"):
        admit(_meta(old), "tcp", _meta(new))
    assert admit(_meta("opaque-a"), "tcp", _meta("opaque-b")) is Admission.REPLACE  # unordered epochs: replace
    with pytest.raises(StaleMetadataError, match="backend"):
        admit(_meta(old, backend="nixl"), "tcp", None)
    with pytest.raises(StaleMetadataError, match="version"):
        admit(msgspec.structs.replace(_meta(old), version=TRANSFER_WIRE_VERSION + 1), "tcp", None)


@pytest.mark.parametrize("n", [1, 5, OpTable.SMALL + 1, 500])  # both the row-by-row and the vectorized path
def test_op_validation_names_the_first_bad_op(n: int) -> None:
    regions = {0: 1000, 3: 64}
    good = [BlockOp(0, i, 3, 0, 64) for i in range(n)]
    OpTable(good).check_local(regions)
    OpTable(good).check_remote(regions, "p")
    bad_cases = [
        (BlockOp(0, 0, 3, 1, 64), "op {i}: local range \\[1, 65\\) is outside region 3 of 64 bytes"),
        (BlockOp(0, 0, 9, 0, 8), "op {i}: unknown local region 9"),
        (BlockOp(0, 0, 3, -1, 8), "outside region 3"),
        (BlockOp(0, 0, 3, 0, 0), "op {i}: length 0 must be > 0"),
    ]
    for bad, message in bad_cases:
        ops = [*good[: n - 1], bad]
        with pytest.raises(ValueError, match=message.format(i=n - 1)):
            OpTable(ops).check_local(regions)
    ops = [*good[: n - 1], BlockOp(0, 990, 3, 0, 64)]
    with pytest.raises(ValueError, match=f"op {n - 1}: remote range \\[990, 1054\\) is outside region 0 of peer 'p'"):
        OpTable(ops).check_remote(regions, "p")
    with pytest.raises(ValueError, match="unknown remote region 0 of peer 'p'"):
        OpTable(good).check_remote({}, "p")


def test_op_table_sums_bytes() -> None:
    table = OpTable([BlockOp(0, 0, 0, 0, 10), BlockOp(0, 10, 0, 10, 5)])
    assert len(table) == 2 and table.total_bytes == 15
    assert table.arr.shape == (2, 5)
    assert len(OpTable([])) == 0 and OpTable([]).arr.shape == (0, 5)


def test_deadline_uses_the_injected_clock() -> None:
    now = [100.0]
    deadline = Deadline(2.0, clock=lambda: now[0])
    assert deadline.remaining() == 2.0 and not deadline.expired()
    now[0] = 102.0
    assert deadline.expired() and deadline.elapsed() == 2.0
    with pytest.raises(ValueError, match="NaN"):
        Deadline(float("nan"))
