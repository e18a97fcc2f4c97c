"""KV-cache admission, both halves: the replica's model of what its in-flight requests hold and when they free it
(``deployments.kv_occupancy``), the router's wait for a request that does not fit (``router.kv_admission``), the
book and the runner that carry it to the policy, and ``cost_based`` pricing it (a replica short of KV for the
prompt costs the wait until its running requests end; a holder needs no new blocks for the part of its HBM prefix
that running requests hold, and all of them for a prefix that is only cached)."""

from __future__ import annotations

import random

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from deployments.kv_occupancy import KvOccupancyTracker
from router.calibration import Calibrator
from router.hub import KvOccupancy, KvRelease, ReplicaReport
from router.kv_admission import KvAdmission, key_id
from router.metrics import RouterMetrics
from router.policies.base import Action, ClusterSnapshot, ReplicaColumns, RouteRequest
from router.policies.cost_based import CostBased
from router.policies.runner import PolicyRunner
from router.replica_book import ReplicaBook
from tests.fakes.router import RouterClock, router_hw, router_keys, router_replica, router_tier_map

BS = 4


# ---- the replica's half ----------------------------------------------------------------------------------------


def _tracker_with_rate() -> KvOccupancyTracker:
    """A tracker that has seen one request finish: 0.1 s per output token after the first, 11 output tokens."""
    t = KvOccupancyTracker(BS, capacity_tokens=40)
    t.start("done", [b"z"], 4, 50)
    t.generated("done", 1, now=0.0)
    t.generated("done", 10, now=1.0)
    t.end("done", now=1.0)
    assert t.decode_s_per_token == pytest.approx(0.1) and t.output_tokens == 11
    return t


def test_unknown_capacity_reports_nothing() -> None:
    t = KvOccupancyTracker(BS)
    t.start("r", [b"a"], 4, 8)
    assert t.occupancy() is None
    t.set_capacity(64)
    assert t.occupancy() == KvOccupancy(capacity_tokens=64, held_tokens=4, releases=[KvRelease(0.0, 4)],
                                        pinned=[key_id(b"a")])


def test_shared_blocks_are_held_once_and_freed_by_their_last_holder() -> None:
    t = _tracker_with_rate()
    t.start("long", [b"a", b"b", b"c"], 14, 20)  # 3 full blocks + 2 tokens: one tail block
    t.start("short", [b"a", b"b", b"d"], 12, 5)  # shares a and b
    occ = t.occupancy()
    assert occ is not None and occ.capacity_tokens == 40
    assert occ.held_tokens == 4 * BS + BS  # a, b, c, d once, plus long's tail block
    assert sorted(occ.pinned or []) == sorted(key_id(k) for k in (b"a", b"b", b"c", b"d"))
    # short ends first (5 tokens left, 0.5 s): only d is its own; long (min(20, 11 expected) tokens, 1.1 s) frees
    # its tail and a, b, c.
    assert occ.releases == [KvRelease(pytest.approx(0.5), BS), KvRelease(pytest.approx(1.1), 4 * BS)]
    assert sum(r.tokens for r in occ.releases) == occ.held_tokens


def test_generated_tokens_grow_the_tail_and_shorten_the_wait() -> None:
    t = _tracker_with_rate()
    t.start("r", [b"a"], 4, 30)
    t.generated("r", 1, now=2.0)
    t.generated("r", 6, now=2.6)
    occ = t.occupancy()
    assert occ is not None
    assert occ.held_tokens == BS + 2 * BS  # 4 prompt + 7 generated tokens: a and two more blocks
    assert occ.releases == [KvRelease(pytest.approx(0.4), 3 * BS)]  # 11 expected − 7 generated at 0.1 s
    t.end("r", now=3.0)
    assert len(t) == 0 and t.occupancy() == KvOccupancy(capacity_tokens=40, held_tokens=0, releases=[], pinned=[])


def test_an_aborted_request_frees_its_kv_and_teaches_nothing() -> None:
    t = _tracker_with_rate()
    t.start("gone", [b"a"], 4, 500)
    t.generated("gone", 1, now=2.0)
    t.generated("gone", 2, now=5.0)  # 1.5 s per token: a stalled client, cut off
    t.end("gone", now=5.0, finished=False)
    assert len(t) == 0 and t.decode_s_per_token == pytest.approx(0.1) and t.output_tokens == 11


def test_the_report_carries_it_on_the_wire() -> None:
    occ = KvOccupancy(capacity_tokens=6144, held_tokens=4608, releases=[KvRelease(0.2, 2304), KvRelease(0.9, 2304)],
                      pinned=[key_id(k) for k in router_keys(36)])
    report = ReplicaReport(replica_id="r", node_id="n", seq=1, running=2, waiting=0, kv=occ)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=ReplicaReport)
    assert back.kv == occ
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.structs.replace(report, kv=None)), type=ReplicaReport)
    assert old.kv is None


# ---- the router's half -----------------------------------------------------------------------------------------


def _admission(free: int, releases: list[tuple[float, int]], sent_at: float = 100.0,
               pinned: list[bytes] | None = None) -> KvAdmission:
    held = 6144 - free
    return KvAdmission.of(KvOccupancy(capacity_tokens=6144, held_tokens=held,
                                      releases=[KvRelease(e, n) for e, n in releases],
                                      pinned=None if pinned is None else [key_id(k) for k in pinned]), sent_at)


def test_wait_is_zero_when_it_fits_else_until_enough_is_freed() -> None:
    k = _admission(1536, [(0.3, 2304), (0.9, 2304)])
    assert k.wait_s(1500, now=100.0) == 0.0
    assert k.wait_s(2240, now=100.0) == pytest.approx(0.3)  # 1536 + 2304 after the first ends
    assert k.wait_s(2240, now=100.2) == pytest.approx(0.1)  # the clock moved on
    assert k.wait_s(4000, now=100.0) == pytest.approx(0.9)  # both must end
    assert k.wait_s(9000, now=100.0) == pytest.approx(0.9)  # never fits: at most until everything ended
    assert k.wait_s(2240, now=101.0) == 0.0  # past the release times: nothing left to wait for
    assert k.claimed(1000).wait_s(1000, now=100.0) == pytest.approx(0.3)  # an assignment not reported yet
    assert _admission(0, []).wait_s(100, now=100.0) == 0.0  # nothing in flight: nothing to wait for


def test_pinned_blocks_is_the_longest_held_run_of_the_chain() -> None:
    keys = router_keys(20)
    assert _admission(0, [], pinned=keys[:7]).pinned_blocks(keys, 15) == 7
    assert _admission(0, [], pinned=keys[:7]).pinned_blocks(keys, 5) == 5  # only what the replica's HBM holds
    assert _admission(0, [], pinned=keys).pinned_blocks(keys, 15) == 15
    assert _admission(0, [], pinned=router_keys(7, salt="other")).pinned_blocks(keys, 15) == 0
    assert _admission(0, []).pinned_blocks(keys, 15) == 0  # not reported: nothing counted as held


def test_the_book_carries_it_into_states_and_columns() -> None:
    base = router_hw()
    b = ReplicaBook(ttl_s=10.0, calibrator=Calibrator(bw_util=0.8), hardware=lambda: base)
    for i in range(8):
        b.report(f"r{i}", "n", 0, 0, 0.0, None)
    states, cols = b.view(0.1)
    assert cols.kv == [None] * 8
    k = _admission(0, [(0.5, 2304)])
    b.report("r3", "n", 2, 0, 0.2, None, kv=k)  # one of eight changed: patched in place
    states, cols = b.view(0.3)
    assert states[3].kv is k and cols.kv[3] is k and cols.kv == ReplicaColumns.of(states).kv


# ---- pricing ---------------------------------------------------------------------------------------------------


def _request(prompt: int = 2000, rid: str = "q") -> RouteRequest:
    return RouteRequest(rid, prompt, 128, router_keys(prompt // 128))


def _snapshot(*replicas, now: float = 100.0) -> ClusterSnapshot:
    return ClusterSnapshot(list(replicas), (), ReplicaColumns.of(replicas), now=now)


def _policy() -> CostBased:
    return CostBased(tier_map=router_tier_map(), rng=random.Random(0))


def test_a_replica_short_of_kv_costs_the_wait_and_loses() -> None:
    full = router_replica("full", kv=_admission(500, [(1.0, 3000)]))
    free = router_replica("free", kv=_admission(6144, []))
    ranking = _policy().rank(_request(), _snapshot(full, free))
    best = ranking.candidates[0]
    assert best.replica_id == "free" and "kv admission" not in ranking.reason
    alone = _policy().rank(_request(), _snapshot(full)).candidates[0]
    assert alone.predicted_ttft_s == pytest.approx(best.predicted_ttft_s + 1.0)
    # without the KV report both cost the same
    plain = _policy().rank(_request(), _snapshot(router_replica("full"), router_replica("free")))
    assert plain.candidates[0].predicted_ttft_s == pytest.approx(best.predicted_ttft_s)
    assert len({c.replica_id for c in plain.candidates}) == 2  # a tie: both in the window


def test_the_reason_names_the_wait() -> None:
    full = router_replica("full", kv=_admission(500, [(1.0, 3000)]))
    ranking = _policy().rank(_request(), _snapshot(full))
    assert "queue 0.0000 + kv admission 1.0000" in ranking.reason


def test_a_holder_needs_only_what_running_requests_do_not_hold_of_its_prefix() -> None:
    keys = _request().block_keys
    # 15 of the prompt's blocks in HBM, held by a running request: 80 new tokens fit in the 200 free; the other
    # replica has no room at all
    holder = router_replica("holder", hbm_prefix_blocks=15, kv=_admission(200, [(1.0, 3000)], pinned=keys[:15]))
    other = router_replica("other", kv=_admission(0, [(1.0, 3000)]))
    ranking = _policy().rank(_request(), _snapshot(holder, other))
    best = ranking.candidates[0]
    assert (best.replica_id, best.action) == ("holder", Action.HOLDER)
    assert "kv admission" not in ranking.reason
    # a holder short even of its suffix waits too
    tight = router_replica("holder", hbm_prefix_blocks=15, kv=_admission(50, [(0.4, 3000)], pinned=keys[:15]))
    r2 = _policy().rank(_request(), _snapshot(tight))
    assert r2.candidates[0].action is Action.HOLDER and "kv admission 0.4000" in r2.reason
    # cached but held by no request (evictable): vLLM allocates those blocks again, the whole prompt must fit
    cached = router_replica("holder", hbm_prefix_blocks=15, kv=_admission(200, [(0.7, 3000)], pinned=keys[:3]))
    r3 = _policy().rank(_request(), _snapshot(cached))
    assert r3.candidates[0].action is Action.HOLDER and "kv admission 0.7000" in r3.reason


def test_the_runner_counts_its_assignments_kv_until_a_report_counts_them() -> None:
    clock = RouterClock(100.0)
    registry = CollectorRegistry()
    runner = PolicyRunner(_policy(), rng=random.Random(0), clock=clock, metrics=RouterMetrics(registry))
    k = _admission(3000, [(1.0, 3000)])
    snap = _snapshot(router_replica("a", kv=k), router_replica("b", kv=k))
    first = runner.decide(_request(rid="1"), snap)
    runner.record_actual("1", 0.1)  # its prefill is done: only its KV still counts
    assert runner.kv_claimed(first.replica_id) == 2000
    claimed = {"replica": first.replica_id}
    assert registry.get_sample_value("kvstack_router_kv_claimed_tokens", claimed) == 2000
    second = runner.decide(_request(rid="2"), snap)
    assert second.replica_id != first.replica_id  # the first replica has 1000 tokens left for 2000
    runner.acknowledge("1")  # finished (or a report counts it): the claim goes
    assert runner.kv_claimed(first.replica_id) == 0
    assert registry.get_sample_value("kvstack_router_kv_claimed_tokens", claimed) == 0
    runner.acknowledge_replica(second.replica_id, decided_before=clock() + 1)
    assert runner.kv_claimed(second.replica_id) == 0
    runner.decide(_request(rid="3"), snap)
    clock.advance(runner.inflight_ttl_s + 0.1)
    assert runner.kv_claimed("a") == runner.kv_claimed("b") == 0  # expired
