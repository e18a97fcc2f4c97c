"""deployments.request_router: the target read from a real Serve ``PendingRequest``, the load read from routing
stats, and ``DecisionRequestRouter.choose_replicas``'s ranking (chosen replica first, the rest least-loaded behind
it; least-loaded when the target is gone or absent). The router body needs no Serve state, so it is called unbound
on ``FakeRunningReplica``s (tests/fakes/serve.py: real ``RunningReplica``s without a live actor, so a router that
tried to reach a replica would fail)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.request_router import DecisionRequestRouter, _load, _target_of
from router.wire import GenerateRequest
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


def test_target_of_reads_the_generate_request() -> None:
    assert _target_of(None) is None
    assert _target_of(pending(greq("abc"))) == "abc"
    assert _target_of(pending(request=greq("kw"))) == "kw"
    assert _target_of(pending("other", 3, greq("later"))) == "later"
    assert _target_of(pending(greq(None))) is None
    assert _target_of(pending("no", "request")) is None
    assert _target_of(pending()) is None


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


def test_no_target_or_control_call_is_least_loaded() -> None:
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
