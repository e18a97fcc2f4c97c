"""E2E: Serve autoscaling of the replicas on a local ``kvstack serve``: one replica to start, load (concurrent long
streams, more ongoing requests than ``target_ongoing_requests``) raises the count to two within a bounded time, and
the new replica serves — its engine started, bound to cores of its own, with the pool (under concurrent load the
router routes to it; one request at a time may all go to the replica it prices faster).
``app.replicas.autoscaling_config`` passes Ray Serve's own keys (``look_back_period_s``, ``metrics_interval_s``)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.e2e.serve_run import running_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-qwen3"
SCALE_UP_S = 300.0
AUTOSCALING = ("{min_replicas: 1, max_replicas: 2, target_ongoing_requests: 1, upscale_delay_s: 1, "
               "downscale_delay_s: 3600, metrics_interval_s: 0.5, look_back_period_s: 2}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from running_serve(tmp_path_factory.mktemp("serve-autoscale"), [
        "app.replicas.num_replicas=null", f"app.replicas.autoscaling_config={AUTOSCALING}"])


def replica_ids(server) -> list[str]:
    status = httpx.get(server["base"][:-3] + "/kvstack/status", timeout=60).json()
    return sorted(r["replica_id"] for r in status["replicas"])


def test_load_raises_the_replicas_and_the_new_one_serves(server) -> None:
    import openai

    client = openai.OpenAI(base_url=server["base"], api_key="unused", timeout=300, max_retries=0)
    first = replica_ids(server)
    assert len(first) == 1, first

    def stream(i: int) -> int:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell a long story number {i}."}],
            max_tokens=256, temperature=0, stream=True, extra_body={"ignore_eos": True})
        return sum(1 for _ in chunks)

    deadline = time.monotonic() + SCALE_UP_S
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while len(replica_ids(server)) < 2:
            assert time.monotonic() < deadline, f"still {replica_ids(server)} after {SCALE_UP_S:.0f} s of load"
            list(pool.map(stream, range(4)))  # 4 ongoing requests against a target of 1 per replica
    new = set(replica_ids(server)) - set(first)
    assert len(new) == 1
    ran_on: set[str] = set()

    def ask(i: int) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"Hello {i} {time.monotonic()}"}],
            max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == 32
        return raw.headers["x-kvstack-replica"]

    # under load (4 at once: queues to weigh), the router sends work to the new replica too
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while not new & ran_on:
            assert time.monotonic() < deadline + 180, f"no request ran on {new}: ran on {ran_on}"
            ran_on.update(pool.map(ask, range(4)))
