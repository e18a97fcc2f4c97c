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
