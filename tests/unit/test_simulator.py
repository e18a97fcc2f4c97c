"""bench.simulate: the cluster simulator running the real router.policies code.

The reuse bound used here is computed independently of ``bench.traces.prefix_reuse_bound``: a set of hash-id
prefixes (tuples) seen so far, token-weighted, the last block partial.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.agent import AgentWorkload, plan_sessions, workload_trace
from bench.sim_cache import BlockCache, BlockHolders
from bench.simulate import SimConfig, SimResult, simulate
from bench.traces import TraceRecord, load_trace
from cluster.cli import main as kvstack_main
from configs.loader import load_gpus, load_models, load_tiers
from router.cost import Hardware
from router.policies.pricing import TierMap

REPO = Path(__file__).resolve().parents[2]
CONVERSATION = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.exists(), reason=f"Mooncake trace not found at {CONVERSATION}")

HW = Hardware(load_models()["qwen3-14b"], load_gpus()["h100-sxm5-80gb"], mfu=0.5, bw_util=0.8)
TIERS = TierMap.from_tiers(load_tiers())
POLICIES = ["round_robin", "least_loaded", "prefix_affinity", "cost_based", "always_fetch"]


def independent_bound(records: list[TraceRecord]) -> float:
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in records:
        n = len(r.hash_ids)
        total += r.input_length
        for i in range(n):
            if tuple(r.hash_ids[: i + 1]) not in seen:
                break
            hit += r.block_tokens if i < n - 1 else r.input_length - (n - 1) * r.block_tokens
        for i in range(n):
            seen.add(tuple(r.hash_ids[: i + 1]))
    return hit / total


def agent_records(sessions: int = 60, seed: int = 3) -> list[TraceRecord]:
    w = AgentWorkload(session_rate_per_s=2.0, system_prompt_words=2000, tool_result_words=700, seed=seed,
                      turns_min=3, turns_max=8)
    return workload_trace(w, plan_sessions(w, max_sessions=sessions), response_time_s=0.5)


def run(records: list[TraceRecord], policy: str, **kw: object) -> SimResult:
    return simulate(records, SimConfig(policy=policy, hw=HW, tier_map=TIERS, **kw))  # type: ignore[arg-type]


def comparable(result: SimResult) -> dict[str, object]:
    j = result.to_json()
    for key in ("wall_s", "decision_latency_us"):
        j.pop(key)
    return j


# ------------------------------------------------------------------------------------------------ the bound
@pytest.mark.parametrize("policy", POLICIES)
def test_unbounded_single_replica_reproduces_reuse_bound_agent(policy: str) -> None:
    recs = agent_records()
    bound = independent_bound(recs)
    assert 0.3 < bound < 1.0
    res = run(recs, policy, nodes=1, hbm_tokens=math.inf)
    assert res.token_hit_rate == pytest.approx(bound, abs=1e-12)
    assert res.hit_rate_by_tier()["hbm"] == pytest.approx(bound, abs=1e-12)


@needs_trace
def test_unbounded_caches_reproduce_conversation_trace_bound() -> None:
    recs = load_trace(CONVERSATION, max_requests=3000)
    bound = independent_bound(recs)
    res = run(recs, "prefix_affinity", nodes=1, hbm_tokens=math.inf)
    assert res.token_hit_rate == pytest.approx(bound, abs=1e-12)
    # several nodes: no placement can beat the bound, and a global unbounded pool comes close to it
    for policy in POLICIES:
        r = run(recs, policy, nodes=4, hbm_tokens=math.inf, pool_dram_tokens=math.inf)
        assert r.token_hit_rate <= bound + 1e-12, policy


def test_bounded_caches_never_beat_the_bound() -> None:
    recs = agent_records()
    bound = independent_bound(recs)
    for policy in POLICIES:
        r = run(recs, policy, nodes=4, hbm_tokens=20_000, pool_dram_tokens=50_000, pool_ssd_tokens=50_000)
        assert 0.0 <= r.token_hit_rate <= bound + 1e-12, policy
        assert sum(r.decisions.values()) == len(recs)


# --------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("policy", ["least_loaded", "cost_based"])
def test_deterministic_for_a_seed(policy: str) -> None:
    recs = agent_records()
    kw = dict(nodes=6, hbm_tokens=30_000, pool_dram_tokens=60_000, seed=11)
    a, b = run(recs, policy, **kw), run(recs, policy, **kw)
    assert json.dumps(comparable(a), sort_keys=True) == json.dumps(comparable(b), sort_keys=True)
    assert (a.ttft_s == b.ttft_s).all()


def test_seed_changes_randomised_policy() -> None:
    recs = agent_records()
    a = run(recs, "least_loaded", nodes=6, hbm_tokens=30_000, seed=1)
    b = run(recs, "least_loaded", nodes=6, hbm_tokens=30_000, seed=2)
    assert a.per_replica_requests != b.per_replica_requests


# ------------------------------------------------------------------------------------ policies differ sensibly
def test_policies_differ_sensibly() -> None:
    recs = agent_records(sessions=120)
    kw = dict(nodes=8, hbm_tokens=60_000, pool_dram_tokens=200_000, seed=5)
    res = {p: run(recs, p, **kw) for p in POLICIES}
    rr, ll, pa, cb, af = (res[p] for p in POLICIES)
    # prefix-aware policies reuse more than prefix-blind ones
    assert pa.hit_rate_by_tier()["hbm"] > rr.hit_rate_by_tier()["hbm"]
    assert cb.token_hit_rate > rr.token_hit_rate
    assert cb.token_hit_rate > ll.token_hit_rate
    # pool-blind policies never plan a fetch (their replicas' connectors still load the pool's longer prefixes, as
    # the live connector does; without that, they never read the pool); always_fetch plans one whenever the pool
    # has more than HBM
    for r in (rr, ll, pa):
        assert "fetch" not in r.decisions and "split" not in r.decisions
    assert rr.hit_rate_by_tier()["dram"] > 0.0 and ll.hit_rate_by_tier()["dram"] > 0.0
    assert run(recs, "round_robin", connector_fetch=False, **kw).hit_rate_by_tier()["dram"] == 0.0
    assert af.decisions.get("fetch", 0) > 0 and af.hit_rate_by_tier()["dram"] > 0
    # the cost model pays off: less prefill work and a lower median TTFT than round robin
    assert cb.prefill_gpu_s < rr.prefill_gpu_s
    assert cb.to_json()["ttft_p50_s"] < rr.to_json()["ttft_p50_s"]
    # round robin spreads requests exactly; prefix affinity concentrates them
    assert rr.to_json()["replica_load_cv"] < 0.1 < pa.to_json()["replica_load_cv"]


def test_ssd_tier_is_used_when_dram_is_small() -> None:
    recs = agent_records(sessions=120)
    r = run(recs, "always_fetch", nodes=4, hbm_tokens=0, pool_dram_tokens=5_000, pool_ssd_tokens=math.inf)
    tiers = r.hit_rate_by_tier()
    assert tiers["ssd"] > 0 and tiers["hbm"] == 0
    assert r.to_json()["evicted_tokens"]["dram"] > 0


def test_prefill_time_falls_with_hits() -> None:
    recs = agent_records()
    cold = run(recs, "round_robin", nodes=2, hbm_tokens=0)
    warm = run(recs, "round_robin", nodes=2, hbm_tokens=math.inf)
    assert cold.token_hit_rate == 0.0
    assert warm.prefill_gpu_s < cold.prefill_gpu_s
    assert warm.to_json()["ttft_p50_s"] <= cold.to_json()["ttft_p50_s"]


# ------------------------------------------------------------------------------------------------ caches
def test_block_cache_lru_evicts_tails_first_and_spills() -> None:
    index = BlockHolders()
    ssd = BlockCache(2, 1000, index)
    dram = BlockCache(1, 300, index, spill=ssd)
    dram.admit([10, 11, 12], [100, 100, 100])
    dram.admit([20, 21], [100, 100])  # evicts the LRU blocks: the tail of the first prefix goes first
    assert 10 in dram and 11 not in dram and 12 not in dram
    assert 20 in dram and 21 in dram and dram.used_tokens == 300
    assert 11 in ssd and 12 in ssd and dram.evicted_tokens == 200
    # DRAM holds the head; SSD lacks block 10, so it holds no prefix of this request
    assert index.prefix_blocks([10, 11, 12]) == {1: 1}
    assert index.prefix_blocks([20, 21, 22]) == {1: 2}


def test_block_cache_zero_and_unbounded() -> None:
    index = BlockHolders()
    off = BlockCache(0, 0, index)
    off.admit([1, 2], [5, 5])
    assert len(off) == 0
    inf = BlockCache(1, math.inf, index)
    inf.admit(list(range(10_000)), [512] * 10_000)
    assert len(inf) == 10_000 and inf.evicted_tokens == 0
    assert index.prefix_blocks(list(range(10_000)) + [99_999]) == {1: 10_000}
    with pytest.raises(ValueError):
        BlockCache(2, -1, index)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="nodes"):
        SimConfig(nodes=0, policy="round_robin", hw=HW, tier_map=TIERS)
    with pytest.raises(ValueError, match="hbm_tokens"):
        SimConfig(nodes=1, policy="round_robin", hw=HW, tier_map=TIERS, hbm_tokens=-5)
    with pytest.raises(ValueError, match="unknown policy"):
        run(agent_records(sessions=2), "no_such_policy", nodes=1)


# ---------------------------------------------------------------------------------------------------- CLI
def test_simulate_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [r for r in agent_records(sessions=20)]
    trace = tmp_path / "agent.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
            for r in rows
        )
    )
    out = tmp_path / "res.json"
    rc = kvstack_main(["simulate", "--trace", str(trace), "--nodes", "3", "--policy", "cost_based",
                       "--hbm-tokens", "20k", "--pool-tokens", "1M", "--json", "--out", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    for key in ("token_hit_rate", "hit_rate_by_tier", "ttft_p50_s", "ttft_p99_s", "prefill_gpu_s", "decisions", "wall_s"):
        assert key in printed
    assert 0.0 <= printed["token_hit_rate"] <= 1.0
    assert printed["requests"] == len(rows) == sum(printed["decisions"].values())
    assert printed["config"]["hbm_tokens"] == 20_000 and printed["config"]["pool_dram_tokens"] == 1_000_000
    # the agent workload as the simulator's input
    rc = kvstack_main(["simulate", "--agent-sessions", "10", "--nodes", "2", "--policy", "round_robin", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["requests"] > 10
    # bad names are usage errors
    assert kvstack_main(["simulate", "--trace", str(trace), "--policy", "nope", "--json"]) == 2


@needs_trace
def test_hbm_hits_touching_the_pool_keep_hot_prefixes_there() -> None:
    """A prefix served from HBM is never leased: without refreshing its pool copy it ages out of the pool while
    it is hot, and the next replica that needs it recomputes (measured on the conversation trace: the pool's DRAM
    hit rate more than doubles with the touch)."""
    recs = load_trace(CONVERSATION)[:4000]
    kw = dict(nodes=8, hbm_tokens=300_000, pool_dram_tokens=1_000_000)
    touched = run(recs, "cost_based", **kw)
    aged = run(recs, "cost_based", pool_touch=False, **kw)
    assert touched.hit_rate_by_tier()["dram"] > 1.3 * aged.hit_rate_by_tier()["dram"]
    assert touched.token_hit_rate > aged.token_hit_rate
    assert touched.to_json()["config"]["pool_touch"] is True
