"""E2E: SIGTERM to ``kvstack serve`` ends it with exit code 0 and leaves no process behind (Ray's node processes,
Serve's replicas, the engines' cores and workers: every process of its tree is gone within a deadline).

It ends the package's shared server, so it runs last (``conftest.py``: modules run in file-name order)."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sigterm_leaves_no_process_behind(server) -> None:
    proc = server["proc"]
    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) > 5, "the serve process should own the Ray node processes"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, server["log"].read_text()[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(1)
    assert not alive, f"processes left behind: {[psutil.Process(p).cmdline()[:2] for p in alive]}"
