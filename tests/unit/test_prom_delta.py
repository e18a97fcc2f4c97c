"""``bench.prom.router_delta``: what a live run caused, from two scrapes of the endpoint's ``/metrics`` — the
router's hit tokens by tier and decisions by action, and the engines' save counters summed over the replicas."""

from __future__ import annotations

from bench.prom import parse_router_metrics, router_delta


def exposition(hits: float, decisions: float, committed: tuple[float, float], catch_up: float) -> str:
    # as prometheus_client writes a counter: its TYPE line names the ``_total`` series
    return f"""# TYPE kvstack_router_hit_tokens_total counter
kvstack_router_hit_tokens_total{{tier="dram"}} {hits}
# TYPE kvstack_router_decisions_total counter
kvstack_router_decisions_total{{action="fetch"}} {decisions}
# TYPE vllm:kvpool_saver_blocks_committed_total counter
vllm:kvpool_saver_blocks_committed_total{{engine="0",replica="r1"}} {committed[0]}
vllm:kvpool_saver_blocks_committed_total{{engine="0",replica="r2"}} {committed[1]}
# TYPE vllm:kvpool_saver_catch_up_saves_total counter
vllm:kvpool_saver_catch_up_saves_total{{engine="0",replica="r1"}} {catch_up}
# TYPE vllm:kvpool_worker_loads_total counter
vllm:kvpool_worker_loads_total{{engine="0",replica="r1"}} 7
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",replica="r1"}} 3
"""


def test_the_delta_has_the_routers_counters_and_the_engines_save_counters() -> None:
    before = parse_router_metrics(exposition(100, 2, (10, 20), 0))
    after = parse_router_metrics(exposition(612, 5, (14, 29), 2))
    delta = router_delta(before, after)
    assert delta["available"]
    assert delta["hit_tokens_by_tier"] == {"dram": 512}
    assert delta["decisions_by_action"] == {"fetch": 3}
    assert delta["saver"] == {"blocks_committed": 13, "catch_up_saves": 2}  # over both replicas; no other group


def test_an_endpoint_without_them_says_so() -> None:
    delta = router_delta(None, parse_router_metrics("# TYPE x counter\nx_total 1\n"))
    assert delta == {"available": False, "hit_tokens_by_tier": {}, "decisions_by_action": {}, "saver": {}}
