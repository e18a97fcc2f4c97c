"""ReplicaBook: the policies' replica list is kept by the reports (one state rebuilt per change, the same list
otherwise), live replicas only, with the queue model and the calibrated hardware; replicas whose fitted MFUs agree
share one hardware object."""

from __future__ import annotations

import pytest

from router import cost
from router.calibration import MFU_GRID_STEP, Calibrator, snap_mfu
from router.policies.base import ReplicaColumns
from router.replica_book import ReplicaBook
from tests.fakes.router import router_hw

TTL = 10.0


def book(hw=None) -> ReplicaBook:
    base = hw or router_hw()
    return ReplicaBook(ttl_s=TTL, calibrator=Calibrator(bw_util=0.8), hardware=lambda: base)


def fit(cal: Calibrator, rid: str, hw, mfu: float, overhead: float = 0.0) -> None:
    for tokens in (500, 1000, 2000, 4000, 8000, 16000):
        cal.observe_prefill(rid, hw, tokens, 0, overhead + cost.t_prefill(hw.model, hw.gpu, tokens, mfu=mfu))


def test_the_list_is_kept_between_reports_and_one_state_is_rebuilt_per_change() -> None:
    b = book()
    for i in range(4):
        b.report(f"r{i}", f"node-{i % 2}", 0, 0, 0.0, None)
    first = b.states(0.1)
    assert [s.replica_id for s in first] == ["r0", "r1", "r2", "r3"]
    assert b.states(0.2) is first  # nothing changed: the same list, nothing rebuilt
    kept = first[0]
    b.report("r2", "node-0", 3, 1, 0.3, None)
    again = b.states(0.4)
    assert [s.replica_id for s in again] == ["r0", "r1", "r2", "r3"]  # report order kept
    assert again[2].running == 3 and again[2].waiting == 1
    assert again[0] is kept  # untouched replicas keep their state object
    assert all(s.hbm_prefix_blocks == 0 for s in again)  # the index fills HBM prefixes in per request


def test_the_queue_delay_follows_waiting_requests_mean_ttft_and_the_fitted_overhead() -> None:
    b = book()
    b.report("r0", "node-0", 1, 2, 0.0, None)
    assert b.states(0.0)[0].queue_delay_s == 0.0  # no TTFT seen yet
    b.observe_ttft("r0", 0.5)
    assert b.states(0.0)[0].queue_delay_s == pytest.approx(2 * 0.5)
    b.observe_ttft("r0", 1.0)  # EWMA 0.8 · 0.5 + 0.2 · 1.0
    assert b.states(0.0)[0].queue_delay_s == pytest.approx(2 * 0.6)
    hw = router_hw()
    fit(b.calibrator, "r0", hw, mfu=0.3, overhead=0.05)
    b.touch("r0")
    state = b.states(0.0)[0]
    assert state.queue_delay_s == pytest.approx(0.05 + 2 * 0.6, rel=1e-3)
    assert state.hw.mfu == pytest.approx(0.3, rel=MFU_GRID_STEP)


def test_silent_replicas_drop_out_and_come_back_with_their_next_report() -> None:
    b = book()
    b.report("r0", "node-0", 0, 0, 0.0, None)
    b.report("r1", "node-1", 0, 0, 5.0, None)
    assert len(b.states(6.0)) == 2
    assert [s.replica_id for s in b.states(TTL + 1.0)] == ["r1"]  # r0 last heard at 0
    assert list(b.live(TTL + 1.0)) == ["r1"]
    b.report("r0", "node-0", 2, 0, TTL + 2.0, None)
    assert sorted(s.replica_id for s in b.states(TTL + 2.5)) == ["r0", "r1"]
    b.report("r0", "node-0", 2, 0, 2 * TTL, None)
    assert [s.replica_id for s in b.states(2 * TTL + 6.0)] == ["r0"]  # r1 last heard at 5
    b.forget("r0")
    assert b.states(2 * TTL + 6.0) == []


def test_a_new_base_hardware_reaches_every_state() -> None:
    current = {"hw": router_hw(gpu="h100-sxm5-80gb")}
    b = ReplicaBook(ttl_s=TTL, calibrator=Calibrator(bw_util=0.8), hardware=lambda: current["hw"])
    b.report("r0", "node-0", 0, 0, 0.0, None)
    assert b.states(0.0)[0].hw is current["hw"]
    current["hw"] = router_hw(gpu="a100-sxm4-80gb")
    b.touch_all()
    assert b.states(0.0)[0].hw is current["hw"]


def test_replicas_whose_fits_agree_within_the_grid_share_one_hardware_object() -> None:
    hw = router_hw()
    cal = Calibrator(bw_util=0.8)
    fit(cal, "a", hw, mfu=0.300)
    fit(cal, "b", hw, mfu=0.301)
    fit(cal, "c", hw, mfu=0.5)  # faster than its fleet by more than ``SAME_SPEED_BAND``: its own fit
    a, b, c = (cal.hardware(r, hw) for r in "abc")
    assert a is b and a is not c  # one object for a and b: the policy prices it once per request
    assert a.mfu == snap_mfu(0.300) and a.mfu == pytest.approx(0.3, rel=MFU_GRID_STEP)
    assert cal.hardware("unfitted", hw) in (a, c)  # the fleet's median fit until its own is ready
    assert snap_mfu(1.0) == 1.0 and snap_mfu(0.9999) <= 1.0


def test_the_queue_is_the_prefill_of_the_reported_waiting_work_priced_with_the_replica_hardware() -> None:
    b = book()
    hw = router_hw()
    # two waiting requests: 6,000 tokens with 2,000 planned to be reused, and a cold 3,000
    work = (4000 + 3000, 6000**2 - 2000**2 + 3000**2)
    b.report("r0", "node-0", 1, 2, 0.0, None, waiting_work=work)
    b.observe_ttft("r0", 9.0)  # the mean TTFT no longer counts when the work is reported
    expected = (cost.t_prefill(hw.model, hw.gpu, 6000, mfu=hw.mfu, cached_tokens=2000)
                + cost.t_prefill(hw.model, hw.gpu, 3000, mfu=hw.mfu))
    assert b.states(0.0)[0].queue_delay_s == pytest.approx(expected, rel=1e-9)
    fit(b.calibrator, "r0", hw, mfu=0.25, overhead=0.02)  # a slower replica: the same work takes longer
    b.touch("r0")
    slow = b.states(0.0)[0]
    assert slow.queue_delay_s == pytest.approx(0.02 + expected * hw.mfu / slow.hw.mfu, rel=1e-3)
    b.report("r0", "node-0", 3, 0, 1.0, None, waiting_work=(0, 0))
    assert b.states(1.0)[0].queue_delay_s == pytest.approx(0.02, rel=1e-3)  # nothing waiting: the overhead only


def test_the_columns_follow_the_list_through_reports_patches_expiry_and_forgetting() -> None:
    """``view``'s columns are the list's replicas as columns after every kind of change: a new replica (the list
    rebuilt), a few changed ones (patched in place, the same column objects), a calibration moving one replica's
    hardware, a replica falling silent, one forgotten."""
    b = book()
    for i in range(8):
        b.report(f"r{i}", f"node-{i % 3}", i, i % 2, 0.0, None)

    def check(now: float) -> ReplicaColumns:
        states, cols = b.view(now)
        assert states is b.states(now)
        assert cols == ReplicaColumns.of(states)
        return cols

    first = check(0.1)
    b.report("r3", "node-2", 5, 3, 0.2, None)  # one of eight: patched in place
    b.observe_ttft("r3", 0.4)
    assert check(0.3) is first
    fit(b.calibrator, "r5", router_hw(), mfu=0.25, overhead=0.01)
    b.touch("r5")
    cols = check(0.4)
    assert cols is first and cols.hws[5] is b.states(0.4)[5].hw and cols.queues[5] > 0
    b.report("r8", "node-0", 0, 0, 0.5, None)  # a new replica: rebuilt
    assert check(0.6) is not first
    for i in range(9):
        if i != 2:
            b.report(f"r{i}", f"node-{i % 3}", 0, 0, TTL + 1.0, None)
    assert [s.replica_id for s in b.states(TTL + 1.5)] == [f"r{i}" for i in range(9) if i != 2]  # r2 fell silent
    check(TTL + 1.5)
    b.forget("r7")
    check(TTL + 1.6)
