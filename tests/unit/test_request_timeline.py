"""Per-request timelines: the replica's offsets from vLLM's engine-core timestamps, the connector's pool timing through
``kv_transfer_params``, and the ingress joining them into the decision record and the stage histogram.

The real ``LiveView`` and policy (no Ray: the hub reply is built here), the real wire structs.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from deployments.replica import request_timeline
from kvpool.connector.timing import TIMING_PARAM, PoolRequestTiming, from_params, to_params
from router.decision import DecisionRecord
from router.hub import PollReply, ReplicaReport
from router.wire import GenerateChunk, GenerateRequest, ReplicaTimeline
from tests.unit.test_live_calibration import make_view


def test_replica_timeline_is_offsets_from_receipt_and_marks_missing_steps() -> None:
    received = time.monotonic() - 1.0
    stats = SimpleNamespace(queued_ts=received + 0.1, scheduled_ts=received + 0.3, first_token_ts=received + 0.8)
    t = request_timeline(stats, received, plan_s=0.05)
    assert (t.plan_s, t.queued_s, t.scheduled_s, t.first_token_s) == pytest.approx((0.05, 0.1, 0.3, 0.8))
    assert t.first_chunk_s >= 1.0
    none = request_timeline(None, received, plan_s=0.0)  # vLLM without stats: the steps are unknown, not zero
    assert (none.queued_s, none.scheduled_s, none.first_token_s) == (-1.0, -1.0, -1.0)


def test_pool_timing_round_trips_through_kv_transfer_params() -> None:
    timing = PoolRequestTiming(lookups=2, lookup_s=0.004, lease_s=0.002, loaded_tokens=256, wait_s=0.03)
    params = to_params(timing)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params)) == params  # plain builtins, as vLLM ships them
    assert from_params(params) == timing
    assert from_params(None) is None and from_params({"other": 1}) is None
    assert from_params({TIMING_PARAM: {"lookups": "many"}}) is None  # not ours: ignored, never an error


def test_the_ingress_joins_both_into_the_decision_record_and_the_stage_metrics() -> None:
    view = make_view()
    view.apply(PollReply(cursor=1, reports=[ReplicaReport(replica_id="r1", node_id="node-a", seq=1, running=0,
                                                          waiting=0)]))
    routed, _ = view.decide("req-1", list(range(100)))
    assert isinstance(routed.record, DecisionRecord)
    replica = ReplicaTimeline(plan_s=0.01, queued_s=0.02, scheduled_s=0.12, first_token_s=0.52, first_chunk_s=0.55)
    view.record_first_token(routed, 0.7, GenerateChunk(token_ids=[1], prompt_tokens=100, replica_id="r1",
                                                       timeline=replica), ingress_s=0.05)
    view.record_pool_timing(routed, PoolRequestTiming(lookups=1, lookup_s=0.03, lease_s=0.0, wait_s=0.08))
    record = view.audit.get("req-1")
    assert record is not None and record.timeline is not None
    stages = record.timeline.stages()
    assert stages["ingress"] == pytest.approx(0.05) and stages["transport"] == pytest.approx(0.10)
    assert stages["engine_wait"] == pytest.approx(0.10) and stages["prefill"] == pytest.approx(0.40)
    assert stages["pool_lookup"] == pytest.approx(0.03) and stages["pool_wait"] == pytest.approx(0.08)
    decoded = msgspec.json.decode(view.audit.to_json(), type=list[DecisionRecord])[0]
    assert decoded.timeline == record.timeline  # /kvstack/decisions carries it
    labels = {"policy": record.policy, "action": str(record.action), "stage": "prefill"}
    assert view.registry.get_sample_value("kvstack_router_request_stage_seconds_count", labels) == 1
    labels["stage"] = "pool_lookup"
    assert view.registry.get_sample_value("kvstack_router_request_stage_seconds_count", labels) == 1


def test_the_calibration_fits_the_engines_prefill_and_the_path_apart() -> None:
    """The MFU line is fitted to vLLM's scheduled → first token (no queue, no load wait in it); the rest of the TTFT
    outside the engine's queue is the path's fixed cost, and the queue delay the policy sees starts from it."""
    from router import cost

    view = make_view()
    view.apply(PollReply(cursor=1, reports=[ReplicaReport(replica_id="r1", node_id="node-a", seq=1, running=0,
                                                          waiting=0)]))
    hw = view.hardware
    true_mfu, path_s = hw.mfu / 3, 0.025
    for i, tokens in enumerate((300, 600, 900, 1200, 1500, 1800, 2100)):
        routed, _ = view.decide(f"req-{i}", list(range(tokens)))
        prefill = cost.t_prefill(hw.model, hw.gpu, tokens, mfu=true_mfu)
        wait = 0.2 * i  # queueing and a pool load wait: in the TTFT, not in the prefill
        t = ReplicaTimeline(plan_s=0.0, queued_s=0.005, scheduled_s=0.005 + wait, first_token_s=0.005 + wait + prefill,
                            first_chunk_s=0.007 + wait + prefill)
        ttft = path_s + wait + prefill
        view.record_first_token(routed, ttft, GenerateChunk(token_ids=[1], prompt_tokens=tokens, replica_id="r1",
                                                            timeline=t), ingress_s=0.01)
    assert view.calibrator.hardware("r1", hw).mfu == pytest.approx(true_mfu, rel=0.03)
    assert view.calibrator.overhead_s("r1") == pytest.approx(path_s, abs=1e-3)
    state = view.book.states(time.monotonic())[0]
    assert state.queue_delay_s == pytest.approx(path_s, abs=1e-3)  # nothing waiting there: the path only


@pytest.mark.parametrize(("policy", "planned"), [("cost_based", True), ("always_fetch", True),
                                                 ("round_robin", False), ("prefix_affinity", False)])
def test_a_policy_that_prices_the_pool_plans_its_loads(policy: str, planned: bool) -> None:
    """cost_based's RECOMPUTE means "nothing from the pool": the replica then tells the connector to load nothing
    (no lookup to wait for before vLLM schedules the request); a policy that leaves the pool to the connector does
    not, and the connector looks every request up (the plan's shard first)."""
    import random

    from deployments.replica import connector_params, engine_sampling_params
    from kvpool.connector.scheduler import NO_LOAD_PARAM, PLAN_PARAM
    from router.policies.runner import make_policy
    from router.wire import encode_sampling_params
    from vllm import SamplingParams

    view = make_view()
    if policy != "cost_based":
        view.runner.policy = make_policy(policy, rng=random.Random(0), tier_map=view.tier_map)
    view.apply(PollReply(cursor=1, reports=[ReplicaReport(replica_id="r1", node_id="node-a", seq=1, running=0,
                                                          waiting=0)]))
    routed, _ = view.decide("req-1", list(range(100)))
    assert routed.pool_planned is planned and routed.action == "recompute"
    raw = encode_sampling_params(SamplingParams(max_tokens=4))
    request = GenerateRequest(request_id="req-1", prompt_token_ids=list(range(100)), sampling_params=raw,
                              action=routed.action, pool_planned=routed.pool_planned,
                              planned_reuse_tokens=routed.planned_reuse_tokens)
    params = engine_sampling_params(raw, connector_params(request, "shard-a"))[0].extra_args
    assert params == ({"kv_transfer_params": {NO_LOAD_PARAM: True}} if planned
                      else {"kv_transfer_params": {PLAN_PARAM: "shard-a"}})


def test_a_planned_holder_tells_the_connector_the_prefix_it_counted_on() -> None:
    """A HOLDER of a policy that plans the pool loads names its HBM prefix (the connector looks the pool up only
    if vLLM's cache supplies less); the same HOLDER of a policy that does not plan the loads is looked up as usual,
    and a FETCH hints at its shard (a planned one also at the block its plan ends at)."""
    from deployments.replica import connector_params
    from kvpool.connector.scheduler import HOLDER_PARAM, PLAN_END_PARAM, PLAN_PARAM
    from router.wire import FetchPlanMsg

    def request(action: str, planned: bool) -> GenerateRequest:
        plan = FetchPlanMsg("shard-b", "node-b", "dram", 0, 4) if action == "fetch" else None
        return GenerateRequest(request_id="r", prompt_token_ids=[1] * 700, sampling_params=b"", action=action,
                               pool_planned=planned, planned_reuse_tokens=512, fetch_plan=plan)

    assert connector_params(request("holder", True), None) == {HOLDER_PARAM: 512}
    assert connector_params(request("holder", False), None) is None
    assert connector_params(request("fetch", True), "shard-b") == {PLAN_PARAM: "shard-b", PLAN_END_PARAM: 4}
    assert connector_params(request("fetch", False), "shard-b") == {PLAN_PARAM: "shard-b"}


def test_the_event_loop_probe_measures_how_long_the_loop_was_blocked() -> None:
    """A request that arrives while the ingress's loop is busy waits outside every timeline; the probe sees it."""
    import asyncio

    view = make_view()

    async def scenario() -> None:
        probe = asyncio.create_task(view._probe_loop())
        await asyncio.sleep(0.12)  # a few idle periods: no lag to speak of
        time.sleep(0.3)  # the loop is blocked (a synchronous call on it)
        await asyncio.sleep(0.12)
        probe.cancel()

    asyncio.run(scenario())
    total = view.registry.get_sample_value("kvstack_router_event_loop_lag_seconds_sum")
    late = view.registry.get_sample_value("kvstack_router_event_loop_lag_seconds_bucket", {"le": "0.1"})
    count = view.registry.get_sample_value("kvstack_router_event_loop_lag_seconds_count")
    assert count is not None and count >= 3
    assert total is not None and 0.2 <= total < 0.5  # the blocked 0.3 s less the rest of one period
    assert late is not None and late == count - 1  # exactly one probe ran late by more than 0.1 s
