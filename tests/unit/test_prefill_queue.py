"""PrefillQueue (the replica's waiting prefill work and the oldest one's progress) and the routers' use of it: the
work sums, the oldest request's elapsed time from the later of its arrival and the last first output, and the
report's head aged on arrival by ``LiveView`` before ``ReplicaBook`` prices the queue."""

from __future__ import annotations

import time

import pytest

from deployments.prefill_queue import PrefillQueue
from router import cost
from router.hub import PollReply, PrefillHead, ReplicaReport
from router.live_view import aged_head
from tests.unit.test_live_calibration import make_view


def test_the_work_sums_follow_the_waiting_requests() -> None:
    q = PrefillQueue()
    assert q.waiting == 0 and q.head(5.0) is None
    a = q.add(2000, 1500, now=1.0)  # a revisit: 500 tokens to compute over a 1,500-token prefix
    b = q.add(1000, 0, now=1.5)
    c = q.add(300, 900, now=1.6)  # a planned reuse longer than the prompt is clamped: nothing to compute
    assert q.waiting == 3
    assert (q.tokens, q.tokens_sq) == (500 + 1000, 2000**2 - 1500**2 + 1000**2)
    q.drop(c)
    q.drop(c)  # gone already: ignored
    q.first_output(a, now=2.0)
    assert q.waiting == 1 and (q.tokens, q.tokens_sq) == (1000, 1000**2)
    q.first_output(b, now=3.0)
    assert q.waiting == 0 and (q.tokens, q.tokens_sq) == (0, 0)


def test_the_oldest_request_is_timed_from_the_later_of_its_arrival_and_the_last_first_output() -> None:
    q = PrefillQueue()
    a = q.add(2000, 0, now=10.0)
    b = q.add(500, 0, now=11.0)
    assert q.head(14.0) == PrefillHead(tokens=2000, tokens_sq=2000**2, elapsed_s=4.0)  # the engine took a on arrival
    q.first_output(a, now=16.0)
    assert q.head(16.5) == PrefillHead(tokens=500, tokens_sq=500**2, elapsed_s=0.5)  # b began when a was done
    q.first_output(b, now=17.0)
    c = q.add(100, 0, now=20.0)  # an idle engine takes a new request on arrival
    assert q.head(20.25).elapsed_s == pytest.approx(0.25)
    assert q.head(19.0).elapsed_s == 0.0  # a clock read before the arrival: nothing done, never negative
    q.drop(c)


def test_the_router_takes_the_oldest_prefills_progress_off_the_queue_it_prices() -> None:
    """A cold 2,000-token prefill that has run for part of its time, a 500-token one behind it: the queue a new
    request sees is what is left of the first plus the second; past its predicted end, the second alone."""
    view = make_view()
    hw = view.hardware
    first = cost.t_prefill(hw.model, hw.gpu, 2000, mfu=hw.mfu, attn_scale=hw.attn_scale)
    second = cost.t_prefill(hw.model, hw.gpu, 500, mfu=hw.mfu, attn_scale=hw.attn_scale)

    def queue(seq: int, head: PrefillHead | None) -> float:
        view.apply(PollReply(cursor=seq, reports=[ReplicaReport(
            replica_id="r1", node_id="node-a", seq=seq, running=0, waiting=2, waiting_tokens=2500,
            waiting_tokens_sq=2000**2 + 500**2, head=head)]))
        return view.book.states(time.monotonic())[0].queue_delay_s

    overhead = view.book.calibrator.overhead_s("r1")
    assert queue(1, None) == pytest.approx(overhead + first + second, rel=1e-6)  # not reported: the whole work
    assert queue(2, PrefillHead(tokens=2000, tokens_sq=2000**2, elapsed_s=0.4 * first)) == pytest.approx(
        overhead + 0.6 * first + second, rel=1e-3)
    assert queue(3, PrefillHead(tokens=2000, tokens_sq=2000**2, elapsed_s=5 * first)) == pytest.approx(
        overhead + second, rel=1e-6)  # the engine is slower than priced: the work behind it still counts


def test_a_reports_head_is_aged_by_the_time_it_spent_on_the_way() -> None:
    head = PrefillHead(tokens=100, tokens_sq=10_000, elapsed_s=1.0)
    assert aged_head(head, 0.25) == PrefillHead(tokens=100, tokens_sq=10_000, elapsed_s=1.25)
    assert aged_head(head, -1.0) is head and aged_head(None, 1.0) is None
