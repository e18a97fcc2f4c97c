"""Decision records, the bounded audit log, its JSON export, and the metrics they feed."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.decision import AuditLog, DecisionRecord, decode_records
from router.metrics import RouterMetrics
from router.policies.base import Action, Candidate, FetchPlan, PoolHit
from router.policies.runner import PolicyRunner, make_policy
from tests.fakes.router import RouterClock, router_cluster, router_request, router_tier_map


def record(request_id: str, predicted: float = 0.2, best: float = 0.15) -> DecisionRecord:
    plan = FetchPlan("s0", "node-1", "dram", 0, 64)
    alts = (
        Candidate(Action.FETCH, "r1", best, 1024, plan),
        Candidate(Action.FETCH, "r0", predicted, 1024, plan),
        Candidate(Action.RECOMPUTE, "r0", 0.9),
    )
    return DecisionRecord(
        request_id=request_id, policy="cost_based", action=Action.FETCH, replica_id="r0", fetch=plan,
        predicted_ttft_s=predicted, best_predicted_ttft_s=best, alternatives=alts, reason="fetch ...",
        prompt_tokens=1100, block_size=16, hbm_tokens=0, fetched_tokens=1024, decided_at=5.0,
        decision_latency_s=2e-5, tie_break="random 2 of 2",
    )


def test_record_actual_fills_error_and_regret() -> None:
    log = AuditLog(10)
    rec = record("a")
    log.add(rec)
    assert log.record_actual("a", 0.5) is rec
    assert rec.actual_ttft_s == 0.5
    assert rec.prediction_error_s == pytest.approx(0.3) and rec.regret_s == pytest.approx(0.35)
    assert rec.predicted_by_action == {"fetch": 0.15, "recompute": 0.9}
    assert log.record_actual("missing", 0.5) is None
    with pytest.raises(ValueError, match=">= 0"):
        rec.with_actual(-1.0)


def test_audit_log_is_bounded_and_keeps_lookups_consistent() -> None:
    log = AuditLog(3)
    for i in range(5):
        log.add(record(f"r{i}"))
    assert len(log) == 3 and [r.request_id for r in log.recent()] == ["r2", "r3", "r4"]
    assert log.get("r0") is None and log.get("r4") is not None
    assert [r.request_id for r in log.recent(2)] == ["r3", "r4"] and log.recent(0) == []
    # A retried request id: the newest record answers; evicting the old one does not lose the new one.
    log.add(record("r2"))
    newest = log.get("r2")
    log.add(record("x"))
    log.add(record("y"))
    assert log.get("r2") is newest
    with pytest.raises(ValueError):
        AuditLog(0)


def test_json_export_round_trips() -> None:
    log = AuditLog(10)
    log.add(record("a"))
    log.add(record("b"))
    log.record_actual("b", 0.4)
    back = decode_records(log.to_json())
    assert [r.request_id for r in back] == ["a", "b"]
    assert back[1].regret_s == pytest.approx(0.25) and back[0].alternatives[0].fetch == record("a").fetch
    assert back[0].action is Action.FETCH and back[0].version == 1
    assert decode_records(log.to_json(1))[0].request_id == "b"


def test_metrics_from_a_real_runner() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    audit = AuditLog()
    runner = PolicyRunner(
        make_policy("cost_based", rng=random.Random(0), tier_map=router_tier_map()),
        rng=random.Random(1), metrics=metrics, audit=audit, clock=RouterClock(),
    )
    hits = (PoolHit("s0", "node-0", "dram", 512),)
    for i in range(5):
        rec = runner.decide(router_request(8192, request_id=f"q{i}"), router_cluster(2, hits=hits))
        runner.record_actual(rec.request_id, rec.predicted_ttft_s * 1.2)
    metrics.observe_tpot("cost_based", 0.02)
    metrics.set_replica_load("r0", 3, 0.25)
    metrics.set_replica_kv("r0", 6144, 4096)
    text = generate_latest(registry).decode()
    for name in (
        "kvstack_router_requests_total", "kvstack_router_decisions_total", "kvstack_router_ttft_seconds_bucket",
        "kvstack_router_tpot_seconds_bucket", "kvstack_router_prefix_hit_tokens_total",
        "kvstack_router_ttft_prediction_error_seconds_bucket", "kvstack_router_regret_seconds_bucket",
        "kvstack_router_replica_load", "kvstack_router_decision_latency_seconds_bucket",
        "kvstack_router_inflight_assignments", "kvstack_router_replica_kv_capacity_tokens",
        "kvstack_router_replica_kv_held_tokens",
    ):
        assert name in text, name
    get = registry.get_sample_value
    assert get("kvstack_router_requests_total", {"policy": "cost_based"}) == 5
    assert get("kvstack_router_prefix_hit_tokens_total", {"policy": "cost_based", "tier": "dram"}) == 5 * 8192
    assert get("kvstack_router_ttft_prediction_error_ratio_count", {"policy": "cost_based", "action": "fetch"}) == 5
    assert get("kvstack_router_replica_load", {"replica": "r0"}) == 3
    assert get("kvstack_router_replica_kv_held_tokens", {"replica": "r0"}) == 4096
    metrics.forget_replica("r0")
    assert get("kvstack_router_replica_load", {"replica": "r0"}) is None
    assert get("kvstack_router_replica_kv_capacity_tokens", {"replica": "r0"}) is None
    # Two metric sets on two registries do not collide (one per router / test).
    RouterMetrics(CollectorRegistry())
