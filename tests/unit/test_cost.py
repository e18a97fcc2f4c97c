"""router.cost against numbers worked out by hand in this file, and the design notes' monotonic facts.

Every expected value is written as arithmetic on literals (the specs' numbers from DESIGN.md), never by calling
router.cost, so a wrong formula in cost.py fails here.
"""

from __future__ import annotations

import math

import pytest

from configs import GpuProfile, LinearStateSpec, ModelSpec, TierSpec
from router import cost

# The specs, written out here (not loaded), exactly as DESIGN.md / issue 2 give them.
QWEN3_14B = ModelSpec(name="qwen3-14b", params=14e9, layers=40, full_attention_layers=40, n_q=40, n_kv=8,
                      head_dim=128, dtype="bf16")
QWEN35_27B = ModelSpec(
    name="qwen3.5-27b", params=27e9, layers=64, full_attention_layers=16, linear_attention_layers=48, n_q=24,
    n_kv=4, head_dim=256, dtype="bf16",
    linear_state=LinearStateSpec(num_key_heads=16, num_value_heads=48, key_head_dim=128, value_head_dim=128,
                                 conv_kernel=4),
)
A100 = GpuProfile(name="a100", bf16_tflops=312, hbm_gbps=2039, hbm_gib=80)
H100 = GpuProfile(name="h100", bf16_tflops=989, hbm_gbps=3350, hbm_gib=80)
H200 = GpuProfile(name="h200", bf16_tflops=989, hbm_gbps=4800, hbm_gib=141)
B100 = GpuProfile(name="b100", bf16_tflops=1750, hbm_gbps=8000, hbm_gib=192)
B200 = GpuProfile(name="b200", bf16_tflops=2250, hbm_gbps=8000, hbm_gib=192)
HBM = TierSpec(name="hbm", bandwidth_gbps=4078)
DRAM = TierSpec(name="cpu-dram", bandwidth_gbps=120)
RDMA = TierSpec(name="rdma-pool", bandwidth_gbps=50)
SSD = TierSpec(name="local-ssd", bandwidth_gbps=10)
REMOTE = TierSpec(name="remote-block", bandwidth_gbps=0.35)

# Hand arithmetic shared by several tests.
KV_14B = 2 * 8 * 128 * 40 * 2  # 163,840 bytes per token
KV_27B = 2 * 4 * 256 * 16 * 2  # 65,536 (only the 16 full-attention layers)
# Gated delta net state per linear layer: fp32 recurrent 48·128·128·4 + bf16 conv tail 3·(2·16·128 + 48·128)·2.
STATE_27B = 48 * (48 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 48 * 128) * 2)  # 153,944,064 bytes
F_H100 = 0.4 * 989e12  # 3.956e14 FLOP/s sustained
B_REMOTE = 0.7 * 0.35e9  # 2.45e8 B/s sustained


def test_kv_bytes_per_token_counts_only_full_attention_layers() -> None:
    assert cost.kv_bytes_per_token(QWEN3_14B) == 163_840 == KV_14B
    assert cost.kv_bytes_per_token(QWEN35_27B) == 65_536 == KV_27B
    fp8 = QWEN3_14B.model_copy(update={"dtype": "fp8"})
    assert cost.kv_bytes_per_token(fp8) == 81_920


def test_linear_state_bytes_derived_and_given() -> None:
    assert QWEN35_27B.linear_state_bytes() == 153_944_064 == STATE_27B
    assert QWEN3_14B.linear_state_bytes() == 0
    given = QWEN35_27B.model_copy(update={"linear_state_bytes_per_seq": 1000})
    assert given.linear_state_bytes() == 1000


def test_prefill_flops_dense() -> None:
    # 2·s·N + 4·s²·n_q·d·L = 2·1000·14e9 + 4·1000²·40·128·40
    assert cost.prefill_flops(QWEN3_14B, 1000) == pytest.approx(2.8e13 + 8.192e11, rel=1e-12)
    assert cost.prefill_flops(QWEN3_14B, 1000) == pytest.approx(2.88192e13, rel=1e-12)
    assert cost.prefill_flops(QWEN3_14B, 0) == 0


def test_prefill_flops_with_cached_prefix() -> None:
    # positions [400, 1000): 2·600·14e9 + 4·(1000² − 400²)·204,800
    expected = 2 * 600 * 14e9 + 4 * (1_000_000 - 160_000) * (40 * 128 * 40)
    assert expected == pytest.approx(1.68e13 + 6.88128e11) == pytest.approx(1.7488128e13)
    assert cost.prefill_flops(QWEN3_14B, 1000, cached_tokens=400) == pytest.approx(expected, rel=1e-12)


def test_hybrid_prefill_quadratic_term_counts_only_full_attention_layers() -> None:
    # 2·1000·27e9 + 4·1000²·24·256·16 (16 full-attention layers, not 64)
    only_full = 5.4e13 + 3.93216e11
    all_layers = 5.4e13 + 4 * 1000**2 * 24 * 256 * 64
    got = cost.prefill_flops(QWEN35_27B, 1000)
    assert got == pytest.approx(only_full, rel=1e-12)
    assert got != pytest.approx(all_layers, rel=1e-6)


def test_t_prefill_hand_value() -> None:
    assert cost.t_prefill(QWEN3_14B, H100, 1000, mfu=0.4) == pytest.approx(2.88192e13 / 3.956e14, rel=1e-12)
    # two GPUs halve it
    assert cost.t_prefill(QWEN3_14B, H100, 1000, mfu=0.4, gpus=2) == pytest.approx(2.88192e13 / 7.912e14, rel=1e-12)


def test_t_fetch_hand_value_and_latency() -> None:
    assert cost.t_fetch(QWEN3_14B, REMOTE, 1000, bw_util=0.7) == pytest.approx(163_840_000 / 2.45e8, rel=1e-12)
    assert cost.t_fetch(QWEN3_14B, REMOTE, 1000, bw_util=0.7, latency_s=0.01) == pytest.approx(
        0.01 + 163_840_000 / 2.45e8, rel=1e-12)
    slow = REMOTE.model_copy(update={"latency_s": 0.002})
    assert cost.t_fetch(QWEN3_14B, slow, 1000, bw_util=0.7) == pytest.approx(0.002 + 163_840_000 / 2.45e8)
    assert cost.t_fetch(QWEN3_14B, slow, 0, bw_util=0.7) == 0.0  # nothing to fetch, no latency


def test_hybrid_fetch_moves_kv_plus_one_state_snapshot() -> None:
    assert cost.fetch_bytes(QWEN35_27B, 1000) == 65_536_000 + 153_944_064 == 219_480_064
    assert cost.t_fetch(QWEN35_27B, SSD, 1000, bw_util=0.7) == pytest.approx(219_480_064 / 7e9, rel=1e-12)
    assert cost.fetch_bytes(QWEN35_27B, 0) == 0


def test_breakeven_issue_example() -> None:
    # (0.4·989e12)/(0.7·0.35e9)·8/40 − 14e9/(2·40·128·40)
    ratio = 395.6e12 / 0.245e9  # 1,614,693.877...
    expected = ratio * 8 / 40 - 14e9 / 409_600  # 322,938.78 − 34,179.6875
    assert expected == pytest.approx(288_759.088, abs=0.01)
    got = cost.breakeven_tokens(QWEN3_14B, H100, REMOTE, mfu=0.4, bw_util=0.7)
    assert got == pytest.approx(expected, rel=1e-12)


def test_breakeven_is_where_fetch_equals_prefill() -> None:
    s = cost.breakeven_tokens(QWEN3_14B, H100, REMOTE, mfu=0.4, bw_util=0.7)
    tp = cost.t_prefill(QWEN3_14B, H100, s, mfu=0.4)
    tf = cost.t_fetch(QWEN3_14B, REMOTE, s, bw_util=0.7)
    assert tp == pytest.approx(tf, rel=1e-9)
    # recompute wins below, fetch wins above
    assert cost.t_prefill(QWEN3_14B, H100, 0.9 * s, mfu=0.4) < cost.t_fetch(QWEN3_14B, REMOTE, 0.9 * s, bw_util=0.7)
    assert cost.t_prefill(QWEN3_14B, H100, 1.1 * s, mfu=0.4) > cost.t_fetch(QWEN3_14B, REMOTE, 1.1 * s, bw_util=0.7)


def test_breakeven_hybrid_and_unclamped_negative() -> None:
    # qwen3.5-27b: (395.6e12/0.245e9)·4/24 − 27e9/(2·24·256·16)
    expected = 395.6e12 / 0.245e9 * 4 / 24 - 27e9 / 196_608
    assert cost.breakeven_tokens(QWEN35_27B, H100, REMOTE, mfu=0.4, bw_util=0.7) == pytest.approx(expected)
    # local SSD: (395.6e12/7e9)·0.2 − 34,179.6875 = 11,302.86 − 34,179.69 < 0, returned unclamped
    ssd = 395.6e12 / 7e9 * 0.2 - 34_179.6875
    assert ssd == pytest.approx(-22_876.83, abs=0.01)
    assert cost.breakeven_tokens(QWEN3_14B, H100, SSD, mfu=0.4, bw_util=0.7) == pytest.approx(ssd)


def test_breakeven_gpus_multiply_flops() -> None:
    two = cost.breakeven_tokens(QWEN3_14B, H100, REMOTE, mfu=0.4, bw_util=0.7, gpus=2)
    assert two == pytest.approx(2 * 395.6e12 / 0.245e9 * 0.2 - 34_179.6875)


def test_stronger_gpu_pushes_breakeven_right() -> None:
    s = [cost.breakeven_tokens(QWEN3_14B, g, REMOTE, mfu=0.4, bw_util=0.7) for g in (A100, H100, B100, B200)]
    assert s == sorted(s) and len(set(s)) == 4
    # same FLOPS, more HBM bandwidth: the closed form does not care
    assert cost.breakeven_tokens(QWEN3_14B, H200, REMOTE, mfu=0.4, bw_util=0.7) == s[1]
    # higher MFU is a stronger GPU too
    assert cost.breakeven_tokens(QWEN3_14B, H100, REMOTE, mfu=0.6, bw_util=0.7) > s[1]


@pytest.mark.parametrize("model", [QWEN3_14B, QWEN35_27B])
def test_faster_tier_pushes_breakeven_left(model: ModelSpec) -> None:
    s = [cost.breakeven_tokens(model, H100, t, mfu=0.4, bw_util=0.7) for t in (REMOTE, SSD, RDMA, DRAM, HBM)]
    assert all(a > b for a, b in zip(s, s[1:]))
    assert cost.breakeven_tokens(model, H100, REMOTE, mfu=0.4, bw_util=0.9) < s[0]  # better utilisation too


def test_smaller_kv_to_q_ratio_pushes_breakeven_left() -> None:
    s = [
        cost.breakeven_tokens(QWEN3_14B.model_copy(update={"n_kv": n_kv}), H100, REMOTE, mfu=0.4, bw_util=0.7)
        for n_kv in (40, 8, 4, 2)
    ]
    assert all(a > b for a, b in zip(s, s[1:]))
    # n_kv 4: 1,614,693.88·4/40 − 34,179.6875
    assert s[2] == pytest.approx(395.6e12 / 0.245e9 * 0.1 - 34_179.6875)


def test_hbm_capacity_hand_values() -> None:
    # 141 GiB / 163,840 B/token
    assert cost.hbm_kv_capacity_tokens(QWEN3_14B, H200) == pytest.approx(141 * 2**30 / 163_840)
    assert cost.hbm_kv_capacity_tokens(QWEN3_14B, H200) == pytest.approx(924_057.6)
    assert cost.hbm_kv_capacity_tokens(QWEN3_14B, H200, kv_budget_gib=40) == pytest.approx(262_144)
    assert cost.hbm_kv_capacity_tokens(QWEN35_27B, H200) == pytest.approx(141 * 2**30 / 65_536)
    assert cost.kv_gib_per_tokens(QWEN3_14B) == pytest.approx(10_000 * 163_840 / 2**30)
    assert cost.kv_gib_per_tokens(QWEN3_14B) == pytest.approx(1.52587890625)


def _hw(model: ModelSpec = QWEN3_14B) -> cost.Hardware:
    return cost.Hardware(model=model, gpu=H100, mfu=0.4, bw_util=0.7)


def test_ttft_hand_values() -> None:
    # queue 0.5 + fetch 1000 tokens from remote + prefill positions [1000, 2000)
    prefill = (2 * 1000 * 14e9 + 4 * (2000**2 - 1000**2) * 204_800) / F_H100
    fetch = 1000 * KV_14B / B_REMOTE
    got = cost.ttft(_hw(), prompt_tokens=2000, cached_tokens=1000, tier=REMOTE, queue_delay_s=0.5)
    assert got == pytest.approx(0.5 + fetch + prefill, rel=1e-12)
    # transfer latency adds once
    lat = cost.ttft(_hw(), prompt_tokens=2000, cached_tokens=1000, tier=REMOTE, transfer_latency_s=0.25)
    assert lat == pytest.approx(0.25 + fetch + prefill, rel=1e-12)
    # HBM hit (tier None): only the suffix is computed
    assert cost.ttft(_hw(), prompt_tokens=2000, cached_tokens=1000) == pytest.approx(prefill, rel=1e-12)
    # nothing cached: full prefill
    full = (2 * 2000 * 14e9 + 4 * 2000**2 * 204_800) / F_H100
    assert cost.ttft(_hw(), prompt_tokens=2000, tier=REMOTE) == pytest.approx(full, rel=1e-12)
    # cached longer than the prompt is clamped: the whole prompt is fetched, nothing computed
    assert cost.ttft(_hw(), prompt_tokens=500, cached_tokens=900, tier=REMOTE) == pytest.approx(500 * KV_14B / B_REMOTE)


def test_ttft_split_meets_in_the_middle_and_beats_both() -> None:
    hw = _hw()
    cached, prompt = 10_000, 12_000
    # Head h computed while the tail (cached − h) is fetched: solve t_prefill(h) = t_fetch(cached − h) by hand.
    # (2·N·h + 4·h²·204,800)/F = (cached − h)·KV/B  →  a·h² + b·h + c = 0
    a = 4 * 204_800 / F_H100
    b = 2 * 14e9 / F_H100 + KV_14B / B_REMOTE
    c = -cached * KV_14B / B_REMOTE
    h = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    overlap = (cached - h) * KV_14B / B_REMOTE
    suffix = (2 * 2000 * 14e9 + 4 * (prompt**2 - cached**2) * 204_800) / F_H100
    got, head = cost.ttft_split(hw, prompt_tokens=prompt, cached_tokens=cached, tier=REMOTE, queue_delay_s=0.3)
    assert head == pytest.approx(h, rel=1e-6)
    assert got == pytest.approx(0.3 + overlap + suffix, rel=1e-6)


@pytest.mark.parametrize("tier", [REMOTE, SSD, DRAM, HBM])
@pytest.mark.parametrize("model", [QWEN3_14B, QWEN35_27B])
@pytest.mark.parametrize(("prompt", "cached"), [(2_000, 1_000), (40_000, 32_768), (300_000, 300_000), (100, 0)])
def test_ttft_split_never_worse_than_fetch_all_or_recompute_all(
    tier: TierSpec, model: ModelSpec, prompt: int, cached: int
) -> None:
    hw = _hw(model)
    split, head = cost.ttft_split(hw, prompt_tokens=prompt, cached_tokens=cached, tier=tier, queue_delay_s=0.2)
    fetch_all = cost.ttft(hw, prompt_tokens=prompt, cached_tokens=cached, tier=tier, queue_delay_s=0.2)
    recompute_all = cost.ttft(hw, prompt_tokens=prompt, cached_tokens=0, tier=tier, queue_delay_s=0.2)
    assert 0 <= head <= cached
    assert split <= min(fetch_all, recompute_all) * (1 + 1e-9)
    assert split >= 0.2


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="mfu"):
        cost.t_prefill(QWEN3_14B, H100, 1000, mfu=0)
    with pytest.raises(ValueError, match="mfu"):
        cost.breakeven_tokens(QWEN3_14B, H100, REMOTE, mfu=1.5, bw_util=0.7)
    with pytest.raises(ValueError, match="bw_util"):
        cost.t_fetch(QWEN3_14B, REMOTE, 1000, bw_util=0)
    with pytest.raises(ValueError, match="gpus"):
        cost.breakeven_tokens(QWEN3_14B, H100, REMOTE, mfu=0.4, bw_util=0.7, gpus=0)
    with pytest.raises(ValueError, match="cached_tokens"):
        cost.prefill_flops(QWEN3_14B, 100, cached_tokens=200)
    with pytest.raises(ValueError, match="cached_tokens"):
        cost.prefill_flops(QWEN3_14B, 100, cached_tokens=-1)
    with pytest.raises(ValueError, match="budget"):
        cost.hbm_kv_capacity_tokens(QWEN3_14B, H200, kv_budget_gib=0)
    with pytest.raises(ValueError, match="queue_delay_s"):
        cost.ttft(_hw(), prompt_tokens=100, queue_delay_s=-1)
    linear_only = ModelSpec(name="lin", params=1e9, layers=4, full_attention_layers=0, linear_attention_layers=4,
                            n_q=8, n_kv=2, head_dim=64)
    with pytest.raises(ValueError, match="no full-attention layers"):
        cost.breakeven_tokens(linear_only, H100, REMOTE, mfu=0.4, bw_util=0.7)


def test_shipped_specs_match_the_hand_specs() -> None:
    """The numbers above are the ones the shipped YAML (and so the CLI) use."""
    from configs import load_gpus, load_models, load_tiers

    models, gpus, tiers = load_models(), load_gpus(), load_tiers()
    fields = ("params", "layers", "full_attention_layers", "linear_attention_layers", "n_q", "n_kv", "head_dim",
              "dtype", "linear_state")
    for hand in (QWEN3_14B, QWEN35_27B):
        shipped = models[hand.name]
        assert {f: getattr(shipped, f) for f in fields} == {f: getattr(hand, f) for f in fields}
    for hand, name in ((A100, "a100-sxm4-80gb"), (H100, "h100-sxm5-80gb"), (H200, "h200-sxm5-141gb"),
                       (B100, "b100-sxm-192gb"), (B200, "b200-sxm-192gb")):
        g = gpus[name]
        assert (g.bf16_tflops, g.hbm_gbps, g.hbm_gib) == (hand.bf16_tflops, hand.hbm_gbps, hand.hbm_gib)
    for hand in (HBM, DRAM, RDMA, SSD, REMOTE):
        assert (tiers[hand.name].bandwidth_gbps, tiers[hand.name].latency_s) == (hand.bandwidth_gbps, 0.0)


def test_attn_scale_weighs_only_the_attention_term() -> None:
    """``Hardware.attn_scale``: the attention FLOPs' cost relative to the matrix products' (fitted per replica by
    ``router.calibration.MfuEstimator``); 1 is the FLOP count as is."""
    lin = cost.work_flops(QWEN3_14B, 4096 - 1024, 0.0)
    att = cost.work_flops(QWEN3_14B, 0.0, 4096**2 - 1024**2)
    assert cost.prefill_flops(QWEN3_14B, 4096, 1024) == pytest.approx(lin + att)
    assert cost.prefill_flops(QWEN3_14B, 4096, 1024, 0.25) == pytest.approx(lin + 0.25 * att)
    hw = cost.Hardware(model=QWEN3_14B, gpu=H100, mfu=0.5, bw_util=0.8, attn_scale=0.25)
    assert cost.ttft(hw, prompt_tokens=4096, cached_tokens=1024) == pytest.approx(
        (lin + 0.25 * att) / cost.effective_flops(H100, 0.5))
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="attn_scale"):
            cost.Hardware(model=QWEN3_14B, gpu=H100, mfu=0.5, bw_util=0.8, attn_scale=bad)
