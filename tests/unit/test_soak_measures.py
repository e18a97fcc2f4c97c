"""The soak bench's measurements (``bench.soak``, ``bench.prom``): step-time percentiles from two scrapes of a vLLM
histogram, and the RSS comparison of a server's processes."""

from __future__ import annotations

import pytest

from bench.prom import histogram_buckets, histogram_quantile
from bench.soak import STEP_HISTOGRAM, rss_change, step_times


def exposition(counts: dict[str, list[int]]) -> str:
    """A ``vllm:inter_token_latency_seconds`` histogram per replica with cumulative counts at 0.01/0.1/1/+Inf."""
    lines = [f"# HELP {STEP_HISTOGRAM} itl", f"# TYPE {STEP_HISTOGRAM} histogram"]
    for replica, cum in counts.items():
        for le, n in zip(("0.01", "0.1", "1.0", "+Inf"), cum, strict=True):
            lines.append(f'{STEP_HISTOGRAM}_bucket{{le="{le}",replica="{replica}"}} {n}')
        lines.append(f'{STEP_HISTOGRAM}_count{{replica="{replica}"}} {cum[-1]}')
        lines.append(f'{STEP_HISTOGRAM}_sum{{replica="{replica}"}} 1.0')
    return "\n".join(lines) + "\n"


def test_buckets_are_summed_over_replicas_and_quantiles_interpolate() -> None:
    b = histogram_buckets(exposition({"r1": [10, 50, 100, 100], "r2": [0, 50, 100, 100]}), STEP_HISTOGRAM)
    assert b == {0.01: 10, 0.1: 100, 1.0: 200, float("inf"): 200}
    assert histogram_quantile(b, 0.5) == pytest.approx(0.1)  # rank 100: the top of the 0.1 bucket
    assert histogram_quantile(b, 0.75) == pytest.approx(0.1 + 0.9 * 0.5)
    assert histogram_quantile(b, 0.01) == pytest.approx(0.01 * 2 / 10)
    assert histogram_quantile({}, 0.5) is None
    assert histogram_quantile({0.1: 0, float("inf"): 4}, 0.5) == 0.1  # only +Inf: its lower bound


def test_step_times_are_the_runs_own_samples() -> None:
    before = exposition({"r1": [100, 100, 100, 100]})  # 100 fast steps before the run
    after = exposition({"r1": [100, 150, 200, 200]})  # the run: 50 in (0.01, 0.1], 50 in (0.1, 1]
    st = step_times(before, after)
    assert st["samples"] == 100 and st["source"] == STEP_HISTOGRAM
    assert st["p50"] == pytest.approx(0.1) and 0.1 < st["p99"] <= 1.0
    assert step_times("", "")["p50"] is None


def test_rss_change_lists_every_process_and_the_largest_growth() -> None:
    start = {1: {"label": "ray::ServeReplica", "rss_mib": 500.0}, 2: {"label": "raylet", "rss_mib": 100.0}}
    end = {1: {"label": "ray::ServeReplica", "rss_mib": 560.0}, 3: {"label": "ray::IDLE", "rss_mib": 50.0}}
    r = rss_change(start, end)
    assert [p["pid"] for p in r["processes"]] == [1, 2, 3]
    assert r["processes"][1]["rss_end_mib"] is None and r["processes"][2]["rss_start_mib"] is None
    assert (r["total_start_mib"], r["total_end_mib"], r["max_growth_mib"]) == (600.0, 610.0, 60.0)
    assert (r["gone"], r["new"]) == (1, 1)


def test_rss_trend_tells_a_plateau_from_a_leak() -> None:
    """A process that fills up early and flattens (KV pages, an arena) is not flagged; one that keeps growing in the
    run's second half is; a process that was not there in every sample is left out."""
    from bench.soak import rss_trend

    def at(t: float, plateau: float, leak: float, extra: bool = False) -> tuple[float, dict]:
        procs = {1: {"label": "ray::PoolShard", "rss_mib": plateau}, 2: {"label": "VLLM::Worker", "rss_mib": leak}}
        if extra:
            procs[3] = {"label": "ray::IDLE", "rss_mib": 50.0}
        return t, procs

    samples = [at(0, 100, 500), at(30, 400, 560, extra=True), at(60, 410, 620), at(90, 410, 680), at(120, 411, 740)]
    trend = rss_trend(samples)
    assert [s["total_mib"] for s in trend["series"]] == [600.0, 1010.0, 1030.0, 1090.0, 1151.0]
    rows = {r["pid"]: r for r in trend["processes"]}
    assert set(rows) == {1, 2}  # pid 3 came and went
    assert rows[1]["first_half_mib"] == 310.0 and rows[1]["second_half_mib"] == 1.0  # the middle: t = 60
    assert rows[2]["first_half_mib"] == 120.0 and rows[2]["second_half_mib"] == 120.0
    assert [r["pid"] for r in trend["growing"]] == [2]
    assert rss_trend([]) == {"series": [], "processes": [], "growing": []}


def test_the_rss_sampler_samples_on_its_own_thread_until_stopped() -> None:
    import time

    from bench.soak import RssSampler

    calls: list[int] = []
    sampler = RssSampler(7, 0.05, measure=lambda pid: calls.append(pid) or {pid: {"label": "x", "rss_mib": 1.0}})
    sampler.start()
    time.sleep(0.3)
    samples = sampler.stop()
    n = len(samples)
    assert n >= 3 and set(calls) == {7} and samples[0][0] <= samples[-1][0]
    time.sleep(0.15)
    assert len(sampler.samples) == n  # stopped: no sample after stop()'s own
    with pytest.raises(ValueError):
        RssSampler(7, 0.0)
