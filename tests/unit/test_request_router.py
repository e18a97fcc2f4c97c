"""deployments.request_router: the target read from a real Serve ``PendingRequest``, the load read from routing
stats, and ``DecisionRequestRouter.choose_replicas``'s ranking (chosen replica first, the rest least-loaded behind
it; least-loaded when a generate request's target is gone or absent; a control call waits for its target). The
router body needs no Serve state, so it is called unbound on ``FakeRunningReplica``s (tests/fakes/serve.py: real
``RunningReplica``s without a live actor, so a router that tried to reach a replica would fail)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.request_router import DecisionRequestRouter, _load, _request_of
from router.wire import ControlRequest, GenerateRequest
from tests.fakes.serve import FakeRunningReplica


def greq(target: str | None) -> GenerateRequest:
    return GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling_params=b"",
                           target_replica=target)


def pending(*args: Any, **kwargs: Any) -> PendingRequest:
    async def make() -> PendingRequest:  # PendingRequest owns an asyncio.Future: build it inside a loop
        return PendingRequest(args=list(args), kwargs=dict(kwargs),
                              metadata=RequestMetadata(request_id="r1", internal_request_id="i1",
                                                       call_method="generate", is_streaming=True))

    return asyncio.run(make())


def choose(replicas: list[FakeRunningReplica], req: PendingRequest | None) -> list[list[str]]:
    ranks = asyncio.run(DecisionRequestRouter.choose_replicas(None, replicas, req))  # type: ignore[arg-type]
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def target_of(pending_request: PendingRequest | None) -> str | None:
    request = _request_of(pending_request)
    return request.target_replica if request is not None else None


def test_the_request_is_read_from_the_pending_call() -> None:
    assert target_of(None) is None
    assert target_of(pending(greq("abc"))) == "abc"
    assert target_of(pending(request=greq("kw"))) == "kw"
    assert target_of(pending("other", 3, greq("later"))) == "later"
    assert target_of(pending(greq(None))) is None
    assert target_of(pending("no", "request")) is None
    assert target_of(pending()) is None
    assert isinstance(_request_of(pending(ControlRequest(target_replica="c", op="info"))), ControlRequest)


def test_load_is_running_plus_waiting() -> None:
    assert _load(FakeRunningReplica("a", running=2, waiting=3)) == 5.0
    assert _load(FakeRunningReplica("a", routing_stats={})) == 0.0
    assert _load(FakeRunningReplica("a", routing_stats={"running": 1})) == 1.0
    assert _load(FakeRunningReplica("a", routing_stats=None)) == 0.0
    empty = FakeRunningReplica("a")
    empty.set_routing_stats(None)  # Serve has not fetched stats yet
    assert _load(empty) == 0.0


def test_target_alone_even_when_busiest() -> None:
    """Serve retries the one offered replica (with backoff) until it accepts: never another one while it lives."""
    reps = [FakeRunningReplica("a", running=1), FakeRunningReplica("b", running=9),
            FakeRunningReplica("c", waiting=4), FakeRunningReplica("d")]
    assert choose(reps, pending(greq("b"))) == [["b"]]


def test_target_gone_falls_back_to_least_loaded() -> None:
    reps = [FakeRunningReplica("a", running=3), FakeRunningReplica("b", running=1), FakeRunningReplica("c", 2)]
    assert choose(reps, pending(greq("dead"))) == [["b", "c", "a"]]


def test_a_control_call_goes_to_its_target_or_waits_for_it() -> None:
    """An operator call is for one replica: while Serve's candidates lack it (a replacement the routers already
    know), nothing is offered, so Serve backs off and asks again instead of delivering it to another replica."""
    reps = [FakeRunningReplica("a", running=3), FakeRunningReplica("b")]
    assert choose(reps, pending(ControlRequest(target_replica="a", op="reset_prefix_cache"))) == [["a"]]
    assert choose(reps, pending(ControlRequest(target_replica="new", op="reset_prefix_cache"))) == []


def test_no_target_is_least_loaded() -> None:
    reps = [FakeRunningReplica("a", running=3), FakeRunningReplica("b")]
    assert choose(reps, pending(greq(None))) == [["b", "a"]]
    assert choose(reps, None) == [["b", "a"]]


def test_no_candidates() -> None:
    assert choose([], pending(greq("a"))) == []


def test_equal_load_ties_are_broken_at_random() -> None:
    reps = [FakeRunningReplica(x) for x in "abcd"]
    firsts = {choose(reps, None)[0][0] for _ in range(200)}
    assert firsts == set("abcd")


@pytest.mark.parametrize("n", [1, 2, 16])
def test_without_a_live_target_every_candidate_is_ranked_exactly_once(n: int) -> None:
    reps = [FakeRunningReplica(f"r{i}", running=i % 3) for i in range(n)]
    for target in (None, "gone"):
        flat = [x for rank in choose(reps, pending(greq(target))) for x in rank]
        assert sorted(flat) == sorted(r.replica_id.unique_id for r in reps)
    for target in ("r0", f"r{n - 1}"):
        assert choose(reps, pending(greq(target))) == [[target]]
