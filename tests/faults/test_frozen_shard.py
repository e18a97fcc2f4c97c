"""Fault: the pool shard that holds every saved block and receives every save is frozen (SIGSTOP) while requests
with shared prefixes stream through a real vLLM engine (CPU build) with the kvpool connector, on a real local Ray
cluster with real shards and NIXL. ``bench.frozen_shard.freeze_experiment`` runs the phases (healthy, frozen,
thawed), one request at a time (vLLM's CPU kernels are not batch-invariant: a reference computed alone is only
comparable with a request computed alone) — the same code as ``kvstack bench frozen-shard``, which reports the step-time ratio.

Asserted: every request completes; its greedy tokens equal plain vLLM's for the same compute split; no engine
step waited on the frozen shard (the lookup and lease deadlines are 5 s: a step that waited would take that long;
healthy steps take milliseconds); the connector counted the fault (lookups that failed, the breaker opened); and the
pool serves again by itself after SIGCONT (``recovery_s``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.frozen_shard import freeze_experiment, wrong_outputs
from bench.inproc import EngineSpec

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

DEADLINE_S = 5.0
MAX_TOKENS = 8


def test_frozen_shard_never_stalls_the_engine_nor_changes_a_token(pool: Any, engines: Any,
                                                                   tiny_models: dict[str, str]) -> None:
    import ray

    cfg = pool.config(local="a", nodes=("a", "b"), model_id="faults-frozen", lookup_deadline_s=DEADLINE_S,
                      lease_deadline_s=DEADLINE_S, save_deadline_s=DEADLINE_S)
    spec = EngineSpec(model=tiny_models["dense"], max_model_len=2048, prefix_caching=False)  # the pool: only reuse
    llm = engines.get(("frozen", "dense"), spec, cfg)
    pid = ray.get(pool.handles["a"].actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
    result = freeze_experiment(llm, pid, requests=8, in_flight=1, max_tokens=MAX_TOKENS, prefixes=2,
                               prefix_blocks=3, seed=3)
    phases, counters = result["phases"], result["frozen_counters"]
    print({k: v for k, v in result.items() if k != "outputs"})
    assert result["warm_saves_settled"]  # the prefixes were in the pool before the healthy phase asked for them
    assert phases["healthy"]["pool_hit_requests"] > 0  # the pool did serve before the freeze
    assert phases["frozen"]["requests"] == 8
    assert phases["frozen"]["step_s"]["max"] < DEADLINE_S / 2  # no step waited out a pool deadline
    assert phases["frozen"]["request_s"]["max"] < 2 * DEADLINE_S  # no request waited past one lookup deadline
    assert counters["lookup_failures"] > 0 and counters["scheduler_breaker_trips"] > 0
    assert result["recovery_s"] > 0  # the pool served a prefix again after SIGCONT, by itself

    plain = engines.get(("plain", "dense"), EngineSpec(model=tiny_models["dense"], max_model_len=2048))
    assert wrong_outputs(plain, result["outputs"], MAX_TOKENS) == []
    engines.close()
