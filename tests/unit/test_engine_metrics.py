"""The engines' ``vllm:*`` metrics merged into the endpoint's ``/metrics`` (``router.engine_metrics``): one family
per name, a ``replica`` label on every sample, after the router's own families; parsable by Prometheus' parser."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.engine_metrics import engine_metrics_text, merge_exposition


def engine_text(running: float, prompt: int) -> str:
    r = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=r).labels("m", "0").set(running)
    Counter("vllm:prompt_tokens", "prompt tokens", ["model_name", "engine"], registry=r).labels("m", "0").inc(prompt)
    Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name", "engine"], registry=r,
              buckets=(0.1, 1.0)).labels("m", "0").observe(0.5)
    return generate_latest(r).decode()


def test_replicas_merge_into_one_family_each_with_a_replica_label() -> None:
    router = CollectorRegistry()
    Counter("kvstack_router_decisions", "decisions", registry=router).inc(3)
    body = merge_exposition({"r1": engine_text(2, 10), "r2": engine_text(0, 7)}, first=router).decode()
    families = list(text_string_to_metric_families(body))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names  # a family only once per scrape
    assert names[0] == "kvstack_router_decisions"
    by_name = {f.name: f for f in families}
    running = {s.labels["replica"]: s.value for s in by_name["vllm:num_requests_running"].samples}
    assert running == {"r1": 2.0, "r2": 0.0}
    prompt = {s.labels["replica"]: s.value for s in by_name["vllm:prompt_tokens"].samples}
    assert prompt == {"r1": 10.0, "r2": 7.0} and by_name["vllm:prompt_tokens"].type == "counter"
    buckets = [s for s in by_name["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["replica"] for s in buckets} == {"r1", "r2"} and all(s.labels["model_name"] == "m"
                                                                         for s in buckets)


def test_a_process_exposes_only_its_engine_families() -> None:
    from prometheus_client import REGISTRY

    gauge = Gauge("vllm:test_only_gauge", "t", registry=REGISTRY)
    try:
        gauge.set(4)
        names = {f.name for f in text_string_to_metric_families(engine_metrics_text())}
        assert "vllm:test_only_gauge" in names and all(n.startswith("vllm:") for n in names)
    finally:
        REGISTRY.unregister(gauge)
