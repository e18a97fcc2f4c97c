"""Supervised server subprocesses for the benches: start, wait until ready, stop, and account for leftovers.

A ``ServerProcess`` runs one command in a process group of its own, its stdout and stderr in a log file, and tags
it with ``SERVER_TAG_ENV`` in its environment, which the processes it starts (Ray's daemons and workers) inherit.
It stays in the caller's session on purpose: with the kernel's autogroup scheduling on
(``/proc/sys/kernel/sched_autogroup_enabled``), every session is weighed as one scheduling group, and a server in a
session of its own starved the bench's load generator beside it for seconds at a time — the load generator's own
stalls then read as the server's TTFT tail (``bench/reports/vllm_bench_serve_no_autogroup``). In one session, the
server's threads and the load generator's are scheduled as peers, as with autogroup off. ``scheduling_facts``
records which case a run was in.

``wait_ready`` polls a readiness predicate once a second until it holds, the process exits (RuntimeError with the
log's tail) or the deadline passes (TimeoutError with the log's tail). ``stop`` sends SIGTERM, waits (bounded), then
SIGKILLs the process group; with ``reap`` it also waits (bounded) for the processes the server had when asked to stop
— tagged ones and their descendants; Ray's may outlive the driver by a moment, in process groups of their own — to
go, and SIGKILLs those still there: they are the server's own. ``server_pids`` lists a server's processes: its
tagged ones, or for a server started elsewhere (untagged), its session's. ``summary`` is the JSON record of what
happened. Ports come from ``cluster.local_cluster.free_port`` (the one free-port helper).

Who calls it: ``bench.live_compare``, ``bench.vllm_bench_compare`` and ``bench.soak`` (``kvstack serve`` or Ray
Serve LLM, ready when the log says it is serving) and ``bench.oracle`` (plain vLLM's OpenAI server, ready when
``/health`` answers 200).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

POLL_S = 1.0
REAP_GRACE_S = 30.0  # Ray processes may outlive the driver by a moment
KILL_WAIT_S = 30.0
_RAY_MARKERS = ("raylet", "gcs_server", "ray::", "ray/_private", "vllm", "/tmp/kvs-")
SERVER_TAG_ENV = "KVSTACK_BENCH_SERVER"
AUTOGROUP_SYSCTL = Path("/proc/sys/kernel/sched_autogroup_enabled")


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


def _alive(procs: list[Any]) -> list[Any]:
    """Those of ``procs`` (``psutil.Process``) still running and not zombies."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def tagged_processes(tag: str) -> list[Any]:
    """Live (non-zombie) processes whose environment carries ``SERVER_TAG_ENV=tag``, and their descendants: a
    process that rewrites its title (Ray's agents do, with ``setproctitle``) no longer shows its environment, but
    its parent does. ``psutil.Process`` objects, so a pid reused later is not mistaken for one of them."""
    import psutil

    tagged: dict[int, Any] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(SERVER_TAG_ENV) == tag:
                tagged[proc.pid] = proc
                tagged.update((c.pid, c) for c in proc.children(recursive=True))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return sorted(_alive(list(tagged.values())), key=lambda p: p.pid)


def tagged_pids(tag: str) -> list[int]:
    """The pids of ``tagged_processes(tag)``."""
    return [p.pid for p in tagged_processes(tag)]


def server_pids(pid: int) -> list[int]:
    """The processes of the server whose main process is ``pid``: its tagged ones (``tagged_processes``) when a
    ``ServerProcess`` started it, else those of its session (a server started elsewhere, e.g. ``kvstack serve``
    in a terminal)."""
    import psutil

    try:
        tag = psutil.Process(pid).environ().get(SERVER_TAG_ENV)
        sid = os.getsid(pid)
    except (ProcessLookupError, PermissionError, psutil.Error):
        return []
    return tagged_pids(tag) if tag else session_pids(sid)


def _autogroup(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


def scheduling_facts(server_pid: int | None = None) -> dict[str, Any]:
    """For a bench's meta: whether the kernel's autogroup scheduling is on, and whether the server (when given)
    shares this process's autogroup, i.e. its threads and the load generator's are scheduled as peers."""
    try:
        enabled: bool | None = AUTOGROUP_SYSCTL.read_text().strip() == "1"
    except OSError:
        enabled = None
    facts: dict[str, Any] = {"sched_autogroup_enabled": enabled}
    if server_pid is not None:
        mine, theirs = _autogroup(os.getpid()), _autogroup(server_pid)
        facts["server_shares_client_autogroup"] = None if mine is None or theirs is None else mine == theirs
    return facts


def scheduling_line(facts: list[dict[str, Any]]) -> str:
    """One report line over the runs' ``scheduling_facts``."""
    if not facts:
        return "Scheduling: not recorded."
    on = {f.get("sched_autogroup_enabled") for f in facts}
    shared = sum(f.get("server_shares_client_autogroup") is True for f in facts)
    state = {frozenset({True}): "on", frozenset({False}): "off"}.get(frozenset(on), "unknown or mixed")
    return (f"Scheduling: the kernel's autogroup is {state}; the server shared the load generator's autogroup in "
            f"{shared} of {len(facts)} runs (peers on the CPUs, as with autogroup off).")


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
    """One server subprocess in a process group of its own (in the caller's session), tagged, and what happened
    to it."""

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
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def start(self) -> None:
        nice = self.nice
        self.started_at = time.monotonic()
        env = {**(os.environ if self.env is None else self.env), SERVER_TAG_ENV: self.tag}
        with open(self.log, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         process_group=0,
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

    def stop(self, deadline_s: float, *, reap: bool = False) -> None:
        """SIGTERM, wait (bounded), SIGKILL the group if needed; with ``reap`` wait (bounded) for the processes
        the server had when asked to stop (``tagged_processes``) to go, and SIGKILL those still there."""
        proc = self.proc
        if proc is None:
            return
        t0 = time.monotonic()
        family = tagged_processes(self.tag) if reap else []
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
        if reap:
            self._reap(family)
        self.stop_s = time.monotonic() - t0

    def pids(self) -> list[int]:
        """The server's live processes (``tagged_processes``)."""
        return tagged_pids(self.tag)

    def _reap(self, family: list[Any]) -> None:
        grace = time.monotonic() + REAP_GRACE_S
        left = _alive(family)
        while left and time.monotonic() < grace:
            time.sleep(1.0)
            left = _alive(left)
        self.leftover_pids = [p.pid for p in left]
        for p in left:  # ours (the server we started, and what it started): do not leave them running
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        gone_by = time.monotonic() + 10.0
        while left and _alive(left) and time.monotonic() < gone_by:
            time.sleep(0.5)
        self.still_alive_pids = [p.pid for p in _alive(left)]

    def summary(self) -> dict[str, Any]:
        return {"ready_s": self.ready_s, "stop_s": self.stop_s, "exit_code": self.exit_code,
                "killed_after_timeout": self.killed, "leftover_pids": self.leftover_pids,
                "still_alive_after_kill": self.still_alive_pids, "log": str(self.log)}
