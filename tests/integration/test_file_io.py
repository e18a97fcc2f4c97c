"""``kvpool.transfer.file_io.BlockFileIO`` against real files, for both engines (NIXL POSIX and os.preadv)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvpool.transfer.file_io import (
    DIRECT_ALIGN,
    BlockFileIO,
    FileIOOptions,
    FileOp,
    aligned_buffer,
    open_block_file,
)
from kvpool.transfer.metrics import TransferMetrics

pytestmark = pytest.mark.integration

BLOCK = 64 << 10


@pytest.fixture(params=["nixl_posix", "preadv"])
def io(request: pytest.FixtureRequest) -> Iterator[tuple[BlockFileIO, CollectorRegistry]]:
    registry = CollectorRegistry()
    fio = BlockFileIO(FileIOOptions(engine=request.param), metrics=TransferMetrics(registry))
    yield fio, registry
    fio.close()


@pytest.fixture
def block_file(tmp_path: Path) -> Iterator[tuple[int, bool]]:
    fd, direct = open_block_file(str(tmp_path / "blocks.bin"), create=True)
    yield fd, direct
    os.close(fd)


@pytest.mark.timeout(60)
def test_write_then_shuffled_read_is_identical(
    io: tuple[BlockFileIO, CollectorRegistry], block_file: tuple[int, bool]
) -> None:
    fio, registry = io
    fd, _direct = block_file
    n = 64
    src = aligned_buffer(n * BLOCK)
    src[:] = np.frombuffer(np.random.default_rng(0).bytes(n * BLOCK), dtype=np.uint8)
    dst = aligned_buffer(n * BLOCK)
    rs, rd = fio.register(memoryview(src)), fio.register(memoryview(dst))
    perm = np.random.default_rng(1).permutation(n)
    writes = [FileOp(fd, int(perm[i]) * BLOCK, rs, i * BLOCK, BLOCK) for i in range(n)]
    result = fio.write(writes, 30.0)
    assert result.all_ok, result.error
    assert os.fstat(fd).st_size == n * BLOCK
    reads = [FileOp(fd, int(perm[i]) * BLOCK, rd, i * BLOCK, BLOCK) for i in reversed(range(n))]
    result = fio.read(reads, 30.0)
    assert result.all_ok, result.error
    assert result.bytes_moved == n * BLOCK
    assert np.array_equal(dst, src)
    labels = {"backend": fio.engine, "direction": "read"}
    assert registry.get_sample_value("kvstack_transfer_bytes_total", labels) == n * BLOCK


@pytest.mark.timeout(60)
def test_read_past_end_of_file_fails_as_data(
    io: tuple[BlockFileIO, CollectorRegistry], block_file: tuple[int, bool]
) -> None:
    fio, registry = io
    fd, _ = block_file
    buf = aligned_buffer(4 * BLOCK)
    region = fio.register(memoryview(buf))
    assert fio.write([FileOp(fd, 0, region, 0, BLOCK)], 10.0).all_ok
    result = fio.read([FileOp(fd, 0, region, BLOCK, BLOCK), FileOp(fd, 8 * BLOCK, region, 2 * BLOCK, BLOCK)], 10.0)
    assert 1 in result.failed and not result.all_ok
    assert result.error
    labels = {"backend": fio.engine, "direction": "read"}
    assert registry.get_sample_value("kvstack_transfer_failed_ops_total", labels) == len(result.failed)


@pytest.mark.timeout(30)
def test_invalid_ops_are_rejected(io: tuple[BlockFileIO, CollectorRegistry], block_file: tuple[int, bool]) -> None:
    fio, _ = io
    fd, direct = block_file
    buf = aligned_buffer(2 * BLOCK)
    region = fio.register(memoryview(buf))
    with pytest.raises(ValueError, match="unknown region 5"):
        fio.read([FileOp(fd, 0, 5, 0, BLOCK)], 1.0)
    with pytest.raises(ValueError, match="outside region"):
        fio.read([FileOp(fd, 0, region, BLOCK, 2 * BLOCK)], 1.0)
    if direct:
        with pytest.raises(ValueError, match="O_DIRECT"):
            fio.read([FileOp(fd, 100, region, 0, DIRECT_ALIGN)], 1.0)
    assert fio.read([FileOp(fd, 0, region, 0, BLOCK)], 0.0).failed == [0]  # expired deadline: failed, no I/O


@pytest.mark.timeout(30)
def test_buffered_file_takes_unaligned_ops(io: tuple[BlockFileIO, CollectorRegistry], tmp_path: Path) -> None:
    fio, _ = io
    path = tmp_path / "plain.bin"
    payload = np.frombuffer(np.random.default_rng(2).bytes(10_000), dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    fd, direct = open_block_file(str(path), direct=False)
    try:
        assert not direct
        buf = np.zeros(5000, dtype=np.uint8)
        region = fio.register(memoryview(buf))
        result = fio.read([FileOp(fd, 123, region, 7, 4000)], 10.0)
        assert result.all_ok, result.error
        assert np.array_equal(buf[7:4007], payload[123:4123])
    finally:
        os.close(fd)
