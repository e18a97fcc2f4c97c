"""``LocalCluster.start`` survives Ray's fixed 30 s node-startup deadline (seen in CI on a loaded 2-core box) and a GCS
port taken between picking and binding it (seen in CI): such a failure is torn down — the processes it left are
ended by the cluster's private temp dir — and the start is tried again; any other failure is raised at once. Ray
itself is the neighbour here (``_start_nodes`` and ``ray.init`` are replaced); ``end_processes_of`` runs on real
processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cluster import local_cluster as lc

STARTUP_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")
GCS_PORT_TAKEN = RuntimeError("Failed to start GCS.  Last 1 lines of error files:\n(gcs_server) grpc_server.cc:134: "
                              "Check failed: server_ Failed to start the grpc server. The specified port is 37199.")


class _FakeCluster:
    address = "127.0.0.2:1"

    def shutdown(self) -> None:
        pass


def _cluster_whose_nodes_fail(monkeypatch: pytest.MonkeyPatch,
                              failures: list[Exception]) -> tuple[lc.LocalCluster, dict]:
    seen = {"starts": 0, "swept": [], "init": 0}
    cluster = lc.LocalCluster(workers=1)

    def start_nodes(self: lc.LocalCluster) -> None:
        seen["starts"] += 1
        self._cluster = _FakeCluster()
        if failures:
            raise failures.pop(0)

    def init(**_kw: object) -> None:
        seen["init"] += 1

    monkeypatch.setattr(lc.LocalCluster, "_start_nodes", start_nodes)
    monkeypatch.setattr(lc, "end_processes_of", lambda tmp, grace_s=10.0: seen["swept"].append(tmp) or [])
    import ray

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return cluster, seen


def test_a_node_that_misses_rays_startup_deadline_is_torn_down_and_started_again(monkeypatch) -> None:
    cluster, seen = _cluster_whose_nodes_fail(monkeypatch, [STARTUP_TIMEOUT])
    cluster.start()
    try:
        assert seen["starts"] == 2 and seen["init"] == 1
        assert seen["swept"] == [cluster._tmp]  # the failed start's leftovers, found by the cluster's own temp dir
    finally:
        cluster.shutdown()


def test_a_gcs_whose_port_was_taken_is_started_again(monkeypatch) -> None:
    cluster, seen = _cluster_whose_nodes_fail(monkeypatch, [GCS_PORT_TAKEN])
    cluster.start()
    try:
        assert seen["starts"] == 2 and seen["init"] == 1 and seen["swept"] == [cluster._tmp]
    finally:
        cluster.shutdown()


def test_other_failures_and_the_last_attempt_are_raised_and_leave_nothing(monkeypatch) -> None:
    cluster, seen = _cluster_whose_nodes_fail(monkeypatch, [ValueError("bad resources")])
    with pytest.raises(ValueError, match="bad resources"):
        cluster.start()
    assert seen["starts"] == 1 and seen["init"] == 0 and len(seen["swept"]) == 1  # shut down, swept once

    cluster, seen = _cluster_whose_nodes_fail(monkeypatch, [STARTUP_TIMEOUT] * 3)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.start()
    assert seen["starts"] == 3 and seen["init"] == 0


def test_end_processes_of_ends_exactly_the_processes_naming_the_dir(tmp_path) -> None:
    mine = tmp_path / "kvs-abc" / "ray"
    other = tmp_path / "kvs-other"
    # A process that ignores SIGTERM (so the SIGKILL after the grace is exercised) and one of another cluster.
    code = "import signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code, f"--session-dir={mine}"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--session-dir={other}"])
    try:
        time.sleep(0.5)  # the SIGTERM handler is installed
        ended = lc.end_processes_of(str(tmp_path / "kvs-abc"), grace_s=1.0)
        assert ended == [stubborn.pid]
        assert stubborn.wait(timeout=10) != 0
        assert bystander.poll() is None
    finally:
        for p in (stubborn, bystander):
            p.kill()
            p.wait()


def test_a_local_cluster_gets_rays_token_authentication_unless_the_caller_chose_a_mode() -> None:
    """Ray's gRPC servers listen on every interface whatever the node IP: a local cluster that authenticated no one
    would run code for anyone who reaches the host (``tests/integration/test_ray_access.py`` starts one for real)."""
    env: dict[str, str] = {}
    assert lc.ensure_ray_token(env) == "token" and len(env["RAY_AUTH_TOKEN"]) == 64
    other: dict[str, str] = {"RAY_AUTH_MODE": ""}
    lc.ensure_ray_token(other)
    assert other["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]  # a fresh one per cluster
    kept = {"RAY_AUTH_TOKEN": "given"}
    assert lc.ensure_ray_token(kept) == "token" and kept["RAY_AUTH_TOKEN"] == "given"
    chosen = {"RAY_AUTH_MODE": "disabled"}
    assert lc.ensure_ray_token(chosen) == "disabled" and "RAY_AUTH_TOKEN" not in chosen
    assert "RAY_AUTH_MODE" not in lc.LOCAL_CLUSTER_ENV

