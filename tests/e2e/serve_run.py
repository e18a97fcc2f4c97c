"""``kvstack serve`` as a subprocess for e2e modules: started as a user starts it, torn down with SIGKILL.

``running_serve(tmp, sets, model=None, config=None, env=None)`` is a generator (a module fixture's body): it starts
``python -m cluster.cli serve`` on a free port with ``--set KEY=VALUE`` for each of ``sets`` (an SSD tier of
``SSD_BYTES`` under ``tmp``, removed at teardown, and the tiny dense model — or ``--model MODEL``, or ``--config
FILE`` as written — are set first, and the engine's ``dtype`` is ``DTYPE`` unless a config file is given; ``env`` is
added to its environment), waits until it prints that it is serving (at most ``ready_s``; a start that exits or times
out fails the test with the tails of its logs), yields ``{"proc", "base", "state", "log"}`` and kills its process
group after. ``get_status`` / ``wait_for_status`` read such a server's ``/kvstack/status`` (polled with a deadline);
``hbm_blocks`` / ``pool_blocks`` read a status; ``assert_fetched_as_before`` asks a prompt again after an HBM reset
and checks it came back from the pool unchanged.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.local_cluster import free_port

REPO = Path(__file__).resolve().parents[2]
# The e2e servers' engines compute in float32: on CPUs without bfloat16 instructions (these CI machines) a bfloat16
# engine runs ~3.6x slower (8 prefills of 1,500 tokens + 16 decode steps of the tiny model: 21.1 s vs 5.9 s), and
# their outputs are judged against plain vLLM on the same settings either way (``test_serve_local``'s oracle).
DTYPE = "float32"
# The SSD tier of a test server: 64 MiB per shard, not the embedded config's 1 GiB. Slabs are preallocated
# (``posix_fallocate``), and each server's slab directory is removed when it is torn down.
SSD_BYTES = 64 << 20


def ssd_sets(ssd_dir: Path) -> list[str]:
    """The ``--set`` items that put a test server's SSD tier in ``ssd_dir`` at ``SSD_BYTES`` per shard."""
    return ["--set", f"app.pool.ssd_dir={ssd_dir}", "--set", f"app.pool.ssd_bytes={SSD_BYTES}"]


def remove_ssd_dir(ssd_dir: Path) -> None:
    """Delete a torn-down test server's SSD slabs (best effort: a shard killed mid-write may leave nothing)."""
    shutil.rmtree(ssd_dir, ignore_errors=True)


def running_serve(tmp: Path, sets: list[str], ready_s: float = 480.0, model: Path | None = None,
                  config: Path | None = None, env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    port = free_port()
    state = tmp / "serve.json"
    log_path = tmp / "serve.log"
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--state-file", str(state),
           *ssd_sets(tmp / "ssd"),
           "--log-dir", str(tmp / "logs")]  # Ray's and vLLM's logs; serve.log holds kvstack's own lines
    # ``model``: `kvstack serve --model DIR` (a model of the user's); ``config``: `--config FILE` as written; else
    # the embedded config's tiny model
    if config is not None:
        cmd += ["--config", str(config)]
    else:
        cmd += ["--model", str(model)] if model is not None else [
            "--set", f"app.engine.model={REPO / '.kvstack/models/tiny-qwen3'}"]
        cmd += ["--set", f"app.engine.dtype={DTYPE}"]
    for item in sets:
        cmd += ["--set", item]
    log = open(log_path, "w")
    # As a user starts it: none of the vLLM variables earlier tests set in this process (in-process engines turn
    # V1 multiprocessing off here, which once made every replica of this server run in-process and unbound).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}, **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ready_s

    def tails() -> str:
        logs = [log_path, *sorted((tmp / "logs").glob("*.log"))]
        return "\n".join(f"--- {p.name}:\n{p.read_text()[-4000:]}" for p in logs if p.exists())

    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"kvstack serve exited {proc.returncode}:\n{tails()}")
            if "is serving" in log_path.read_text():
                break
            time.sleep(1)
        else:
            pytest.fail(f"kvstack serve not ready within {ready_s:.0f} s:\n{tails()}")
        yield {"proc": proc, "base": f"http://127.0.0.1:{port}/v1", "state": state, "log": log_path}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        remove_ssd_dir(tmp / "ssd")


def get_status(server) -> dict[str, Any]:
    """``server["status_headers"]``: what ``/kvstack/*`` needs of it (the admin key), if anything."""
    return httpx.get(server["base"][:-3] + "/kvstack/status", headers=server.get("status_headers"), timeout=60).json()


def wait_for_status(server, holds: Callable[[dict[str, Any]], bool], what: str, *, answers: int = 1,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll ``/kvstack/status`` until ``holds(status)`` is true on ``answers`` answers in a row; fail after
    ``timeout_s`` with the last answer. Shard rows are read from the shards themselves (one answer is enough);
    replica rows are the answering router's own view, and an answer does not say which of the two routers gave it:
    for those, ``answers=6`` in a row makes it all but certain that both routers have it (each answer comes from
    either router, about evenly)."""
    deadline = time.monotonic() + timeout_s
    in_a_row = 0
    while True:
        st = get_status(server)
        in_a_row = in_a_row + 1 if holds(st) else 0
        if in_a_row >= answers:
            return st
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what}; last status: replicas {st['replicas']}, "
                        f"shards {st['shards']}")
        time.sleep(0.2)


def assert_fetched_as_before(client: Any, model: str, messages: list[dict[str, str]], first: Any) -> None:
    """Ask ``messages`` again (greedy, 8 tokens) once every replica's HBM was emptied and the pool holds the prompt:
    the router decides FETCH, the prefix comes back from the pool (128 cached tokens or more) and the answer equals
    ``first``'s (the same request's completion before the reset)."""
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=8,
                                                           temperature=0)
    again = raw.parse()
    assert raw.headers["x-kvstack-action"] == "fetch"
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 128


def hbm_blocks(st: dict[str, Any]) -> dict[str, int]:
    """Per replica, the HBM blocks the answering router believes it holds (from the replica's reports)."""
    return {r["replica_id"]: r["hbm_blocks"] for r in st["replicas"]}


def pool_blocks(st: dict[str, Any], node_id: str | None = None) -> int:
    """Committed blocks in the pool's shards (all, or the one on ``node_id``)."""
    return sum(s["dram_blocks"] + s["ssd_blocks"] for s in st["shards"] if node_id in (None, s["node_id"]))
