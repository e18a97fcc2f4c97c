"""Pool metrics (kvpool/metrics.py): names, labels, injectable registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvpool.metrics import PREFIX, PoolMetrics


def test_shards_share_an_injected_registry_by_label() -> None:
    reg = CollectorRegistry()
    a, b = PoolMetrics("a", reg), PoolMetrics("b", reg)
    a.checksum_failure("ssd", "lease")
    a.checksum_failure("ssd", "lease")
    b.checksum_failure("dram", "commit")
    a.set_tier("dram", 3, 300, 8)
    assert a.value("kvstack_pool_checksum_failures_total", tier="ssd") == 2
    assert b.value("kvstack_pool_checksum_failures_total") == 1
    assert a.value("kvstack_pool_blocks", tier="dram") == 3
    text = a.exposition().decode()
    assert 'kvstack_pool_checksum_failures_total{shard="a",stage="lease",tier="ssd"} 2.0' in text


def test_private_registry_by_default_and_every_name_prefixed() -> None:
    m1, m2 = PoolMetrics("x"), PoolMetrics("x")
    m1.hit("dram", 5)
    assert m2.value("kvstack_pool_hits_total") == 0  # separate registries: no cross-talk
    m1.evicted("ssd", 2)
    names = {s.name for fam in m1.registry.collect() for s in fam.samples}
    assert names and all(n.startswith(PREFIX) for n in names)
    assert m1.value("kvstack_pool_evictions_total", tier="ssd") == 2
