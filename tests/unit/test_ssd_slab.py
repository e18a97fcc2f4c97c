"""The SSD slab's disk stays within its limit across restarts (issue 17, item 6): ``close`` removes the slab, a slab
whose process died is removed by the next one opened beside it, a live one (locked) never is, and two live slabs
cannot share a file. Real files, a real killed process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from pathlib import Path

import pytest

from kvpool.ssd import SLAB_NAME, SsdSlab, remove_orphan_slabs

REPO = Path(__file__).resolve().parents[2]


def test_close_removes_the_slab_and_its_empty_directory(tmp_path: Path) -> None:
    slab = SsdSlab(tmp_path / "shard-a", 4096, 8)
    assert slab.path.stat().st_size == 8 * 4096
    slab.close()
    assert not (tmp_path / "shard-a").exists()
    slab.close()  # idempotent


def test_a_killed_shards_slab_is_removed_by_the_next_and_a_live_one_is_kept(tmp_path: Path) -> None:
    live = SsdSlab(tmp_path / "live", 4096, 4)
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from kvpool.ssd import SsdSlab; "
            f"s = SsdSlab({str(tmp_path / 'dead')!r}, 4096, 16); print('open', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        assert remove_orphan_slabs(tmp_path) == []  # both slabs are held by live processes
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    dead = tmp_path / "dead" / SLAB_NAME
    assert dead.exists()  # a killed shard could not close its slab
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not ours")
    fresh = SsdSlab(tmp_path / "fresh", 4096, 4)
    assert not dead.exists() and not dead.parent.exists()  # removed before the new slab reserved its space
    assert live.path.exists() and (tmp_path / "other" / "notes.txt").exists()
    assert sorted(p.parent.name for p in tmp_path.glob(f"*/{SLAB_NAME}")) == ["fresh", "live"]
    fresh.close()
    live.close()


def test_two_live_slabs_cannot_share_a_file(tmp_path: Path) -> None:
    first = SsdSlab(tmp_path / "shard", 4096, 4)
    first.write(0, memoryview(b"\x07" * 4096))
    with pytest.raises(RuntimeError, match="in use by another live shard"):
        SsdSlab(tmp_path / "shard", 4096, 4)
    out = bytearray(4096)
    assert first.read_into(0, memoryview(out)) == 4096 and out == b"\x07" * 4096  # not truncated by the attempt
    first.close()


def test_a_reopened_slab_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "shard" / SLAB_NAME
    path.parent.mkdir()
    path.write_bytes(b"\x01" * 100_000)  # what a killed shard left, under the same directory
    slab = SsdSlab(tmp_path / "shard", 4096, 2)
    out = bytearray(4096)
    slab.read_into(0, memoryview(out))
    assert bytes(out) == bytes(4096) and path.stat().st_size == 2 * 4096
    slab.close()

