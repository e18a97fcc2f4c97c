"""A local multi-node Ray cluster in a process of its own, for e2e tests that drive it from outside (``serve run``),
as an operator's cluster is: ``running_cluster(tmp, workers)`` (a generator for a module fixture) starts
``python -m tests.e2e.cluster_process`` — ``cluster.local_cluster.LocalCluster`` — and yields a ``ClusterProcess``
with the GCS ``address``; ``add_worker()`` adds a worker node (as an autoscaler would) and returns its node id.
Closing stdin shuts the cluster down; the process group is killed after the test regardless. Every wait has a
deadline."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 180.0


class ClusterProcess:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log
        self.address = self._reply(START_DEADLINE_S)["address"]

    def _reply(self, deadline_s: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], deadline_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"local cluster process gave no answer within {deadline_s:.0f} s:\n"
                               f"{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def add_worker(self, deadline_s: float = 120.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write("add-worker\n")
        self.proc.stdin.flush()
        return self._reply(deadline_s)["node_id"]


def running_cluster(tmp: Path, workers: int = 2, env: dict[str, str] | None = None) -> Iterator[ClusterProcess]:
    """``env``: more environment for the cluster's processes (e.g. Ray's TLS settings)."""
    log = tmp / "cluster.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.cluster_process", str(workers)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            start_new_session=True)
    try:
        yield ClusterProcess(proc, log)
    finally:
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # a clean shutdown: LocalCluster.shutdown
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main(workers: int) -> None:
    from cluster.local_cluster import LocalCluster

    answers = os.fdopen(os.dup(1), "w")  # the protocol's lines; anything else written to stdout goes to the log
    os.dup2(2, 1)
    cluster = LocalCluster(workers=workers, log_to_driver=False).start()
    try:
        print(json.dumps({"address": cluster.address}), file=answers, flush=True)
        for line in sys.stdin:
            if line.strip() == "add-worker":
                print(json.dumps({"node_id": cluster.add_worker().node_id}), file=answers, flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
