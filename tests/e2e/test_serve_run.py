"""E2E: the app on a Ray cluster it did not start — ``serve run`` of the file ``kvstack serve-config`` writes, on a
local multi-node cluster run by a process of its own (``tests.e2e.cluster_process``), as an operator's or KubeRay's
cluster is. The pool comes with the app (``deployments.pool_keeper``): a shard on every worker node, a FETCH from it
after the replicas' HBM was reset, and a worker node added afterwards gets its shard. Driven with the ``openai`` SDK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.local_cluster import free_port
from tests.e2e.cluster_process import running_cluster
from tests.e2e.serve_run import assert_fetched_as_before, remove_ssd_dir, ssd_sets

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"
READY_S = 480.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from running_cluster(tmp_path_factory.mktemp("serve-run-cluster"), workers=2)


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("serve-run")
    port = free_port()
    config = tmp / "kvstack-serve.yaml"
    subprocess.run([sys.executable, "-m", "cluster.cli", "serve-config", "--port", str(port),
                    "--set", f"app.engine.model={REPO / '.kvstack/models/tiny-qwen3'}",
                    *ssd_sets(tmp / "ssd"), "--out", str(config)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    log = open(tmp / "serve-run.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", str(config),
                             "--address", cluster.address], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve run exited {proc.returncode}:\n{(tmp / 'serve-run.log').read_text()[-6000:]}")
            try:
                if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve run not serving within {READY_S:.0f} s:\n"
                            f"{(tmp / 'serve-run.log').read_text()[-6000:]}")
            time.sleep(2)
        served = {"base": base, "proc": proc}
        wait_for(served, lambda st: len(st["replicas"]) == 2, "both replicas reporting to the router", 300.0)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # serve run deletes the app on Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        remove_ssd_dir(tmp / "ssd")


def status(served) -> dict[str, Any]:
    return httpx.get(served["base"] + "/kvstack/status", timeout=60).json()


def wait_for(served, holds, what: str, timeout_s: float = 90.0, answers: int = 1) -> dict[str, Any]:
    """``answers``: in a row. A replica row is the answering router's view, which a replica's late report can still
    change (with several routers, either answers: ``tests.e2e.serve_run.wait_for_status``)."""
    deadline = time.monotonic() + timeout_s
    in_a_row = 0
    while True:
        st = status(served)
        in_a_row = in_a_row + 1 if holds(st) else 0
        if in_a_row >= answers:
            return st
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}; last status: {st}")
        time.sleep(1.0 if not in_a_row else 0.2)


def worker_ids(st: dict[str, Any]) -> set[str]:
    return {n["node_id"] for n in st["nodes"] if n["cpus"] > 0}


def test_chat_works_and_every_worker_node_has_a_shard(served) -> None:
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    st = wait_for(served, lambda st: {s["node_id"] for s in st["shards"]} >= worker_ids(st) and st["pool_keeper"]
                  and st["pool_keeper"].get("passes", 0) > 0, "a pool shard on every worker node")
    assert len(worker_ids(st)) == 2 and len(st["shards"]) == 2


def test_a_prefix_is_fetched_from_the_pool_after_an_hbm_reset(served) -> None:
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    system = "You answer briefly. " + " ".join(f"rule {i}: keep value {i * 7} safe." for i in range(110))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which rule is last?"}]
    before = sum(s["dram_blocks"] + s["ssd_blocks"] for s in status(served)["shards"])
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    blocks = first.usage.prompt_tokens // 128
    wait_for(served, lambda st: sum(s["dram_blocks"] + s["ssd_blocks"] for s in st["shards"]) >= before + blocks,
             f"the {blocks} blocks saved in the pool")
    reset = httpx.post(served["base"] + "/kvstack/admin/reset_prefix_cache", timeout=60).json()
    assert len(reset) == 2 and all(r["ok"] for r in reset), reset
    wait_for(served, lambda st: all(r["hbm_blocks"] == 0 for r in st["replicas"]), "the router saw the HBM reset",
             answers=6)
    assert_fetched_as_before(client, MODEL, messages, first)


def test_a_worker_node_added_later_gets_a_shard(served, cluster) -> None:
    node_id = cluster.add_worker()
    st = wait_for(served, lambda st: node_id in {s["node_id"] for s in st["shards"]},
                  f"a shard on the new node {node_id[:12]}", timeout_s=120.0)
    assert node_id in worker_ids(st) and len(st["shards"]) == 3
