"""``KvPoolConnector``: vLLM's KV connector (v1 API) for the kvstack cluster KV pool.

Registered from outside vLLM (``kvpool.connector.config.kv_transfer_config`` builds the config)::

    KVTransferConfig(kv_connector="KvPoolConnector", kv_connector_module_path="kvpool.connector.kv_connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kvpool": ConnectorConfig(...) as builtins})

vLLM creates one instance per role; this class only dispatches (one file per role):
- Scheduler role (``kvpool.connector.scheduler.SchedulerSide``), called by vLLM's scheduler:
  ``get_num_new_matched_tokens`` (side-effect free pool lookup), ``update_state_after_alloc`` (lease),
  ``build_connector_meta`` (loads, saves, releases on preemption), ``request_finished`` /
  ``request_finished_all_groups`` (release on finish and abort), ``set_xfer_handshake_metadata`` (the layout).
- Worker role (``kvpool.connector.worker.WorkerSide``), called by vLLM's model runner:
  ``register_kv_caches`` (derive + verify the layout, refuse to start when unsure, register memory for transfers),
  ``get_handshake_metadata``, ``start_load_kv`` (queues the loads with the background loader),
  ``wait_for_layer_load`` (no-op: loads are asynchronous, the request waits in ``WAITING_FOR_REMOTE_KVS``), ``save_kv_layer`` (no-op: saves run once per step in ``wait_for_save``), ``wait_for_save``,
  ``get_transfer_results``, ``get_block_ids_with_load_errors``, ``build_connector_worker_meta`` (the saves' outcomes,
  ``SaveReport``, which the scheduler role gets in ``update_connector_output``).
Both roles report their counters on vLLM's metrics path (``get_kv_connector_stats``: ``vllm:kvpool_*`` counters and
vLLM's "KV Transfer metrics" log line, ``kvpool.connector.stats``).
The replica reads the worker's finished-load timings with ``engine.collective_rpc(drain_transfer_records)``
(encoded ``TransferRecord``s; the routers calibrate their tier prices with them).
Messages between the roles: ``kvpool.connector.meta``. Hybrid models (several KV cache groups) are supported
(``SupportsHMA``): full-attention blocks per block plus the linear-state snapshot at a block boundary.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.meta import KvPoolMetadata, TransferRecord
from kvpool.connector.scheduler import SchedulerSide
from kvpool.connector.stats import CounterDeltas, KvPoolConnectorStats, KvPoolPromMetrics
from kvpool.connector.worker import WorkerSide


class KvPoolConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        if ktc.kv_load_failure_policy != "recompute":
            raise ValueError(
                "KvPoolConnector needs kv_load_failure_policy='recompute' (a block that fails to load is "
                f"recomputed, never fails the request); got {ktc.kv_load_failure_policy!r}"
            )
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self._deltas = CounterDeltas()
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.config, vllm_config, kv_cache_config)
        else:
            self.worker_side = WorkerSide(self.config, vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def _sched(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("KvPoolConnector: scheduler method called on the worker role")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("KvPoolConnector: worker method called on the scheduler role")
        return self.worker_side

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker_side.handshake() if self.worker_side is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker().bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker_side is not None:
            self.worker_side.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker().transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self._worker().transfer_results()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().save_report()

    # ------------------------------------------------------------------ both roles: vLLM's metrics path
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler_side is not None:
            side = self.scheduler_side
            return self._deltas.take({"scheduler": side.stats, "save_book": side.book.stats,
                                      "scheduler_breaker": side.shards.breaker.stats})
        w = self._worker()
        return self._deltas.take({"worker": w.stats, "saver": w.saver.stats if w.saver is not None else None,
                                  "worker_breaker": w.shards.breaker.stats,
                                  "saver_breaker": w.saver_shards.breaker.stats if w.saver_shards else None})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvPoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KvPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_transfer_records(self) -> list[TransferRecord]:
        return self._worker().take_transfer_records()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # ------------------------------------------------------------------ scheduler role
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched().set_handshake(metadata)

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvPoolMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        side = self._sched()
        side.load_outcomes(getattr(connector_output, "finished_recving", None),
                           getattr(connector_output, "failed_recving", None),
                           getattr(connector_output, "invalid_block_ids", None))
        side.save_outcomes(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)


def drain_transfer_records(worker: Any) -> list[bytes]:
    """Run in a vLLM worker through ``collective_rpc``: this worker's finished loads since the last call, msgpack
    encoded (``TransferRecord``); empty when the engine runs without the kvpool connector."""
    import msgspec
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    connector = get_kv_transfer_group()
    if not isinstance(connector, KvPoolConnector) or connector.worker_side is None:
        return []
    return [msgspec.msgpack.encode(r) for r in connector.take_transfer_records()]


def _worker_side(worker: Any) -> Any:
    """This vLLM worker's ``WorkerSide`` of the kvpool connector, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector.worker_side if isinstance(connector, KvPoolConnector) else None


def settle_worker(worker: Any, deadline_s: float) -> bool:
    """Run in a vLLM worker through ``collective_rpc`` (tests and benches of multi-process engines): wait (bounded)
    until the loads handed to this worker so far have run."""
    side = _worker_side(worker)
    return side is None or side.wait_loads(deadline_s)


def worker_counters(worker: Any, settle_s: float) -> dict[str, Any] | None:
    """Run in a vLLM worker through ``collective_rpc``: this worker's load and save counters (``stats_dict``) with
    its TP rank, once its staged saves are written (at most ``settle_s``); None without the kvpool connector."""
    side = _worker_side(worker)
    if side is None:
        return None
    side.wait_saves(settle_s)
    return {**side.stats_dict(), "tp_rank": side.tp_rank}
