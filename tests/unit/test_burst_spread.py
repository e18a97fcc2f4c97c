"""``bench.burst_spread``'s summaries (pure): what a burst did per replica and router, and over rounds."""

from __future__ import annotations

from bench.burst_spread import round_summary, summarize


def row(router: str, replica: str, status: int = 200, latency_s: float = 0.1) -> dict:
    return {"status": status, "router": router, "replica": replica, "target": replica, "latency_s": latency_s}


def test_a_round_counts_per_replica_and_router_and_a_replica_left_out_counts_zero() -> None:
    rows = [row("a", "r1")] * 5 + [row("b", "r1")] * 2 + [row("b", "r2", latency_s=0.3)] * 3 + [row("a", "", 500)]
    s = round_summary(rows, replicas=2)
    assert s["per_replica"] == {"r1": 7, "r2": 3} and (s["fewest"], s["most"], s["errors"]) == (3, 7, 1)
    assert s["per_router_replica"] == {"a -> r1": 5, "b -> r1": 2, "b -> r2": 3}
    assert round_summary(rows, replicas=3)["fewest"] == 0  # the third replica got nothing
    assert s["latency_p50_s"] == 0.1 and s["latency_p90_s"] == 0.3


def test_rounds_below_half_the_even_share_are_counted() -> None:
    rounds = [round_summary([row("a", "r1")] * k + [row("a", "r2")] * (16 - k), replicas=2) for k in (8, 5, 3, 4)]
    s = summarize(rounds, burst_size=16, replicas=2)
    assert (s["even_share"], s["bound"]) == (8.0, 4.0)
    assert s["fewest_by_round"] == [8, 5, 3, 4] and s["fewest_min"] == 3 and s["rounds_below_bound"] == 1
    assert s["fewest_median"] == 4.5
