"""Supervised server subprocesses for the benches: start, wait until ready, stop, and account for leftovers.

A ``ServerProcess`` runs one command in its own session (``start_new_session``), its stdout and stderr in a log
file. ``wait_ready`` polls a readiness predicate once a second until it holds, the process exits (RuntimeError
with the log's tail) or the deadline passes (TimeoutError with the log's tail). ``stop`` sends SIGTERM, waits
(bounded), then SIGKILLs the process group; with ``reap_session`` it also waits (bounded) for the processes of the
server's session to go (Ray's processes inherit a ``kvstack serve`` session) and SIGKILLs those still there — they
are the server's own. ``summary`` is the JSON record of what happened. Ports come from
``cluster.local_cluster.free_port`` (the one free-port helper).

Who calls it: ``bench.live_compare`` (one ``kvstack serve`` per policy, ready when its log says it is serving) and
``bench.oracle`` (plain vLLM's OpenAI server, ready when ``/health`` answers 200).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

POLL_S = 1.0
SESSION_GRACE_S = 30.0  # Ray processes may outlive the driver by a moment
KILL_WAIT_S = 30.0
_RAY_MARKERS = ("raylet", "gcs_server", "ray::", "ray/_private", "vllm", "/tmp/kvs-")


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    import psutil

    out = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def new_ray_like_processes(before: set[int]) -> list[str]:
    """Processes started since ``before`` that look like Ray / vLLM (reported, never killed: they may be others')."""
    import psutil

    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.info["pid"] in before:
            continue
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(m in cmd for m in _RAY_MARKERS):
            out.append(f"{proc.info['pid']} {cmd[:160]}")
    return out


def log_contains(log: Path, text: str) -> Callable[[], bool]:
    """Readiness predicate: ``text`` appeared in the log file."""
    return lambda: text in log.read_text(errors="replace")


def http_ok(url: str, timeout_s: float = 2.0) -> Callable[[], bool]:
    """Readiness predicate: GET ``url`` answers 200."""

    def ready() -> bool:
        try:
            return httpx.get(url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


class ServerProcess:
    """One server subprocess in its own session, and what happened to it."""

    def __init__(self, name: str, cmd: Sequence[str], log: Path, *, cwd: Path | None = None,
                 env: dict[str, str] | None = None, nice: int = 0) -> None:
        self.name, self.cmd, self.log, self.cwd, self.env, self.nice = name, list(cmd), log, cwd, env, nice
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self.stop_s: float | None = None
        self.exit_code: int | None = None
        self.killed = False
        self.leftover_pids: list[int] = []
        self.still_alive_pids: list[int] = []

    def start(self) -> None:
        nice = self.nice
        self.started_at = time.monotonic()
        with open(self.log, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, ready: Callable[[], bool], deadline_s: float) -> float:
        """Poll ``ready`` until it holds; returns (and records) the seconds since ``start``."""
        assert self.proc is not None and self.started_at is not None, "start() first"
        while True:
            if ready():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() - self.started_at > deadline_s:
                raise TimeoutError(f"{self.name} not ready within {deadline_s:.0f} s (log {self.log}):\n"
                                   f"{self.log_tail()}")
            time.sleep(POLL_S)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, deadline_s: float, *, reap_session: bool = False) -> None:
        """SIGTERM, wait (bounded), SIGKILL the group if needed; with ``reap_session`` list (and kill) what is left
        of its session."""
        proc = self.proc
        if proc is None:
            return
        t0 = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=KILL_WAIT_S)
        self.exit_code = proc.returncode
        if reap_session:
            self._reap_session(proc.pid)
        self.stop_s = time.monotonic() - t0

    def _reap_session(self, sid: int) -> None:
        grace = time.monotonic() + SESSION_GRACE_S
        left = session_pids(sid)
        while left and time.monotonic() < grace:
            time.sleep(1.0)
            left = session_pids(sid)
        self.leftover_pids = left
        for pid in left:  # ours (the session of the server we started): do not leave them running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gone_by = time.monotonic() + 10.0
        while left and session_pids(sid) and time.monotonic() < gone_by:
            time.sleep(0.5)
        self.still_alive_pids = session_pids(sid) if left else []

    def summary(self) -> dict[str, Any]:
        return {"ready_s": self.ready_s, "stop_s": self.stop_s, "exit_code": self.exit_code,
                "killed_after_timeout": self.killed, "leftover_pids": self.leftover_pids,
                "still_alive_after_kill": self.still_alive_pids, "log": str(self.log)}
