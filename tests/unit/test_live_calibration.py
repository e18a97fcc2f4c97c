"""Live tier calibration: replica reports carry pool fetch timings; every router fits its tier prices to them.

The real ``LiveView`` (no Ray: the hub reply is built here, the shard list is set directly) and the real policy.
"""

from __future__ import annotations

import time

import pytest

from kvpool.shard.client import ShardEventSource
from router.hub import HubState, PollReply, ReplicaReport, TransferSample
from router.ingress_settings import IngressSettings, OpenAIFrontendSettings
from router.access import AccessSettings
from router.live_view import LiveView

BW_UTIL = 0.7


def make_view() -> LiveView:
    settings = IngressSettings(
        served_model_name="m", model_path="/nonexistent", engine_args={"model": "/nonexistent"},
        max_model_len=4096, block_size=16, cache_salt="",
        policy="cost_based", model_spec="qwen3-14b", gpu_profile="h100-sxm5-80gb", mfu=0.4, bw_util=BW_UTIL, seed=0,
        tiers={"local_dram": "cpu-dram", "remote_dram": "rdma-pool", "local_ssd": "local-ssd"},
        dtype="bfloat16", reasoning_parser=None, openai=OpenAIFrontendSettings(), access=AccessSettings(),
    )
    view = LiveView.from_settings(settings)
    view.shard_sync.set_shards([(ShardEventSource(None, sid), node) for sid, node in [("shard-a", "node-a"),
                                                                                       ("shard-b", "node-b")]])
    return view


def report(seq: int, transfers: list[TransferSample], node: str = "node-a") -> ReplicaReport:
    return ReplicaReport(replica_id="r1", node_id=node, seq=seq, running=0, waiting=0, transfers=transfers)


def remote_dram_samples(n: int, gbps: float, latency_s: float) -> list[TransferSample]:
    """Fetches of 1..n MB from shard-b (another node than the replica's), DRAM."""
    return [TransferSample("shard-b", False, int(k * 1e6), latency_s + k * 1e6 / (gbps * 1e9)) for k in range(1, n + 1)]


def test_fetch_timings_recalibrate_the_policy_prices_after_enough_samples() -> None:
    view = make_view()
    configured = view.runner.policy._pricer.tier_map.dram_remote  # type: ignore[attr-defined]
    view.apply(PollReply(cursor=1, reports=[report(1, remote_dram_samples(3, gbps=0.5, latency_s=0.004))]))
    assert view.runner.policy._pricer.tier_map.dram_remote == configured  # type: ignore[attr-defined]
    view.apply(PollReply(cursor=2, reports=[report(2, remote_dram_samples(6, gbps=0.5, latency_s=0.004))]))
    priced = view.runner.policy._pricer.tier_map.dram_remote  # type: ignore[attr-defined]
    assert priced != configured
    assert priced.bandwidth_gbps * BW_UTIL == pytest.approx(0.5, rel=1e-3)  # effective bandwidth, as measured
    assert priced.latency_s == pytest.approx(0.004, rel=1e-3)
    rows = {r["tier_class"]: r for r in view.calibration_rows()}
    assert rows["dram_remote"]["calibrated"] and rows["dram_remote"]["observed"] == 9
    assert not rows["dram_local"]["calibrated"] and rows["dram_local"]["observed"] == 0
    text = view.registry.get_sample_value("kvstack_router_tier_bandwidth_bytes_per_second",
                                          {"tier_class": "dram_remote"})
    assert text == pytest.approx(0.5e9, rel=1e-3)
    assert view.registry.get_sample_value("kvstack_router_observed_transfers_total", {"tier_class": "dram_remote"}) == 9


def test_samples_are_classed_by_storage_tier_and_by_the_shards_node() -> None:
    view = make_view()
    local_ssd = [TransferSample("shard-a", True, int(k * 1e6), 0.01 + k * 1e6 / 2e9) for k in range(1, 7)]
    view.apply(PollReply(cursor=1, reports=[report(1, local_ssd)]))
    rows = {r["tier_class"]: r for r in view.calibration_rows()}
    assert rows["ssd_local"]["observed"] == 6 and rows["ssd_local"]["calibrated"]
    assert rows["ssd_local"]["bandwidth_gbps"] == pytest.approx(2.0, rel=1e-3)
    assert all(rows[c]["observed"] == 0 for c in ("dram_local", "dram_remote", "ssd_remote"))
    # The same shard seen from a replica on another node is a remote fetch.
    view.apply(PollReply(cursor=2, reports=[report(2, local_ssd[:2], node="node-c")]))
    assert {r["tier_class"]: r for r in view.calibration_rows()}["ssd_remote"]["observed"] == 2


def test_fetches_from_unknown_shards_or_empty_ones_are_not_used() -> None:
    view = make_view()
    view.apply(PollReply(cursor=1, reports=[report(1, [TransferSample("shard-zz", False, 1000, 0.01),
                                                       TransferSample("shard-a", False, 0, 0.01)])]))
    assert view.transfers_unplaced == 2
    assert all(r["observed"] == 0 for r in view.calibration_rows())


def test_decisions_price_fetches_with_the_calibrated_tier() -> None:
    """A pool hit on another node: FETCH is priced with the configured remote DRAM tier first; after the replicas
    report that such fetches are 100x slower, the same request is priced (and decided) differently."""
    from tests.fakes.router import router_keys

    view = make_view()
    keys = router_keys(2048)
    view.index.apply_shard_snapshot(_shard_snapshot("shard-b", keys), "node-b")
    view.apply(PollReply(cursor=1, reports=[report(1, [])]))
    tokens = list(range(2048 * 16))

    def fetch_price() -> float:
        from router.policies.base import RouteRequest

        req = RouteRequest("q", len(tokens), 16, keys)
        ranking = view.runner.policy.rank(req, view.index.snapshot(req, view.book.states(time.monotonic())))
        return min(c.predicted_ttft_s for c in ranking.candidates if str(c.action) == "fetch")

    before = fetch_price()
    view.apply(PollReply(cursor=2, reports=[report(2, remote_dram_samples(8, gbps=0.05, latency_s=0.2))]))
    after = fetch_price()
    assert after > before + 0.2


def _shard_snapshot(shard_id: str, keys: list[bytes]):  # noqa: ANN202
    from kvpool.events import EVENTS_WIRE_VERSION, ShardSnapshot, Tier

    return ShardSnapshot(EVENTS_WIRE_VERSION, shard_id, "e1", 1, list(keys), [Tier.DRAM] * len(keys))


def test_hub_snapshots_do_not_replay_transfers() -> None:
    hub = HubState()
    hub.publish(report(1, remote_dram_samples(2, gbps=1.0, latency_s=0.001)))
    assert len(hub.poll(0).reports[0].transfers) == 2
    snap = hub.poll(-1)
    assert snap.snapshot and snap.reports[0].transfers == []


def test_a_sample_with_its_read_is_fitted_on_the_read_and_a_read_out_of_range_is_not_used() -> None:
    """The replica reports each fetch's read apart from its wait (``TransferSample.read_s``): the policy prices the
    reads' bandwidth plus the median wait; a read that does not lie within its sample's seconds is ignored (the
    sample is fitted whole)."""
    view = make_view()
    waits = [0.01, 0.8, 0.02, 1.1, 0.015, 1.4]
    samples = [TransferSample("shard-b", False, int(k * 1e6), w + 0.002 + k * 1e6 / 2e9,
                              read_s=0.002 + k * 1e6 / 2e9) for k, w in enumerate(waits, start=1)]
    view.apply(PollReply(cursor=1, reports=[report(1, samples)]))
    priced = view.runner.policy._pricer.tier_map.dram_remote  # type: ignore[attr-defined]
    assert priced.bandwidth_gbps * BW_UTIL == pytest.approx(2.0, rel=1e-3)
    assert priced.latency_s == pytest.approx(0.002 + (0.02 + 0.8) / 2, rel=1e-3)

    other = make_view()
    bad = [TransferSample("shard-b", False, int(k * 1e6), 0.004 + k * 1e6 / 0.5e9, read_s=9.0) for k in range(1, 7)]
    other.apply(PollReply(cursor=1, reports=[report(1, bad)]))
    priced = other.runner.policy._pricer.tier_map.dram_remote  # type: ignore[attr-defined]
    assert priced.bandwidth_gbps * BW_UTIL == pytest.approx(0.5, rel=1e-3)  # the whole seconds, as before
