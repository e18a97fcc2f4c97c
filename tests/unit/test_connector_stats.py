"""The connector's counters on vLLM's metrics path (``kvpool.connector.stats``): deltas per interval, aggregated
over the two roles, and the Prometheus counters vLLM's logger registers from ``build_prom_metrics``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvpool.connector.breaker import BreakerStats  # noqa: E402
from kvpool.connector.save_book import SaveBookStats  # noqa: E402
from kvpool.connector.scheduler import SchedulerStats  # noqa: E402
from kvpool.connector.stats import CounterDeltas, KvPoolConnectorStats, KvPoolPromMetrics, counter_groups  # noqa: E402


def test_deltas_are_the_increase_since_the_last_take() -> None:
    stats, book = SchedulerStats(), SaveBookStats()
    deltas = CounterDeltas()
    assert deltas.take({"scheduler": stats, "save_book": book}) is None
    stats.lookups += 3
    book.failed += 1
    first = deltas.take({"scheduler": stats, "save_book": book})
    assert first is not None and first.data == {"scheduler_lookups": 3, "save_book_failed": 1}
    stats.lookups += 2
    assert deltas.take({"scheduler": stats, "save_book": book}).data == {"scheduler_lookups": 2}
    assert deltas.take({"scheduler": stats}) is None


def test_the_two_roles_aggregate_and_reduce_drops_zeros() -> None:
    a = KvPoolConnectorStats(data={"scheduler_lookups": 2, "worker_loads": 1})
    b = KvPoolConnectorStats(data={"worker_loads": 4, "saver_save_failures": 0})
    agg = a.aggregate(b)
    assert agg.reduce() == {"scheduler_lookups": 2, "worker_loads": 5}
    assert not agg.is_empty()
    agg.reset()
    assert agg.is_empty()


def test_prometheus_counters_per_engine() -> None:
    registry = CollectorRegistry()

    class C(Counter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    metrics = KvPoolPromMetrics(type("Cfg", (), {"kv_transfer_config": None})(), {Counter: C, Gauge: Gauge,
                                Histogram: Histogram}, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    metrics.observe({"scheduler_breaker_trips": 2, "save_book_failed": 1, "unknown": 5}, engine_idx=1)
    assert registry.get_sample_value("vllm:kvpool_scheduler_breaker_trips_total",
                                     {"model_name": "m", "engine": "1"}) == 2
    assert registry.get_sample_value("vllm:kvpool_save_book_failed_total", {"model_name": "m", "engine": "1"}) == 1
    assert "lookups_not_yet" in counter_groups()["scheduler"] and "trips" in counter_groups()["worker_breaker"]
    assert "queue_max" not in counter_groups()["saver"]
    assert BreakerStats().trips == 0
