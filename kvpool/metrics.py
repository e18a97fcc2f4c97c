"""Prometheus metrics of the KV pool, per shard and tier. Names are prefixed ``kvstack_pool_``.

Who calls what: the block store (``kvpool.store``) updates a ``PoolMetrics`` bound to its shard id at every
visible change; the shard actor exposes ``generate_latest`` of its registry (``PoolMetrics.exposition``) and can
serve it over HTTP. Transfer bytes and latency are the transfer layer's own series (``kvstack_transfer_*`` in
``kvpool.transfer.metrics``), observed by every endpoint per call.

The registry is injected: pass ``prometheus_client.REGISTRY`` to export through the process-wide default, or
leave it out to get a private ``CollectorRegistry`` (tests, several shards in one process). Metric families are
created once per registry and shared by every ``PoolMetrics`` bound to it (distinguished by the ``shard`` label).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

PREFIX = "kvstack_pool_"


@dataclass(frozen=True)
class _Families:
    blocks: Gauge
    bytes: Gauge
    model_blocks: Gauge
    capacity_blocks: Gauge
    leases_active: Gauge
    reservations_active: Gauge
    hits: Counter
    misses: Counter
    lookups: Counter
    committed: Counter
    evictions: Counter
    demotions: Counter
    promotions: Counter
    checksum_failures: Counter
    leases_expired: Counter
    reservations_expired: Counter
    refused: Counter


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


def _families(registry: CollectorRegistry) -> _Families:
    fams = _BY_REGISTRY.get(registry)
    if fams is not None:
        return fams
    st = ["shard", "tier"]
    fams = _Families(
        blocks=Gauge(PREFIX + "blocks", "Visible blocks held", st, registry=registry),
        bytes=Gauge(PREFIX + "bytes", "Bytes of visible blocks held", st, registry=registry),
        model_blocks=Gauge(PREFIX + "model_blocks", "Visible blocks held per model (layout fingerprint)",
                           ["shard", "model", "layout", "tier"], registry=registry),
        capacity_blocks=Gauge(PREFIX + "capacity_blocks", "Block slots of the tier", st, registry=registry),
        leases_active=Gauge(
            PREFIX + "leases_active", "Leases not yet released or expired", ["shard"], registry=registry
        ),
        reservations_active=Gauge(
            PREFIX + "reservations_active", "Reservations not yet committed, aborted or expired", ["shard"],
            registry=registry,
        ),
        hits=Counter(PREFIX + "hits", "Blocks leased, by the tier they were found in", st, registry=registry),
        misses=Counter(PREFIX + "misses", "Blocks asked for in a lease and not served", ["shard"], registry=registry),
        lookups=Counter(PREFIX + "lookups", "Lookup calls (side-effect free)", ["shard"], registry=registry),
        committed=Counter(PREFIX + "committed_blocks", "Blocks made visible by commit", ["shard"], registry=registry),
        evictions=Counter(PREFIX + "evictions", "Blocks dropped to make room", st, registry=registry),
        demotions=Counter(PREFIX + "demotions", "Blocks moved DRAM to SSD", ["shard"], registry=registry),
        promotions=Counter(PREFIX + "promotions", "Blocks moved SSD to DRAM on lease", ["shard"], registry=registry),
        checksum_failures=Counter(
            PREFIX + "checksum_failures", "Blocks whose bytes did not match their checksum (treated as a miss)",
            ["shard", "tier", "stage"], registry=registry,
        ),
        leases_expired=Counter(PREFIX + "leases_expired", "Leases ended by expiry", ["shard"], registry=registry),
        reservations_expired=Counter(
            PREFIX + "reservations_expired", "Reservations ended by expiry", ["shard"], registry=registry
        ),
        refused=Counter(PREFIX + "unauthenticated", "Calls refused: no proof of the cluster secret; op tcp_read / "
                        "tcp_write: a TCP transfer of spans no lease or reservation granted the peer",
                        ["shard", "op"], registry=registry),
    )
    _BY_REGISTRY[registry] = fams
    return fams


class PoolMetrics:
    """Metrics of one shard (``shard`` label), in an injectable registry."""

    def __init__(self, shard_id: str, registry: CollectorRegistry | None = None) -> None:
        self.shard_id = shard_id
        self.registry = registry if registry is not None else CollectorRegistry()
        self._f = _families(self.registry)
        self._layout_labels: set[tuple[str, str, str]] = set()

    def set_tier(self, tier: str, blocks: int, nbytes: int, capacity: int) -> None:
        self._f.blocks.labels(self.shard_id, tier).set(blocks)
        self._f.bytes.labels(self.shard_id, tier).set(nbytes)
        self._f.capacity_blocks.labels(self.shard_id, tier).set(capacity)

    def refused(self, op: str) -> None:
        self._f.refused.labels(self.shard_id, op).inc()

    def set_layouts(self, blocks: dict[tuple[str, str, str], int]) -> None:
        """Visible blocks per (model label, layout fingerprint, tier); series of layouts no longer held go."""
        for model, layout, tier in self._layout_labels - set(blocks):
            self._f.model_blocks.remove(self.shard_id, model, layout, tier)
        for (model, layout, tier), n in blocks.items():
            self._f.model_blocks.labels(self.shard_id, model, layout, tier).set(n)
        self._layout_labels = set(blocks)

    def set_active(self, leases: int, reservations: int) -> None:
        self._f.leases_active.labels(self.shard_id).set(leases)
        self._f.reservations_active.labels(self.shard_id).set(reservations)

    def hit(self, tier: str, n: int = 1) -> None:
        self._f.hits.labels(self.shard_id, tier).inc(n)

    def miss(self, n: int = 1) -> None:
        if n:
            self._f.misses.labels(self.shard_id).inc(n)

    def lookup(self) -> None:
        self._f.lookups.labels(self.shard_id).inc()

    def committed(self, n: int) -> None:
        self._f.committed.labels(self.shard_id).inc(n)

    def evicted(self, tier: str, n: int = 1) -> None:
        self._f.evictions.labels(self.shard_id, tier).inc(n)

    def demoted(self, n: int = 1) -> None:
        self._f.demotions.labels(self.shard_id).inc(n)

    def promoted(self, n: int = 1) -> None:
        self._f.promotions.labels(self.shard_id).inc(n)

    def checksum_failure(self, tier: str, stage: str) -> None:
        self._f.checksum_failures.labels(self.shard_id, tier, stage).inc()

    def lease_expired(self, n: int = 1) -> None:
        self._f.leases_expired.labels(self.shard_id).inc(n)

    def reservation_expired(self, n: int = 1) -> None:
        self._f.reservations_expired.labels(self.shard_id).inc(n)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (e.g. ``value("kvstack_pool_checksum_failures_total", tier="ssd", ...)``);
        0.0 when absent. Labels not given are summed over."""
        total = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name != name:
                    continue
                if sample.labels.get("shard", self.shard_id) != self.shard_id:
                    continue
                if all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def exposition(self) -> bytes:
        """Prometheus text format of the whole registry."""
        return generate_latest(self.registry)
