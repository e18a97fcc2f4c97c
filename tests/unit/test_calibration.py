"""Online calibration: MFU per replica and bandwidth/latency per tier class, robust to outliers."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from configs.schema import TierSpec
from router import cost
from router.calibration import Calibrator, MfuEstimator, OnlineLine, OnlinePlane, TierEstimator
from tests.fakes.router import router_hw, router_tier_map


def test_online_line_recovers_a_noisy_line_and_rejects_outliers() -> None:
    rng = random.Random(0)
    line = OnlineLine(halflife=200, min_obs=5)
    for _ in range(400):
        x = rng.uniform(1, 100)
        y = 0.5 + 2.0 * x
        if rng.random() < 0.05:
            y *= 10  # stragglers
        line.observe(x, y * rng.uniform(0.98, 1.02))
    a, b = line.fit()  # type: ignore[misc]
    assert b == pytest.approx(2.0, rel=0.02) and a == pytest.approx(0.5, abs=0.6)
    assert line.rejected >= 10


def test_online_line_follows_a_real_change() -> None:
    line = OnlineLine(halflife=10, min_obs=5)
    for i in range(50):
        line.observe(float(i % 7 + 1), 1.0 * (i % 7 + 1))
    for i in range(80):
        line.observe(float(i % 7 + 1), 3.0 * (i % 7 + 1))  # the hardware slowed down for good
    assert line.fit()[1] == pytest.approx(3.0, rel=0.05)  # type: ignore[index]


def test_online_line_with_constant_x_goes_through_the_origin() -> None:
    line = OnlineLine(min_obs=3)
    for _ in range(5):
        line.observe(10.0, 20.0)
    assert line.fit() == (0.0, 2.0)
    with pytest.raises(ValueError):
        line.observe(float("nan"), 1.0)


def test_online_line_does_not_fit_an_intercept_from_same_size_observations() -> None:
    """Five same-size observations (x within 2%) with noisy y cannot tell a fixed cost from the slope: the intercept
    stays at the fallback and the slope carries the mean, as with constant x; sizes that spread fit it freely."""
    ys = [0.20, 0.19, 0.21, 0.19, 0.205]  # same-size prefills (seconds) with the noise of a busy 2-core box
    free, narrow = OnlineLine(min_obs=5, min_spread=0.0), OnlineLine(min_obs=5)
    for i, y in enumerate(ys):
        free.observe(100.0 + i, y)  # x within 2% of 102
        narrow.observe(100.0 + i, y)
    assert free.fit()[0] > 0.09  # type: ignore[index]  # half of every y taken for a fixed cost: noise
    a, b = narrow.fit()  # type: ignore[misc]
    assert a == 0.0 and b * 102.0 == pytest.approx(sum(ys) / len(ys), rel=0.02)
    spread = OnlineLine(min_obs=5)
    for x in (20.0, 50.0, 100.0, 150.0, 200.0):
        spread.observe(x, 0.03 + 0.001 * x)
    assert spread.fit() == pytest.approx((0.03, 0.001))
    with pytest.raises(ValueError):
        OnlineLine(min_spread=-0.1)


def test_the_probe_seeds_the_mfu_fit_and_the_replicas_own_prefills_take_over() -> None:
    """A start-up probe timed under load (a large fixed cost) prices the replica until it served ``min_obs``
    requests; then its own prefills alone are fitted, so the probe's fixed cost does not stay in every prediction."""
    hw = router_hw(mfu=0.5)
    cal = Calibrator(bw_util=0.8, min_obs=5)

    def seconds(tokens: int, cached: int, mfu: float, fixed: float) -> float:
        return fixed + cost.t_prefill(hw.model, hw.gpu, tokens, mfu=mfu, cached_tokens=cached)

    for tokens in (204, 512, 921, 1433, 2048):
        cal.observe_prefill("r0", hw, tokens, 0, seconds(tokens, 0, 0.2, 0.15), probe=True)
    assert not cal.fitted("r0") and cal.overhead_s("r0") == pytest.approx(0.15, rel=0.01)  # priced by its probe
    live = [(2400, 1900), (2000, 0), (2500, 2300), (2100, 0), (2450, 1800), (1950, 0)]
    for i, (tokens, cached) in enumerate(live):
        cal.observe_prefill("r0", hw, tokens, cached, seconds(tokens, cached, 0.3, 0.003))
        if i < 4:  # fewer than min_obs of its own: the probe still weighs in
            assert cal.overhead_s("r0") > 0.05
    assert cal.fitted("r0") and cal.overhead_s("r0") == pytest.approx(0.003, abs=1e-3)
    assert cal.hardware("r0", hw).mfu == pytest.approx(0.3, rel=0.03)
    seeded = cal._mfu["r0"].line.n  # once its own prefills price it, the seeded line is left as it is
    assert not cal.observe_prefill("r0", hw, 2000, 0, 5.0, probe=True)  # a late probe sample is not taken
    assert cal.observe_prefill("r0", hw, 2200, 0, seconds(2200, 0, 0.3, 0.003))
    assert cal._mfu["r0"].line.n == seeded
    assert cal.overhead_s("r0") == pytest.approx(0.003, abs=1e-3)


def test_mfu_fit_recovers_the_true_mfu() -> None:
    configured = router_hw(mfu=0.5)
    true_mfu, overhead = 0.31, 0.004
    est = MfuEstimator(configured, halflife=100)
    rng = random.Random(1)
    assert est.hardware() is configured  # nothing observed yet
    for _ in range(200):
        tokens = rng.randint(100, 30000)
        cached = rng.randint(0, tokens - 1)
        t = overhead + cost.t_prefill(configured.model, configured.gpu, tokens, mfu=true_mfu, cached_tokens=cached)
        est.observe(tokens, cached, t * rng.uniform(0.97, 1.03))
    hw = est.hardware()
    assert hw.mfu == pytest.approx(true_mfu, rel=0.05) and hw.gpu is configured.gpu
    assert est.overhead_s == pytest.approx(overhead, abs=0.01)
    assert est.hardware() is hw  # stable object while the estimate does not move (keeps pricing caches warm)
    with pytest.raises(ValueError):
        est.observe(100, 200, 1.0)  # cached > tokens
    with pytest.raises(ValueError):
        est.observe(100, 0, 0.0)


def test_mfu_fit_separates_the_attention_rate_when_the_prefills_tell_it_apart() -> None:
    """An engine whose attention costs 0.3 of its matrix products per FLOP (vLLM's CPU build on an AVX2 box):
    cold prompts and short suffixes over long cached prefixes. The two-rate fit recovers both rates and predicts the
    suffixes, which the one-MFU line over the same samples prices too slow."""
    configured = router_hw(model="tiny-qwen3-heavy", gpu="cpu-2core", mfu=0.5)
    model = configured.model
    true_mfu, true_scale, overhead = 0.08, 0.3, 0.02
    truth = dataclasses.replace(configured, mfu=true_mfu, attn_scale=true_scale)
    est = MfuEstimator(configured, halflife=100)
    rng = random.Random(3)
    for i in range(60):
        tokens = rng.randint(1500, 4000)
        cached = 0 if i % 3 == 0 else tokens - rng.randint(100, 600)  # a cold prompt, then revisits
        t = overhead + cost.ttft(truth, prompt_tokens=tokens, cached_tokens=cached)
        est.observe(tokens, cached, t * rng.uniform(0.98, 1.02))
    hw = est.hardware()
    assert hw.mfu == pytest.approx(true_mfu, rel=0.05)
    assert hw.attn_scale == pytest.approx(true_scale, rel=0.06)
    assert est.overhead_s == pytest.approx(overhead, abs=0.01)
    suffix = overhead + cost.ttft(truth, prompt_tokens=4000, cached_tokens=3600)
    assert est.overhead_s + cost.ttft(hw, prompt_tokens=4000, cached_tokens=3600) == pytest.approx(suffix, rel=0.05)
    linear, attention = cost.prefill_terms(model, 4000, 3600)
    flops = linear + attention
    assert est.predict(linear, attention) == pytest.approx(suffix, rel=0.05)
    one = est.fit()
    assert one is not None and one[0] + one[1] * flops > 1.1 * suffix  # the one-MFU line of the same samples
    assert est.hardware() is hw


def test_prefills_of_one_shape_keep_the_attention_priced_as_counted() -> None:
    """Cold prompts of one length cannot tell the attention rate from the matrix products': attn_scale stays 1 and
    the one-MFU line prices the replica (``OnlinePlane`` answers None)."""
    configured = router_hw(mfu=0.5)
    est = MfuEstimator(configured, halflife=100)
    solo = cost.t_prefill(configured.model, configured.gpu, 2048, mfu=0.25)
    for k in range(20):
        est.observe(2048, 0, 0.01 + solo * (1 + k % 3 / 100))
    assert est.served_plane.fit() is None and est.attn_scale == 1.0
    assert est.hardware().attn_scale == 1.0 and est.hardware().mfu == pytest.approx(0.25, rel=0.1)
    plane = OnlinePlane(min_obs=3)
    for x1, x2 in [(1.0, 2.0), (2.0, 1.0), (3.0, 3.0), (1.0, 4.0)]:
        plane.observe(x1, x2, 0.5 + 0.1 * x1 + 0.4 * x2)
    assert plane.fit() == pytest.approx((0.5, 0.1, 0.4))
    odd = MfuEstimator(configured, halflife=100)  # an attention "1000× dearer" than the matrix products: noise
    for tokens, cached in [(1000, 0), (2000, 0), (3000, 2500), (4000, 3900), (1500, 1000), (2500, 0)] * 2:
        linear, attention = cost.prefill_terms(configured.model, tokens, cached)
        odd.observe(tokens, cached, 1e-13 * (linear + 1000 * attention))
    assert odd.served_plane.fit() is not None and odd.attn_scale == 1.0
    with pytest.raises(ValueError):
        plane.observe(1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        OnlinePlane(min_obs=2)


def test_tier_fit_reproduces_observed_transfers() -> None:
    base = TierSpec(name="rdma-pool", bandwidth_gbps=50, latency_s=0.0)
    est = TierEstimator(base, bw_util=0.8, halflife=100)
    true_bps, true_lat = 22e9, 0.0015
    rng = random.Random(2)
    for _ in range(200):
        nbytes = rng.uniform(1e6, 2e9)
        est.observe(nbytes, (true_lat + nbytes / true_bps) * rng.uniform(0.98, 1.02))
    spec = est.tier_spec()
    assert spec.name == "rdma-pool" and "calibrated" in spec.description
    assert spec.latency_s == pytest.approx(true_lat, abs=0.003)
    hw = router_hw(bw_util=0.8)
    predicted = cost.t_fetch(hw.model, spec, 10_000, bw_util=0.8)
    actual = true_lat + cost.fetch_bytes(hw.model, 10_000) / true_bps
    assert predicted == pytest.approx(actual, rel=0.05)


def test_calibrator_updates_hardware_and_tier_map() -> None:
    cal = Calibrator(bw_util=0.8, min_obs=3)
    hw = router_hw(mfu=0.5, bw_util=0.8)
    base = router_tier_map()
    assert cal.hardware("r0", hw) is hw and cal.tier_map(base) is base
    for tokens in (1000, 5000, 9000, 20000, 30000):
        cal.observe_prefill("r0", hw, tokens, 0, cost.t_prefill(hw.model, hw.gpu, tokens, mfu=0.25))
        cal.observe_transfer("dram_remote", base, tokens * 1e5, tokens * 1e5 / 10e9)
    assert cal.hardware("r0", hw).mfu == pytest.approx(0.25, rel=1e-3)
    assert cal.hardware("r1", hw) is cal.hardware("r0", hw)  # not fitted yet: priced like its fleet
    tm = cal.tier_map(base)
    assert tm.dram_remote.bandwidth_gbps == pytest.approx(10 / 0.8, rel=1e-3)
    assert tm.dram_local is base.dram_local
    with pytest.raises(ValueError, match="unknown tier class"):
        cal.observe_transfer("tape", base, 1.0, 1.0)
    cal.forget_replica("r0")
    assert cal.hardware("r0", hw) is hw


def test_tier_fit_keeps_the_configured_latency_when_sizes_cannot_separate_it() -> None:
    """Fetches that all have about the same size: the free fit is noise (here its slope is negative); the fitted
    tier keeps the configured latency and takes the bandwidth from the rest of the time."""
    base = TierSpec(name="loopback", bandwidth_gbps=2.5, latency_s=0.005)
    est = TierEstimator(base, bw_util=0.7, min_obs=5)
    # ~1 MB fetches taking 5 ms + 1 MB at 0.1 GB/s (10 ms), sizes and times jittered.
    for nbytes, seconds in [(1.00e6, 0.0152), (1.02e6, 0.0148), (0.99e6, 0.0151), (1.01e6, 0.0149), (1.0e6, 0.015)]:
        est.observe(nbytes, seconds)
    spec = est.tier_spec()
    assert spec.latency_s == pytest.approx(0.005)
    assert spec.bandwidth_gbps * 0.7 == pytest.approx(0.1, rel=0.05)
    # Faster than the configured latency alone: the line goes through the origin instead.
    fast = TierEstimator(base, bw_util=0.7, min_obs=5)
    for k in range(5):
        fast.observe(1e6 * (1 + k * 0.001), 0.002)
    assert fast.tier_spec().latency_s == 0.0
    assert fast.tier_spec().bandwidth_gbps * 0.7 == pytest.approx(0.5, rel=0.05)


def test_a_replica_faster_than_its_profile_peak_is_priced_at_what_it_sustains() -> None:
    """The profile is a placeholder (cpu-2core) or wrong: the fit says the replica sustains more than the profile's
    peak. Capping the MFU at 1 would keep predictions too slow; the peak is raised instead, at MFU 1."""
    configured = router_hw(mfu=0.5)
    est = MfuEstimator(configured, halflife=100)
    peak = configured.gpu.bf16_tflops * 1e12
    for tokens in (500, 1000, 2000, 4000, 8000, 16000):
        flops = cost.prefill_flops(configured.model, tokens)
        est.observe(tokens, 0, 0.002 + flops / (3.0 * peak))  # 3x the profile's peak
    hw = est.hardware()
    assert hw.mfu == 1.0 and hw.gpu.bf16_tflops == pytest.approx(3.0 * configured.gpu.bf16_tflops, rel=0.02)
    t = cost.t_prefill(hw.model, hw.gpu, 4000, mfu=hw.mfu)
    assert t == pytest.approx(cost.prefill_flops(configured.model, 4000) / (3.0 * peak), rel=0.02)
    assert est.hardware() is hw


def test_a_replica_without_its_own_fit_is_priced_like_its_fleet() -> None:
    """A replica that has not served yet must not look slower than the fitted ones (it would never be chosen, so
    never fitted): it takes the fleet's median fit and mean overhead until its own is ready."""
    hw = router_hw(mfu=0.5)
    cal = Calibrator(bw_util=0.8, min_obs=3)
    assert cal.hardware("new", hw) is hw and cal.overhead_s("new") == 0.0  # nobody fitted: the configured prior
    for tokens in (500, 2000, 8000, 16000):
        cal.observe_prefill("old", hw, tokens, 0, 0.01 + cost.t_prefill(hw.model, hw.gpu, tokens, mfu=0.2))
    cal.observe_path(0.03)
    assert cal.fitted("old") and not cal.fitted("new")
    assert cal.hardware("new", hw) is cal.hardware("old", hw)
    assert cal.overhead_s("new") == pytest.approx(cal.overhead_s("old"))


def test_an_unproven_replica_is_priced_like_its_proven_sibling_not_by_its_probe() -> None:
    """The live sequential runs' case: both replicas probed under start-up load (0.07 s fixed cost); r0 served
    ``min_obs`` requests and is proven fast; r1 served one cold, slow request. Priced by its probe and that request,
    r1 looked ~3x slower than r0 and got no more requests. It is priced like r0 until it has ``min_obs`` real prefills,
    then by its own, also when they show it really is slower."""
    hw = router_hw(mfu=0.5)
    cal = Calibrator(bw_util=0.8, min_obs=5)

    def seconds(tokens: int, cached: int, mfu: float, fixed: float) -> float:
        return fixed + cost.t_prefill(hw.model, hw.gpu, tokens, mfu=mfu, cached_tokens=cached)

    for rid in ("r0", "r1"):
        for tokens in (204, 512, 921, 1433, 2048):
            cal.observe_prefill(rid, hw, tokens, 0, seconds(tokens, 0, 0.1, 0.07), probe=True)
    assert cal.hardware("r1", hw) is cal.hardware("r0", hw)  # nobody proven: each by its probe, the same here
    cal.observe_prefill("r1", hw, 1988, 0, seconds(1988, 0, 0.05, 0.3))  # its cold first request
    for tokens in (1960, 1970, 1962, 1957, 1951):
        cal.observe_prefill("r0", hw, tokens, 0, seconds(tokens, 0, 0.3, 0.003))
    assert cal.fitted("r0") and not cal.fitted("r1")
    assert cal.hardware("r1", hw) is cal.hardware("r0", hw)
    assert cal.overhead_s("r1") == pytest.approx(cal.overhead_s("r0"))
    for tokens in (1971, 1966, 1969, 1986):  # r1 is chosen now: 5 real prefills of its own, 2x slower than r0
        assert not cal.fitted("r1")
        cal.observe_prefill("r1", hw, tokens, 0, seconds(tokens, 0, 0.15, 0.003))
    assert cal.fitted("r1") and not cal.trusted("r1")  # proven slower on 5: still r0's price (below)
    assert cal.hardware("r1", hw) is cal.hardware("r0", hw)
    for i in range(cal.trust_obs - 5):  # chosen like r0, so measured: its own fit prices it from trust_obs on
        assert not cal.trusted("r1")
        cal.observe_prefill("r1", hw, 1960 + i, 0, seconds(1960 + i, 0, 0.15, 0.003))
    assert cal.trusted("r1")
    assert cal.hardware("r1", hw).mfu < cal.hardware("r0", hw).mfu


def test_a_replica_proven_slow_on_few_noisy_samples_keeps_its_fleets_price_until_trusted() -> None:
    """The sequential re-run's case (``bench/reports/live_agent_sequential/at_359258a``): r1's first five prefills
    were two harness warm-ups, one cold first turn and two fast ones, so its fit was slower than r0's and r1 got 4 of
    30 requests, never re-measured. A replica proven slower than its fleet's median is priced like the median until
    ``trust_obs`` real prefills; one proven faster is priced by its own fit at once."""
    hw = router_hw(mfu=0.5)
    cal = Calibrator(bw_util=0.8, min_obs=5)
    assert cal.trust_obs == 20
    with pytest.raises(ValueError, match="trust_obs"):
        Calibrator(bw_util=0.8, min_obs=5, trust_obs=4)

    def seconds(tokens: int, mfu: float) -> float:
        return 0.003 + cost.t_prefill(hw.model, hw.gpu, tokens, mfu=mfu)

    for i in range(30):
        cal.observe_prefill("r0", hw, 1500 + 10 * i, 0, seconds(1500 + 10 * i, 0.3))
    for tokens, mfu in ((1900, 0.05), (1920, 0.06), (1950, 0.02), (1400, 0.3), (1410, 0.3)):  # cold, then warm
        cal.observe_prefill("r1", hw, tokens, 0, seconds(tokens, mfu))
    assert cal.fitted("r1") and cal._mfu["r1"].hardware().mfu < 0.9 * cal._mfu["r0"].hardware().mfu  # fit: slow
    assert cal.hardware("r1", hw) is cal.hardware("r0", hw)  # priced like r0: a tie, so it is chosen and measured
    assert cal.overhead_s("r1") == pytest.approx(cal.overhead_s("r0"))
    for i in range(cal.trust_obs - 5):  # its warm prefills, as fast as r0's
        cal.observe_prefill("r1", hw, 1500 + 7 * i, 0, seconds(1500 + 7 * i, 0.3))
    assert cal.trusted("r1")
    assert cal.hardware("r1", hw).mfu == pytest.approx(0.3, rel=0.2)
    for i in range(5):  # a third replica proven faster than the fleet is priced by its own fit
        cal.observe_prefill("r2", hw, 1500 + 10 * i, 0, seconds(1500 + 10 * i, 0.45))
    assert not cal.trusted("r2") and cal.hardware("r2", hw).mfu == pytest.approx(0.45, rel=0.05)
    assert cal.hardware("r2", hw).mfu > 1.3 * cal.hardware("r1", hw).mfu


def test_replicas_whose_fits_differ_by_less_than_the_band_are_priced_alike() -> None:
    """Two replicas of one hardware, fitted 10% apart (on CPU, the same engine on two cores: 0.111 vs 0.1005 MFU),
    are one price: the median fit prices both, so the fits' noise does not send every fresh prompt to one of them.
    Fitted 2x apart, each is priced by its own fit once trusted; with the band 0, as before it existed."""
    from router.calibration import SAME_SPEED_BAND

    hw = router_hw(mfu=0.5)

    def serve(cal: Calibrator, rid: str, mfu: float, fixed: float, n: int) -> None:
        for i in range(n):
            tokens = 1500 + 10 * i
            cal.observe_prefill(rid, hw, tokens, 0, fixed + cost.t_prefill(hw.model, hw.gpu, tokens, mfu=mfu))

    assert SAME_SPEED_BAND == 0.25
    with pytest.raises(ValueError, match="same_speed_band"):
        Calibrator(bw_util=0.8, same_speed_band=-0.1)
    cal = Calibrator(bw_util=0.8, min_obs=5)
    serve(cal, "a", 0.30, 0.003, cal.trust_obs)
    serve(cal, "b", 0.33, 0.004, cal.trust_obs)
    assert cal.trusted("a") and cal.trusted("b")
    assert cal.hardware("a", hw) is cal.hardware("b", hw)
    assert cal.overhead_s("a") == cal.overhead_s("b")
    # one of them is the fleet's median and priced by its own fit; the other moves with it (the router re-prices it)
    assert sorted([cal.priced_by_own_fit("a"), cal.priced_by_own_fit("b")]) == [False, True]
    serve(cal, "c", 0.15, 0.003, cal.trust_obs)  # 2x slower: a real difference, its own price
    assert cal.hardware("c", hw).mfu < 0.6 * cal.hardware("a", hw).mfu and cal.priced_by_own_fit("c")
    assert not cal.priced_by_own_fit("never-served")
    apart = Calibrator(bw_util=0.8, min_obs=5, same_speed_band=0.0)
    serve(apart, "a", 0.30, 0.003, apart.trust_obs)
    serve(apart, "b", 0.33, 0.004, apart.trust_obs)
    assert apart.hardware("a", hw).mfu < apart.hardware("b", hw).mfu


def test_the_path_is_the_routers_one_price_for_every_replica() -> None:
    """The request path (ingress, hops, the first chunk's way back) is one estimate, fed by every replica's requests
    and pricing every replica, also one that never served. Per replica, only a chosen replica was measured: one priced
    on its cold first requests was not chosen again (issue 13: 40 of 42 requests on one replica of two), and between
    idle replicas the estimates' noise alone chose one replica for a whole burst (13 of 16, the two-router e2e test).
    The least of the first ``PATH_MIN_OBS`` samples starts the EWMA; a stall once settled is clipped to 4x it."""
    from router.calibration import PATH_MIN_OBS

    cal = Calibrator(bw_util=0.8)
    assert cal.overhead_s("busy") == 0.0  # no sample yet
    cal.observe_path(1.5)  # warm-up requests, cold
    cal.observe_path(0.9)
    for _ in range(PATH_MIN_OBS - 2):
        cal.observe_path(0.03)
    assert cal.overhead_s("busy") == cal.overhead_s("idle") == cal.overhead_s("never-served") == pytest.approx(0.03)
    cal.observe_path(30.0)
    assert cal.overhead_s("idle") == pytest.approx(0.8 * 0.03 + 0.2 * 0.12)
    cal.forget_replica("idle")  # a replica gone takes its MFU fit along, not the router's path
    assert cal.overhead_s("busy") == pytest.approx(0.8 * 0.03 + 0.2 * 0.12)


def test_a_path_whose_first_samples_were_all_cold_comes_down_within_a_few_requests() -> None:
    """The live run's case (issue 13, ``bench/reports/live_overflow_vs_round_robin/after_calibration``): a replica's
    first five requests (the harness's warm-up ones and the first real ones on a cold ingress) were all cold, so
    their median priced its path at ~0.19 s while its warm requests took ~0.03 s; the EWMA then came down by a fifth
    of the gap per request (0.19 -> 0.16 -> 0.13 ...) while the router, pricing it high, sent it almost nothing.
    Now the least cold sample starts it and a faster sample halves the gap: within 3 warm requests it is within
    0.02 s of the warm path, where the old rule was still 0.08 s above it."""
    from router.calibration import PATH_MIN_OBS

    cal = Calibrator(bw_util=0.8)
    cold = [0.21, 0.19, 0.2, 0.18, 0.19]
    assert len(cold) == PATH_MIN_OBS
    for s in cold:
        cal.observe_path(s)
    assert cal.overhead_s("r") == pytest.approx(0.18)
    for _ in range(3):
        cal.observe_path(0.03)
    assert cal.overhead_s("r") == pytest.approx(0.03 + 0.15 / 8)
    old = 0.19  # the old rule: median of the cold samples, then weight 0.2 either way
    for _ in range(3):
        old = 0.8 * old + 0.2 * 0.03
    assert old - 0.03 > 0.08


def test_the_path_estimate_leans_low_and_still_follows_a_real_shift() -> None:
    """Samples evenly spread around 0.05 s settle below it (waits only add to a fixed cost), and a lasting rise of
    the path (a replica moved behind a slower hop) is followed at the upward weight."""
    import random

    rng = random.Random(7)
    cal = Calibrator(bw_util=0.8)
    for _ in range(300):
        cal.observe_path(0.05 + rng.uniform(-0.01, 0.01))
    settled = cal.overhead_s("r")
    assert 0.04 < settled < 0.05
    for _ in range(40):
        cal.observe_path(0.15 + rng.uniform(-0.01, 0.01))
    assert 0.13 < cal.overhead_s("r") < 0.15


def test_the_prefill_line_is_fitted_for_relative_error() -> None:
    """The sequential live run's prefills (``bench/reports/live_agent_sequential/vs_round_robin_at_head``): same-size
    first turns that took 0.17-0.59 s on a shared 2-core box, and revisits of ~165 new tokens that took ~0.03 s.
    Plain least squares lets the noisy large samples set the line, which then over-predicts the short prefills
    (by ~60% here); weighting each sample by 1/y² fits the relative error the audit measures."""
    first_turns = [0.589, 0.510, 0.504, 0.165, 0.309, 0.178, 0.326, 0.280, 0.310, 0.226]
    revisits = [0.035, 0.030, 0.028, 0.038, 0.036, 0.032, 0.030, 0.028, 0.031, 0.028, 0.035, 0.030]
    x_first, x_revisit = 1.0, 0.14  # FLOPs, relative to a first turn (the model's ratio for these sizes)

    def fitted(relative: bool) -> OnlineLine:
        line = OnlineLine(relative=relative)
        for i, y in enumerate(first_turns):
            line.observe(x_first, y)
            for y2 in revisits[i:i + 2] if i < 6 else ():
                line.observe(x_revisit, y2)
        return line

    def rel_err(line: OnlineLine, x: float, y: float) -> float:
        fit = line.fit()
        assert fit is not None
        return abs(fit[0] + fit[1] * x - y) / y

    plain, relative = fitted(False), fitted(True)
    revisit = statistics.median(revisits)
    assert rel_err(plain, x_revisit, revisit) > 0.5
    assert rel_err(relative, x_revisit, revisit) < 0.2
    # the first turns' median error does not get worse than the spread of the samples themselves allows
    first = statistics.median(first_turns)
    assert rel_err(relative, x_first, first) < 0.35


def test_a_tier_fits_its_bandwidth_on_the_reads_and_adds_the_median_wait() -> None:
    """Live, the longer waits before a read (lookup and lease round trips ending in a long engine step) fell on the
    larger fetches: a line over whole seconds read them as bytes ("0.0 GB/s"). With the read reported apart, the
    bandwidth is the reads' and the latency the read's own plus the median wait."""
    base = TierSpec(name="loopback", bandwidth_gbps=2.5, latency_s=0.005)
    split, whole = TierEstimator(base, bw_util=0.8, min_obs=5), TierEstimator(base, bw_util=0.8, min_obs=5)
    waits = [0.01, 0.02, 0.015, 0.4, 1.2, 0.012, 1.5, 0.018]
    for k, wait in enumerate(waits, start=1):
        nbytes = k * 1e6
        read_s = 0.001 + nbytes / 4e9  # 4 GB/s effective, 1 ms per read
        split.observe(nbytes, wait + read_s, read_s)
        whole.observe(nbytes, wait + read_s)
    assert split.effective_bandwidth_bps == pytest.approx(4e9, rel=1e-3)
    assert split.latency_s == pytest.approx(0.001 + statistics.median(waits), rel=1e-3)
    assert split.tier_spec().latency_s == pytest.approx(split.latency_s)
    assert whole.effective_bandwidth_bps < 0.05e9  # the waits taken for bytes
    # A 5 MB fetch: the split fit prices what such fetches cost at the median; the whole line over 20 times more.
    priced = split.latency_s + 5e6 / split.effective_bandwidth_bps
    assert priced == pytest.approx(0.001 + 0.019 + 5e6 / 4e9, rel=1e-3)
    assert whole.latency_s + 5e6 / whole.effective_bandwidth_bps > 20 * priced


def test_a_tier_without_enough_reads_keeps_the_configured_latency_and_refuses_a_read_longer_than_its_transfer() -> None:
    base = TierSpec(name="loopback", bandwidth_gbps=2.5, latency_s=0.005)
    est = TierEstimator(base, bw_util=0.8, min_obs=5)
    est.observe(1e6, 0.5, 0.001)
    assert est.latency_s == 0.005 and est.wait_s == pytest.approx(0.499)  # the configured tier until min_obs
    with pytest.raises(ValueError, match="read"):
        est.observe(1e6, 0.01, 0.02)
    with pytest.raises(ValueError, match="read"):
        est.observe(1e6, 0.01, 0.0)
