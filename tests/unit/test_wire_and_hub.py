"""router.wire (typed ingress <-> replica messages), router.hub (HubState: the bounded report log, cursors,
snapshots on a gap; the ClusterViewHub actor body without Ray) and deployments.replica.HbmPrefixLedger (the
replica's HBM key set and the deltas it publishes). The end-to-end property: a reader that applies what it polls
holds exactly each replica's ledger, however far behind it falls."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from deployments.replica import HbmPrefixLedger
from router.hub import HUB_WIRE_VERSION, ClusterViewHub, HubState, PollReply, ReplicaPlacement, ReplicaReport
from router.wire import (
    WIRE_VERSION,
    FetchPlanMsg,
    GenerateChunk,
    GenerateRequest,
    TokenLogprob,
    check_version,
    decode_sampling_params,
    encode_sampling_params,
)


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def report(rid: str, seq: int, stored: tuple[int, ...] | list[int] = (), removed: tuple[int, ...] | list[int] = (),
           full: bool = False, running: int = 0) -> ReplicaReport:
    return ReplicaReport(replica_id=rid, node_id=f"node-{rid}", seq=seq, running=running, waiting=0,
                         stored=[k(i) for i in stored], removed=[k(i) for i in removed], full=full)


# -- wire ----------------------------------------------------------------------------------------------------------
def test_generate_request_roundtrips_through_msgpack() -> None:
    req = GenerateRequest(
        request_id="chatcmpl-1", prompt_token_ids=list(range(300)), block_keys=[k(1), k(2)],
        sampling_params=b"\x01\x02", priority=3, reasoning_ended=False,
        reasoning_parser_kwargs={"chat_template_kwargs": {"enable_thinking": False}},
        target_replica="abc123", action="fetch",
        fetch_plan=FetchPlanMsg("shard-1", "node-1", "dram", 0, 2),
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GenerateRequest)
    assert back == req
    assert back.version == WIRE_VERSION and back.fetch_plan is not None and back.fetch_plan.end_block == 2


def test_vllm_sampling_params_cross_the_wire_whole() -> None:
    """Everything vLLM's request conversion can set survives: structured outputs, logit bias, stop strings,
    extra args, the output kind."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    params = SamplingParams(n=2, max_tokens=9, temperature=0.5, seed=7, stop=["END"], logprobs=3,
                            logit_bias={5: -100.0}, output_kind=RequestOutputKind.FINAL_ONLY,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}),
                            extra_args={"x": 1})
    back = decode_sampling_params(encode_sampling_params(params))
    assert (back.n, back.max_tokens, back.temperature, back.seed, back.stop, back.logprobs) == (2, 9, 0.5, 7,
                                                                                                  ["END"], 3)
    assert back.logit_bias == {5: -100.0} and back.extra_args == {"x": 1}
    assert back.output_kind == RequestOutputKind.FINAL_ONLY
    assert back.structured_outputs is not None and back.structured_outputs.json == {"type": "object"}
    with pytest.raises(msgspec.DecodeError):
        decode_sampling_params(b"\xc1")


def test_generate_chunk_roundtrips_with_logprobs() -> None:
    chunk = GenerateChunk(index=1, text="hé", token_ids=[4, 5], finish_reason="stop", stop_reason="END",
                          finished=True, prompt_tokens=9, cached_tokens=8, replica_id="r", cumulative_logprob=-1.5,
                          logprobs=[[TokenLogprob(4, -0.5, 1, "h")],
                                    [TokenLogprob(5, -1.0, 2, "é"), TokenLogprob(6, -0.7, 1, "e")]],
                          prompt_logprobs=[None, [TokenLogprob(3, -2.0, 4, "x")]])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(chunk), type=GenerateChunk) == chunk


def test_replica_placement_travels_with_reports_and_snapshots() -> None:
    placement = ReplicaPlacement(cores=[3], threads=1, binding="exclusive", numa_nodes=[0], allowed=[0, 1, 2, 3])
    raw = msgspec.msgpack.encode(msgspec.structs.replace(report("r1", 1, stored=(1,), full=True),
                                                         placement=placement))
    back = msgspec.msgpack.decode(raw, type=ReplicaReport)
    assert back.placement == placement
    state = HubState(max_log=1)
    state.publish(back)
    state.publish(msgspec.structs.replace(report("r1", 2, stored=(2,)), placement=placement))  # replicas send it
    # every time, so a reader that fell behind the log (a snapshot) still learns every replica's placement
    reply = state.poll(0)
    assert reply.snapshot and reply.reports[0].placement == placement
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(report("r2", 1)), type=ReplicaReport).placement is None


def test_wire_rejects_wrong_types_and_versions() -> None:
    raw = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": ["not", "ints"],
                                  "sampling_params": b""})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=GenerateRequest)
    with pytest.raises(msgspec.ValidationError):  # the sampling parameters are required
        msgspec.msgpack.decode(msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1]}),
                               type=GenerateRequest)
    newer = msgspec.msgpack.decode(
        msgspec.msgpack.encode({"version": WIRE_VERSION + 1, "request_id": "r", "prompt_token_ids": [1],
                                "sampling_params": b""}), type=GenerateRequest)
    with pytest.raises(ValueError, match="wire version"):
        check_version(newer.version, "GenerateRequest")
    check_version(WIRE_VERSION, "GenerateRequest")


def test_wire_names_are_literals() -> None:
    from typing import get_args

    from router.policies.base import Action, ActionName
    from router.wire import ControlRequest

    assert set(get_args(ActionName)) == {a.value for a in Action}
    ok = {"request_id": "r", "prompt_token_ids": [1], "sampling_params": b""}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({**ok, "action": Action.SPLIT}), type=GenerateRequest
                                  ).action == "split"
    with pytest.raises(msgspec.ValidationError, match="action"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**ok, "action": "route"}), type=GenerateRequest)
    with pytest.raises(msgspec.ValidationError, match="fetch_plan"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**ok, "fetch_plan": ["s", "n", "hbm", 0, 1]}),
                               type=GenerateRequest)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({"target_replica": "r", "op": "info"}),
                                  type=ControlRequest).op == "info"
    with pytest.raises(msgspec.ValidationError, match="op"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"target_replica": "r", "op": "reboot"}), type=ControlRequest)
    with pytest.raises(msgspec.ValidationError, match="binding"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"cores": [1], "threads": 1, "binding": "pinned"}),
                               type=ReplicaPlacement)


# -- hub: deltas, cursors, snapshots -------------------------------------------------------------------------------
def test_poll_returns_deltas_in_order_and_advances_the_cursor() -> None:
    hub = HubState()
    assert hub.poll(0) == PollReply(cursor=0, reports=[])
    reps = [report("a", 1, [1, 2], full=True), report("b", 1, [7], full=True), report("a", 2, [3], [1])]
    for r in reps:
        hub.publish(r)
    reply = hub.poll(0)
    assert not reply.snapshot and reply.reports == reps and reply.cursor == 3
    again = hub.poll(reply.cursor)
    assert again.reports == [] and again.cursor == 3 and not again.snapshot
    assert hub.poll(1).reports == reps[1:]
    hub.publish(report("b", 2, [8]))
    later = hub.poll(3)
    assert [r.seq for r in later.reports] == [2] and later.cursor == 4


def test_poll_pages_by_max_reports() -> None:
    hub = HubState()
    for i in range(10):
        hub.publish(report("a", i + 1, [i]))
    cursor, seen = 0, []
    while True:
        reply = hub.poll(cursor, max_reports=3)
        assert not reply.snapshot and len(reply.reports) <= 3
        if not reply.reports:
            break
        seen += [r.seq for r in reply.reports]
        cursor = reply.cursor
    assert seen == list(range(1, 11)) and cursor == 10


def test_cursor_older_than_the_log_gets_a_snapshot() -> None:
    hub = HubState(max_log=4)
    hub.publish(report("a", 1, [1, 2, 3], full=True))
    hub.publish(report("b", 1, [10], full=True))
    hub.publish(report("a", 2, [4], [1]))
    hub.publish(report("b", 2, [11], [10]))
    hub.publish(report("a", 3, [5], [2], running=3))  # log now holds seqs 2..5
    assert not hub.poll(1).snapshot  # exactly at the oldest-1 boundary: deltas still line up
    assert [r.seq for r in hub.poll(1).reports] == [1, 2, 2, 3]
    reply = hub.poll(0)
    assert reply.snapshot and reply.cursor == 5
    by_id = {r.replica_id: r for r in reply.reports}
    assert set(by_id) == {"a", "b"}
    assert all(r.full and r.removed == [] and not r.gone for r in reply.reports)
    assert set(by_id["a"].stored) == {k(3), k(4), k(5)} and by_id["a"].running == 3 and by_id["a"].seq == 3
    assert set(by_id["b"].stored) == {k(11)}


def test_cursor_from_the_future_gets_a_snapshot() -> None:
    hub = HubState()
    hub.publish(report("a", 1, [1], full=True))
    reply = hub.poll(50)  # e.g. the hub restarted and its sequence began again
    assert reply.snapshot and reply.cursor == 1 and [r.replica_id for r in reply.reports] == ["a"]


def test_negative_cursor_asks_for_a_snapshot() -> None:
    hub = HubState()  # router.live_view polls with -1 to force a resync
    assert hub.poll(-1).snapshot
    hub.publish(report("a", 1, [1], full=True))
    reply = hub.poll(-1)
    assert reply.snapshot and reply.cursor == 1 and reply.reports[0].stored == [k(1)]


def test_full_report_replaces_the_key_set() -> None:
    hub = HubState(max_log=1)
    hub.publish(report("a", 1, [1, 2, 3], full=True))
    hub.publish(report("a", 2, [4]))
    hub.publish(report("a", 3, [9, 10], full=True))
    (snap,) = hub.snapshot().reports
    assert set(snap.stored) == {k(9), k(10)}


def test_removals_apply_before_stores_within_a_report() -> None:
    hub = HubState()
    hub.publish(report("a", 1, [1, 2], full=True))
    hub.publish(report("a", 2, stored=[2], removed=[2, 1]))  # re-stored after an eviction in the same window
    (snap,) = hub.snapshot().reports
    assert set(snap.stored) == {k(2)}


def test_forget_emits_gone_and_leaves_the_snapshot() -> None:
    hub = HubState()
    hub.publish(report("a", 1, [1], full=True))
    hub.publish(report("b", 1, [2], full=True))
    hub.forget("a")
    hub.forget("nobody")  # unknown: no report
    reply = hub.poll(2)
    assert len(reply.reports) == 1 and reply.cursor == 3
    (gone,) = reply.reports
    assert gone.gone and gone.replica_id == "a" and gone.stored == [] and gone.removed == []
    assert [r.replica_id for r in hub.snapshot().reports] == ["b"]
    hub.publish(report("a", 1, [5], full=True))  # a replica that comes back starts over
    assert {r.replica_id for r in hub.snapshot().reports} == {"a", "b"}


def test_a_silent_replica_is_forgotten_and_no_snapshot_hands_it_out_again() -> None:
    """A replica killed (or frozen) stops publishing: after the silence the hub forgets it — readers get its
    ``gone`` and no later snapshot (a router's resync, a new router) brings it back as if it had just reported."""
    hub = HubState()
    assert hub.publish(report("dead", 1, [1], full=True), now=0.0)
    assert hub.publish(report("live", 1, [2], full=True), now=0.0)
    assert hub.publish(report("live", 2, [3]), now=8.0)
    assert hub.expire(now=9.0, silence_s=10.0) == []
    cursor = hub.poll(0).cursor
    assert hub.expire(now=10.5, silence_s=10.0) == ["dead"]
    (gone,) = hub.poll(cursor).reports
    assert gone.gone and gone.replica_id == "dead"
    assert [r.replica_id for r in hub.poll(-1).reports] == ["live"]  # a resync: the live one only
    assert hub.expire(now=10.6, silence_s=10.0) == []  # forgotten once


def test_a_delta_from_a_replica_the_hub_does_not_hold_asks_for_a_full_report() -> None:
    """A replica the hub forgot (silent too long, yet alive) or a restarted hub gets a delta: the hub cannot know
    the replica's whole key set, so it answers False and the replica sends a full report next."""
    hub = HubState()
    assert hub.publish(report("a", 1, [1], full=True), now=0.0)
    hub.expire(now=20.0, silence_s=10.0)
    assert hub.publish(report("a", 7, [9]), now=21.0) is False  # a delta on nothing
    assert hub.publish(report("a", 8, [10]), now=21.5) is False  # still not the whole set
    assert hub.publish(report("a", 9, [1, 9, 10], full=True), now=22.0) is True
    assert hub.publish(report("a", 10, [11]), now=22.5) is True
    (snap,) = hub.snapshot().reports
    assert set(snap.stored) == {k(1), k(9), k(10), k(11)}


def test_wrong_version_rejected() -> None:
    hub = HubState()
    bad = msgspec.structs.replace(report("a", 1, [1], full=True), version=HUB_WIRE_VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        hub.publish(bad)
    assert hub.poll(0).reports == [] and hub.snapshot().reports == []


def test_actor_body_speaks_msgpack() -> None:
    actor = ClusterViewHub(max_log=8)
    assert actor.ping() == "ok"
    actor.publish_replica(msgspec.msgpack.encode(report("a", 1, [1, 2], full=True)))
    with pytest.raises(msgspec.ValidationError):
        actor.publish_replica(msgspec.msgpack.encode({"replica_id": "a"}))
    reply = msgspec.msgpack.decode(actor.poll(0), type=PollReply)
    assert reply.cursor == 1 and reply.reports[0].stored == [k(1), k(2)]
    actor.forget_replica("a")
    reply = msgspec.msgpack.decode(actor.poll(1), type=PollReply)
    assert reply.reports[0].gone
    assert actor.publish_replica(msgspec.msgpack.encode(report("a", 2, [3]))) is False  # forgotten: send it all
    assert actor.publish_replica(msgspec.msgpack.encode(report("a", 3, [3], full=True))) is True


def test_the_actor_forgets_a_replica_silent_past_its_silence() -> None:
    actor = ClusterViewHub(max_log=8, silence_s=0.05)
    actor.publish_replica(msgspec.msgpack.encode(report("a", 1, [1], full=True)))
    assert [r.replica_id for r in msgspec.msgpack.decode(actor.poll(0), type=PollReply).reports] == ["a"]
    time.sleep(0.1)
    reply = msgspec.msgpack.decode(actor.poll(1), type=PollReply)
    assert [(r.replica_id, r.gone) for r in reply.reports] == [("a", True)]
    assert msgspec.msgpack.decode(actor.poll(-1), type=PollReply).reports == []


# -- HBM ledger ----------------------------------------------------------------------------------------------------
def test_ledger_rejects_non_positive_capacity() -> None:
    for cap in (0, -1):
        with pytest.raises(ValueError, match="capacity_blocks"):
            HbmPrefixLedger(cap)


def test_ledger_is_a_bounded_lru_with_deltas() -> None:
    led = HbmPrefixLedger(3)
    led.touch([k(1), k(2)])
    assert led.drain() == ([k(2), k(1)], [])
    assert led.drain() == ([], [])
    led.touch([k(1)])  # refreshes k1: k2 is now the least recent
    led.touch([k(3), k(4)])
    assert set(led.snapshot()) == {k(1), k(3), k(4)}
    stored, removed = led.drain()
    assert set(stored) == {k(3), k(4)} and removed == [k(2)]
    led.touch([k(5), k(6), k(7), k(8)])  # more than the capacity at once: the prompt's tail k8 does not fit
    assert set(led.snapshot()) == {k(5), k(6), k(7)}
    stored, removed = led.drain()
    assert set(stored) == {k(5), k(6), k(7)} and set(removed) == {k(1), k(3), k(4), k(8)}


def test_ledger_evicts_a_chain_from_its_tail() -> None:
    led = HbmPrefixLedger(4)
    led.touch([k(1), k(2), k(3)])  # a prompt's chained keys, head first
    led.touch([k(10), k(11)])
    assert set(led.snapshot()) == {k(1), k(2), k(10), k(11)}  # the tail block k3 went, the head k1 stayed


def test_ledger_nets_deltas_within_a_window() -> None:
    led = HbmPrefixLedger(2)
    led.touch([k(1), k(2)])
    led.drain()
    led.touch([k(3), k(4)])  # evicts k1, k2 (reported) ...
    led.touch([k(1), k(5)])  # ... then k1 comes back, and k3, k4 (never reported) go again
    stored, removed = led.drain()
    assert not set(stored) & set(removed)
    assert set(stored) == {k(1), k(5)} and set(removed) == {k(2), k(3), k(4)}
    assert set(led.snapshot()) == {k(1), k(5)}


def test_ledger_remove_reports_engine_evictions() -> None:
    led = HbmPrefixLedger(8)
    led.touch([k(1), k(2), k(3)])
    led.drain()
    led.touch([k(4)])
    led.remove([k(2), k(4), k(99)])  # k4 never reported, k99 never held
    stored, removed = led.drain()
    assert stored == [] and set(removed) == {k(2), k(4)}
    assert set(led.snapshot()) == {k(1), k(3)}
    led.remove([k(2)])  # already gone: no delta
    assert led.drain() == ([], [])


def test_ledger_clear_removes_everything_including_unreported() -> None:
    led = HbmPrefixLedger(8)
    led.touch([k(1), k(2)])
    led.drain()
    led.touch([k(3)])
    led.clear()
    stored, removed = led.drain()
    assert stored == [] and set(removed) == {k(1), k(2), k(3)} and led.snapshot() == []
    led.touch([k(1)])
    assert led.drain() == ([k(1)], [])


# -- the whole path: ledgers -> hub -> a polling reader --------------------------------------------------------------
class Reader:
    """What an ingress does with poll replies (router.live_view applies the same rules)."""

    def __init__(self) -> None:
        self.cursor = 0
        self.view: dict[str, set[bytes]] = {}
        self.snapshots = 0

    def apply(self, reply: PollReply) -> None:
        if reply.snapshot:
            self.view = {}
            self.snapshots += 1
        for r in reply.reports:
            if r.gone:
                self.view.pop(r.replica_id, None)
                continue
            keys = self.view.setdefault(r.replica_id, set())
            if r.full:
                keys.clear()
            keys.difference_update(r.removed)
            keys.update(r.stored)
        self.cursor = reply.cursor


@pytest.mark.parametrize("seed", range(8))
def test_readers_converge_on_the_ledgers(seed: int) -> None:
    rng = random.Random(seed)
    hub = HubState(max_log=16)
    ledgers: dict[str, HbmPrefixLedger] = {}
    seqs: dict[str, int] = {}
    readers = [Reader() for _ in range(3)]

    def publish(rid: str) -> None:
        led = ledgers[rid]
        stored, removed = led.drain()
        first = seqs.get(rid, 0) == 0
        seqs[rid] = seqs.get(rid, 0) + 1
        hub.publish(ReplicaReport(replica_id=rid, node_id="n", seq=seqs[rid], running=0, waiting=0,
                                  stored=led.snapshot() if first else stored, removed=[] if first else removed,
                                  full=first))

    for step in range(600):
        op = rng.random()
        if op < 0.5 and ledgers:
            rid = rng.choice(sorted(ledgers))
            start = rng.randrange(40)
            ledgers[rid].touch([k(start * 100 + j) for j in range(rng.randrange(1, 6))])
        elif op < 0.55 and ledgers:
            ledgers[rng.choice(sorted(ledgers))].clear()
        elif op < 0.58 and ledgers:
            led = ledgers[rng.choice(sorted(ledgers))]
            held = led.snapshot()
            led.remove(rng.sample(held, min(len(held), rng.randrange(1, 4))) + [k(10**6)])
        elif op < 0.6:
            rid = f"r{rng.randrange(5)}"
            if rid not in ledgers:
                ledgers[rid] = HbmPrefixLedger(rng.choice([3, 8, 20]))
                seqs[rid] = 0
        elif op < 0.62 and ledgers:
            rid = rng.choice(sorted(ledgers))
            del ledgers[rid]
            hub.forget(rid)
        elif ledgers:
            publish(rng.choice(sorted(ledgers)))
        for i, reader in enumerate(readers):  # readers poll at different rates; the slow ones fall off the log
            if step % (1 + 7 * i) == 0:
                reader.apply(hub.poll(reader.cursor, max_reports=5))
    for rid in list(ledgers):
        publish(rid)
    for reader in readers:
        for _ in range(200):
            before = reader.cursor
            reader.apply(hub.poll(reader.cursor, max_reports=5))
            if reader.cursor == before:
                break
        assert reader.view == {rid: set(led.snapshot()) for rid, led in ledgers.items()}
    assert readers[-1].snapshots > 0  # the slowest reader did resync from a snapshot


def test_a_reset_vllm_refuses_is_asked_again_and_the_view_is_cleared_only_once_it_worked() -> None:
    """vLLM refuses to reset its prefix cache while a request holds blocks (``reset_prefix_cache`` returns False):
    the replica asks again until its deadline, and clears the HBM view it publishes only when the engine's cache
    really was dropped; a reset that never worked is ``ok: False`` with the reason."""
    import asyncio
    from types import SimpleNamespace

    from deployments.prefill_queue import PrefillQueue
    from deployments.replica import VLLMReplica

    class Engine:
        def __init__(self, refusals: int) -> None:
            self.refusals, self.calls = refusals, 0

        async def reset_prefix_cache(self) -> bool:
            self.calls += 1
            return self.calls > self.refusals

    def replica(refusals: int) -> SimpleNamespace:
        led = HbmPrefixLedger(8)
        led.touch([k(1), k(2)])
        return SimpleNamespace(engine=Engine(refusals), ledger=led, running=1, prefills=PrefillQueue())

    busy = replica(refusals=3)  # a request finishes after three refusals
    assert asyncio.run(VLLMReplica.reset_prefix_cache(busy, deadline_s=5.0)) == (True, "")
    assert busy.engine.calls == 4 and busy.ledger.snapshot() == []
    stuck = replica(refusals=10**6)
    ok, why = asyncio.run(VLLMReplica.reset_prefix_cache(stuck, deadline_s=0.5))
    assert not ok and "1 running" in why
    assert set(stuck.ledger.snapshot()) == {k(1), k(2)}  # the engine still holds them: the view says so
