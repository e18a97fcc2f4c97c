"""Prometheus metrics of the transfer layer (``kvstack_transfer_*``).

Every endpoint (``kvpool.transfer.nixl``, ``kvpool.transfer.tcp``) calls ``TransferMetrics.observe`` once per
``read``/``write`` call. Build one ``TransferMetrics`` per registry: ``transfer_metrics()`` returns the shared
instance on the global registry (prometheus refuses to register a name twice); tests pass their own
``CollectorRegistry``.

Series (labels ``backend`` = nixl|tcp, ``direction`` = read|write):
- ``kvstack_transfer_bytes_total``        bytes of ops that completed
- ``kvstack_transfer_ops_total``          ops attempted
- ``kvstack_transfer_failed_ops_total``   ops reported failed (dead/frozen/unknown peer, deadline, error)
- ``kvstack_transfer_seconds``            histogram of wall seconds per call (one call = one batch)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from kvpool.transfer.base import TransferResult

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["backend", "direction"]
        self.bytes = Counter(
            "kvstack_transfer_bytes", "Bytes moved by completed transfer ops", labels, registry=registry
        )
        self.ops = Counter("kvstack_transfer_ops", "Transfer ops attempted", labels, registry=registry)
        self.failed_ops = Counter(
            "kvstack_transfer_failed_ops", "Transfer ops reported failed", labels, registry=registry
        )
        self.seconds = Histogram(
            "kvstack_transfer_seconds",
            "Wall seconds per transfer call (one batch of ops)",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

        self._children: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}

    def observe(self, backend: str, direction: str, result: TransferResult) -> None:
        n = len(result.ok) + len(result.failed)
        if n == 0:
            return
        children = self._children.get((backend, direction))
        if children is None:
            children = (
                self.ops.labels(backend, direction),
                self.bytes.labels(backend, direction),
                self.failed_ops.labels(backend, direction),
                self.seconds.labels(backend, direction),
            )
            self._children[(backend, direction)] = children
        ops, moved, failed, seconds = children
        ops.inc(n)
        if result.bytes_moved:
            moved.inc(result.bytes_moved)
        if result.failed:
            failed.inc(len(result.failed))
        seconds.observe(result.seconds)


_shared: weakref.WeakKeyDictionary[CollectorRegistry, TransferMetrics] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def transfer_metrics(registry: CollectorRegistry = REGISTRY) -> TransferMetrics:
    """The one ``TransferMetrics`` of ``registry`` (created on first use)."""
    with _shared_lock:
        metrics = _shared.get(registry)
        if metrics is None:
            metrics = TransferMetrics(registry)
            _shared[registry] = metrics
        return metrics
