"""Tenant cache isolation in the router: one salt per request (engine salt, tenant, the client's ``cache_salt``), and
every key the router computes, matches and lists under it (issue 16, item 2).

The real ``LiveView`` and cost-based policy, fed replica reports as the hub sends them (no Ray); the keys the
replica reports are computed the way ``deployments.kv_events`` computes them from vLLM's events. The end-to-end
proof (vLLM's own HBM cache, the pool, ``cached_tokens``) is ``tests/e2e/test_serve_access.py``.
"""

from __future__ import annotations

from kvpool.keys import chain_keys, request_salt
from router.hub import PollReply, ReplicaReport
from router.wire import routing_root
from tests.unit.test_live_calibration import make_view

PROMPT = list(range(1000, 1000 + 16 * 40))  # 40 blocks of 16


def _holder_report(view, salt: str, layout: str = "") -> ReplicaReport:
    """Replica r1 holds PROMPT in HBM, stored under ``salt`` (the keys its KV events give)."""
    root = routing_root(view.settings.served_model_name, salt, layout or view.layout_fingerprint)
    keys = [bytes(k) for k in chain_keys(root, PROMPT, 16)]
    return ReplicaReport(replica_id="r1", node_id="node-a", seq=1, running=0, waiting=0, stored=keys, full=True,
                         layout_fingerprint=layout)


def _with_idle_second_replica(view, report: ReplicaReport) -> None:
    other = ReplicaReport(replica_id="r2", node_id="node-b", seq=1, running=0, waiting=0, full=True,
                          layout_fingerprint=report.layout_fingerprint)
    view.apply(PollReply(cursor=1, reports=[report, other]))


def test_another_tenants_prefix_is_never_a_holder_and_its_keys_differ() -> None:
    view = make_view()
    _with_idle_second_replica(view, _holder_report(view, request_salt("", "alice")))
    alice, alice_keys = view.decide("a-1", PROMPT, tenant="alice")
    bob, bob_keys = view.decide("b-1", PROMPT, tenant="bob")
    anon, anon_keys = view.decide("n-1", PROMPT)
    assert alice.action == "holder" and alice.target_replica == "r1" and alice.planned_reuse_tokens > 0
    assert alice.cache_salt == request_salt("", "alice")
    for routed, keys in ((bob, bob_keys), (anon, anon_keys)):
        assert routed.action != "holder" and routed.planned_reuse_tokens == 0
        assert not set(keys) & set(alice_keys)
    assert anon.cache_salt == ""  # no tenant, no salt of its own: the engine's (none here)


def test_a_clients_own_salt_is_a_namespace_of_its_own() -> None:
    view = make_view()
    _with_idle_second_replica(view, _holder_report(view, request_salt("", "alice", "conversation-7")))
    same, _ = view.decide("a-1", PROMPT, tenant="alice", client_salt="conversation-7")
    other, _ = view.decide("a-2", PROMPT, tenant="alice", client_salt="conversation-8")
    unsalted, _ = view.decide("a-3", PROMPT, tenant="alice")
    bob_same_salt, _ = view.decide("b-1", PROMPT, tenant="bob", client_salt="conversation-7")
    assert same.action == "holder"
    assert {other.action, unsalted.action, bob_same_salt.action}.isdisjoint({"holder"})


def test_the_reported_layout_is_adopted_for_every_salt() -> None:
    view = make_view()
    _with_idle_second_replica(view, _holder_report(view, request_salt("", "alice"), layout="fp-registered"))
    assert view.layout_fingerprint == "fp-registered"
    routed, keys = view.decide("a-1", PROMPT, tenant="alice")
    assert routed.action == "holder"
    assert keys[0] == bytes(chain_keys(routing_root("m", request_salt("", "alice"), "fp-registered"), PROMPT, 16)[0])


def test_decision_lists_are_per_tenant() -> None:
    view = make_view()
    _with_idle_second_replica(view, _holder_report(view, ""))
    for i in range(3):
        view.decide(f"a-{i}", PROMPT, tenant="alice")
    view.decide("b-0", PROMPT, tenant="bob")
    assert [d["request_id"] for d in view.recent_decisions(10, "bob")] == ["b-0"]
    assert [d["request_id"] for d in view.recent_decisions(2, "alice")] == ["a-1", "a-2"]
    assert {d["tenant"] for d in view.decision_summaries(10)} == {"alice", "bob"}
    assert [d["tenant"] for d in view.decision_summaries(10, "bob")] == ["bob"]
    assert len(view.recent_decisions(10)) == 4
