"""KV-cache admission in the simulator (``bench.sim_kv``, ``SimConfig.kv_admission``): the engine admits a prompt only
when its blocks fit, the replicas report their occupancy as the live ones do, and cost_based prices the wait."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.sim_kv import SimKvCache, hold_of
from bench.simulate import SimConfig, _decode_step_s, simulate
from bench.traces import TraceRecord
from cluster.cli import main as kvstack_main
from configs.loader import load_gpus, load_models, load_tiers
from router.cost import Hardware, t_prefill
from router.policies.pricing import TierMap

HW = Hardware(load_models()["qwen3-14b"], load_gpus()["h100-sxm5-80gb"], mfu=0.5, bw_util=0.8)
TIERS = TierMap.from_tiers(load_tiers())
BS = 512


def test_the_cache_holds_shared_blocks_once_and_admits_first_come_first_served() -> None:
    kv = SimKvCache(4 * BS, BS)
    a = hold_of([1, 2, 3], 3 * BS, BS, "a")  # 3 full blocks
    b = hold_of([1, 2, 9], 2 * BS + 10, BS, "b")  # shares 2 with a, its partial block is a tail of one block
    c = hold_of([5, 6], 2 * BS, BS, "c")
    d = hold_of([7], 10, BS, "d")
    assert (a.blocks, a.tail_tokens) == ((1, 2, 3), 0)
    assert (b.blocks, b.tail_tokens) == ((1, 2), BS)
    for h in (a, b, c, d):
        kv.request(h)
    assert [h.job for h in kv.admit()] == ["a", "b"]  # a: 3 blocks; b: only its tail is new; c (2 more) waits
    assert kv.held_tokens == 4 * BS and kv.waiting == 2  # d would fit, but waits behind c (vLLM's FCFS)
    kv.finish(a, 5.0)
    kv.finish(b, 3.0)
    assert kv.next_end() == 3.0
    assert [h.job for h in kv.release(4.0)] == ["b"]
    assert kv.held_tokens == 3 * BS  # b freed its tail; blocks 1, 2 stay held by a
    assert kv.admit() == []  # c needs 2 blocks, 1 is free
    assert [h.job for h in kv.release(5.0)] == ["a"] and kv.held_tokens == 0
    assert [h.job for h in kv.admit()] == ["c", "d"]
    kv.finish(c, 6.0)
    kv.finish(d, 6.0)
    kv.release(6.0)
    assert not kv.busy() and kv.held_tokens == 0
    kv.request(hold_of(list(range(100, 110)), 10 * BS, BS, "big"))  # larger than the whole cache
    assert [h.job for h in kv.admit()] == ["big"]  # admitted alone rather than never
    assert kv.busy()


def _three_at_once(t: float, output: int) -> list[TraceRecord]:
    """A warm-up request at 0 (it teaches the replica its decode rate), then three prompts of 3 blocks at ``t``."""
    recs = [TraceRecord(0, 0.0, BS, output, (50,), BS)]
    for i in range(3):
        recs.append(TraceRecord(1 + i, t * 1000.0, 3 * BS, output, (10 * i + 1, 10 * i + 2, 10 * i + 3), BS))
    return recs


def test_a_prompt_that_does_not_fit_waits_for_a_decode_end() -> None:
    output = 256
    recs = _three_at_once(10.0, output)
    base = dict(nodes=1, policy="round_robin", hw=HW, tier_map=TIERS, hbm_tokens=7 * BS, engine_sharing="batch")
    off = simulate(recs, SimConfig(**base)).ttft_s  # type: ignore[arg-type]
    on = simulate(recs, SimConfig(**base, kv_admission=True)).ttft_s  # type: ignore[arg-type]
    solo = t_prefill(HW.model, HW.gpu, 3 * BS, mfu=HW.mfu)
    decode = output * _decode_step_s(HW, 3 * BS + output // 2)
    assert off[1:] == pytest.approx([3 * solo] * 3)  # the three share the engine
    # 7 blocks: two prompts of 3 fit, the third waits until the first two end their decode, then runs alone
    assert on[1:] == pytest.approx([2 * solo, 2 * solo, 2 * solo + decode + solo])
    with pytest.raises(ValueError, match="kv_admission needs engine_sharing"):
        SimConfig(nodes=1, policy="round_robin", hw=HW, tier_map=TIERS, kv_admission=True)


def test_cost_based_prices_the_wait_the_replica_reports() -> None:
    recs = _three_at_once(10.0, 256)
    base = dict(nodes=1, policy="cost_based", hw=HW, tier_map=TIERS, hbm_tokens=7 * BS, engine_sharing="batch")
    off = simulate(recs, SimConfig(**base))  # type: ignore[arg-type]
    on = simulate(recs, SimConfig(**base, kv_admission=True))  # type: ignore[arg-type]
    decode = 256 * _decode_step_s(HW, 3 * BS + 128)
    # the third prompt's prediction now includes the wait for the others' decode (the warm-up's rate), and is
    # closer to what happened
    assert on.predicted_ttft_s[3] - off.predicted_ttft_s[3] > 0.5 * decode
    assert abs(on.predicted_ttft_s[3] - on.ttft_s[3]) < 0.5 * abs(off.predicted_ttft_s[3] - on.ttft_s[3])
    assert on.predicted_ttft_s[1] == pytest.approx(off.predicted_ttft_s[1])  # it fit: nothing to wait for


def _prefix_repetition(rate: float, n: int = 72, block_tokens: int = 128) -> list[TraceRecord]:
    """``vllm bench serve``'s prefix_repetition shape: a shared 2,048-token prefix of one of 12, a 128-token suffix
    of its own, 64 output tokens."""
    rng = random.Random(0)
    recs = []
    for i in range(n):
        p = rng.randrange(12)
        ids = tuple(p * 100 + j for j in range(2048 // block_tokens)) + (10**6 + i,)
        recs.append(TraceRecord(i, i * 1000.0 / rate, 2048 + 128, 64, ids, block_tokens))
    return recs


def test_with_kv_admission_cost_based_avoids_the_replicas_short_of_kv() -> None:
    recs = _prefix_repetition(rate=6.0)
    base = dict(nodes=2, hw=HW, tier_map=TIERS, hbm_tokens=6144, pool_dram_tokens=1e6, engine_sharing="batch")
    p99 = {}
    for policy in ("round_robin", "prefix_affinity", "cost_based"):
        on = simulate(recs, SimConfig(**base, policy=policy, kv_admission=True)).to_json()  # type: ignore[arg-type]
        off = simulate(recs, SimConfig(**base, policy=policy)).to_json()  # type: ignore[arg-type]
        assert on["ttft_p99_s"] > off["ttft_p99_s"]  # 48 blocks for prompts of 17: the cache makes them wait
        p99[policy] = on["ttft_p99_s"]
    assert p99["cost_based"] < min(p99["round_robin"], p99["prefix_affinity"])


def test_simulate_cli_takes_the_engine_sharing_and_kv_admission(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                           "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                               for r in _prefix_repetition(rate=6.0, n=24, block_tokens=512)))
    args = ["simulate", "--trace", str(trace), "--nodes", "2", "--hbm-tokens", "6k", "--pool-tokens", "1M",
            "--policy", "cost_based", "--kv-admission", "--json"]
    assert kvstack_main(args) == 2  # needs the batch engine
    assert "kv_admission needs engine_sharing" in capsys.readouterr().err
    assert kvstack_main(args + ["--engine-sharing", "batch"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["kv_admission"] is True and doc["config"]["engine_sharing"] == "batch"
    assert doc["requests"] == 24
