"""bench.serve_process: a real subprocess started, waited for (log readiness, early exit, deadline) and stopped
(SIGTERM honoured; SIGTERM ignored -> SIGKILL of its group; its tagged processes reaped, also one that left the
group). The server stays in the caller's session and autogroup, so the kernel schedules its threads and the load
generator's as peers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bench.serve_process import ServerProcess, log_contains, scheduling_facts, server_pids, tagged_pids

READY_THEN_SLEEP = "import time; print('is serving', flush=True); time.sleep(60)"
# its child leaves the group, as Ray's reaper does (os.setpgrp): killing the group does not reach it, the tag does
IGNORE_TERM = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=os.setpgrp); "
               "print('is serving', flush=True); time.sleep(60)")


def _readable(path: str) -> bool:
    try:
        return bool(Path(path).read_text().split())
    except OSError:
        return False


def _server(tmp_path: Path, code: str) -> ServerProcess:
    return ServerProcess("toy", [sys.executable, "-c", code], tmp_path / "toy.log")


def test_ready_then_sigterm(tmp_path: Path) -> None:
    s = _server(tmp_path, READY_THEN_SLEEP)
    s.start()
    assert s.wait_ready(log_contains(s.log, "is serving"), 30.0) >= 0.0
    assert s.running() and s.proc is not None
    assert os.getsid(s.proc.pid) == os.getsid(0) and os.getpgid(s.proc.pid) == s.proc.pid
    assert server_pids(s.proc.pid) == s.pids() == [s.proc.pid]
    facts = scheduling_facts(s.proc.pid)
    # True where both autogroups can be read (not in every container: then the fact is unknown, never a guess)
    readable = all(_readable(f"/proc/{pid}/autogroup") for pid in (os.getpid(), s.proc.pid))
    assert facts["server_shares_client_autogroup"] is (True if readable else None)
    s.stop(10.0, reap=True)
    assert not s.running()
    assert (s.exit_code, s.killed, s.leftover_pids) == (-15, False, [])
    assert s.summary()["log"] == str(s.log)


def test_sigterm_ignored_kills_the_group_and_reaps_the_tagged_processes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.serve_process

    monkeypatch.setattr(bench.serve_process, "REAP_GRACE_S", 2.0)  # the child never ends: it is killed after it
    s = _server(tmp_path, IGNORE_TERM)
    s.start()
    s.wait_ready(log_contains(s.log, "is serving"), 30.0)
    assert s.proc is not None
    assert len(s.pids()) == 2  # the server and the child that left its group
    s.stop(0.5, reap=True)
    assert s.killed and s.exit_code == -9
    assert len(s.leftover_pids) == 1 and s.still_alive_pids == [] and tagged_pids(s.tag) == []


def test_exit_before_ready_raises_with_the_log(tmp_path: Path) -> None:
    s = _server(tmp_path, "print('boom'); raise SystemExit(3)")
    s.start()
    with pytest.raises(RuntimeError, match=r"toy exited 3:\nboom"):
        s.wait_ready(lambda: False, 30.0)


def test_not_ready_within_deadline(tmp_path: Path) -> None:
    s = _server(tmp_path, READY_THEN_SLEEP)
    s.start()
    try:
        with pytest.raises(TimeoutError, match="toy not ready within 1 s"):
            s.wait_ready(log_contains(s.log, "never printed"), 1.0)
    finally:
        s.stop(10.0)
    assert s.exit_code == -15
