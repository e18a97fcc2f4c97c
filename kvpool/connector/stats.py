"""The connector's counters on vLLM's own metrics path: ``vllm:kvpool_*`` Prometheus counters and vLLM's periodic
"KV Transfer metrics" log line.

Who calls what: vLLM asks both connector roles for ``get_kv_connector_stats()`` every step (the model runner on the
worker, the scheduler after its update) and sums the two (``aggregate``) into the step's scheduler stats; its stat
loggers then call the connector class's ``build_kv_connector_stats`` (the log line) and the ``KvPoolPromMetrics``
that ``build_prom_metrics`` registered (the counters, one child per engine, in the frontend process — the replica,
whose ``vllm:`` families reach the endpoint's ``/metrics``, ``router.engine_metrics``). ``CounterDeltas`` turns a
role's cumulative counters (its stats dataclasses) into the delta since the last call.

Counter names are ``vllm:kvpool_<group>_<field>`` (``_total`` added by Prometheus), e.g.
``vllm:kvpool_scheduler_lookup_failures_total``, ``vllm:kvpool_save_book_failed_total``,
``vllm:kvpool_saver_blocks_dropped_total``, ``vllm:kvpool_scheduler_breaker_trips_total``: every numeric field of the
groups in ``COUNTER_GROUPS`` except high-water marks (``*_max``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpool.connector.breaker import BreakerStats
from kvpool.connector.save_book import SaveBookStats
from kvpool.connector.saver import SaveStats

METRIC_PREFIX = "vllm:kvpool_"


def _numeric_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.type in ("int", "float", int, float)
            and not f.name.endswith("_max")]


def counter_groups() -> dict[str, list[str]]:
    """Group → counter fields (the roles' stats dataclasses; imported here so the names are known at startup)."""
    from kvpool.connector.scheduler import SchedulerStats
    from kvpool.connector.worker import WorkerStats

    return {
        "scheduler": _numeric_fields(SchedulerStats),
        "save_book": _numeric_fields(SaveBookStats),
        "scheduler_breaker": _numeric_fields(BreakerStats),
        "worker": _numeric_fields(WorkerStats),
        "saver": _numeric_fields(SaveStats),
        "worker_breaker": _numeric_fields(BreakerStats),
        "saver_breaker": _numeric_fields(BreakerStats),
    }


class KvPoolConnectorStats(KVConnectorStats):
    """``data``: ``<group>_<field>`` → increase over the interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """A role's cumulative counters → the increase since the last ``take``."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, groups: dict[str, Any]) -> KvPoolConnectorStats | None:
        """``groups``: group name → its stats dataclass instance (None: absent)."""
        delta: dict[str, float] = {}
        for group, stats in groups.items():
            if stats is None:
                continue
            for name in _numeric_fields(type(stats)):
                key = f"{group}_{name}"
                value = getattr(stats, name)
                change = value - self._last.get(key, 0)
                if change:
                    delta[key] = change
                    self._last[key] = value
        return KvPoolConnectorStats(data=delta) if delta else None


class KvPoolPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for group, names in counter_groups().items():
            for name in names:
                key = f"{group}_{name}"
                counter = self._counter_cls(name=f"{METRIC_PREFIX}{key}",
                                            documentation=f"kvpool connector: {group} {name.replace('_', ' ')}",
                                            labelnames=labelnames)
                self._counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)
