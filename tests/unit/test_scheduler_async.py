"""The connector's scheduler role never waits on the pool (``kvpool.connector.scheduler.SchedulerSide``).

The thing under test is the real ``SchedulerSide`` with its real pool-call threads; its neighbour, the shards
(``PoolShards``: Ray actors), is a fake whose calls block until the test opens a gate — a frozen shard. vLLM's
``Request``, block list and scheduler output are stand-ins with the fields the connector reads. The real path (real
vLLM, real shards) is ``tests/e2e/test_reuse_correctness.py``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface")

from kvpool.connector.breaker import ShardBreaker  # noqa: E402
from kvpool.connector.config import ConnectorConfig  # noqa: E402
from kvpool.connector.scheduler import SchedulerSide  # noqa: E402
from kvpool.events import Tier  # noqa: E402
from kvpool.shard.wire import LeaseReply, ShardUnavailableError  # noqa: E402
from kvpool.store import Lease, LeasedBlock, LookupResult  # noqa: E402

BS = 128
FAST_S = 0.05  # "returns at once": far below any pool deadline


class FakeShards:
    """One shard "s1" holding the first ``held`` blocks of every chain; ``lookup_gate`` / ``lease_gate`` closed =
    the shard is frozen (calls block until opened or their deadline passes)."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.lookup_gate, self.lease_gate = threading.Event(), threading.Event()
        self.lookup_gate.set()
        self.lease_gate.set()
        self.lookups: list[int] = []
        self.released: list[int] = []
        self.lease_fails = False
        self.breaker = ShardBreaker()
        self.shard_ids = ["s1"]

    def local_shard_id(self, *, wait: bool = True) -> str:
        return "s1"

    def lookup_many(self, calls: Any, fingerprint: str, deadline_s: float, *, lease_ttl_s: float | None = None
                    ) -> list[Any]:
        if not self.lookup_gate.wait(deadline_s):
            return [None for _ in calls]
        self.lookups.append(len(calls[0][1]))
        out = [LookupResult(min(self.held, len(keys)), min(self.held, len(keys)), 0) for _, keys in calls]
        if lease_ttl_s is not None:  # the first call leases: what a lease on a frozen or failing shard answers
            shard_id, keys = calls[0]
            try:
                out[0] = self.client(shard_id).lease(keys[: self.held], fingerprint, lease_ttl_s)
            except ShardUnavailableError:
                out[0] = None
        return out

    def client(self, shard_id: str) -> Any:
        return FakeClient(self)

    def forget(self, shard_id: str) -> None:
        self.breaker.failure(shard_id)


class FakeClient:
    def __init__(self, shards: FakeShards) -> None:
        self.shards = shards

    def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
        if not self.shards.lease_gate.wait(10.0) or self.shards.lease_fails:
            raise ShardUnavailableError("shard s1.lease: no answer")
        blocks = [LeasedBlock(bytes(k), i * 4096, 4096, 1000 + i, Tier.DRAM) for i, k in enumerate(keys)]
        return LeaseReply("s1", "e1", "agent-s1", 0, Lease(7, blocks, 0.0, ttl_s))

    def release(self, lease_id: int) -> bool:
        self.shards.released.append(lease_id)
        return True


def make_side(held: int = 6, *, lease_on_lookup: bool = True) -> tuple[SchedulerSide, FakeShards]:
    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = SimpleNamespace(num_blocks=64, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])])
    vcfg = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m"))
    cfg = ConnectorConfig(save=False, lookup_deadline_s=5.0, lease_on_lookup=lease_on_lookup)
    side = SchedulerSide(cfg, vcfg, kv)
    side.fingerprint = "fp"
    fake = FakeShards(held)
    side.shards = fake  # type: ignore[assignment]
    return side, fake


def request(rid: str, blocks: int = 8) -> Any:
    tokens = list(range(10, 10 + blocks * BS + 5))
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_tokens=len(tokens),
                           num_prompt_tokens=len(tokens), cache_salt=None, kv_transfer_params=None, num_preemptions=0)


def step(side: SchedulerSide) -> Any:
    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return side.build_connector_meta(SimpleNamespace(preempted_req_ids=set(), scheduled_new_reqs=[],
                                                     scheduled_cached_reqs=cached, num_scheduled_tokens={}))


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def until(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


class Blocks:
    def __init__(self, n: int) -> None:
        self.ids = list(range(100, 100 + n))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def first_answer(side: SchedulerSide, req: Any) -> tuple[int | None, bool]:
    """A new request's lookup, waited for: the scheduler's answer to vLLM's first real ask."""
    side.on_new_request(req)
    until(lambda: side.get_num_new_matched_tokens(req, 0) != (None, False))
    return side.get_num_new_matched_tokens(req, 0)


def leased_load(side: SchedulerSide, req: Any, allocated: int, external_tokens: int) -> Any:
    """vLLM allocated ``allocated`` blocks for ``external_tokens`` pool tokens: the lease, waited for, and the
    ``LoadSpec`` the next step hands the workers."""
    side.update_state_after_alloc(req, Blocks(allocated), external_tokens)
    until(lambda: side._leasing[req.request_id].future.done())
    (spec,) = step(side).loads
    return spec


def test_a_frozen_lookup_answers_not_yet_at_once_then_the_hit() -> None:
    side, fake = make_side(held=6)
    fake.lookup_gate.clear()  # the shard is frozen
    req = request("a")
    side.on_new_request(req)  # starts the lookup in the background
    for _ in range(20):  # vLLM asks every step while the request waits
        out, took = timed(side.get_num_new_matched_tokens, req, 0)
        assert out == (None, False) and took < FAST_S
    assert side.stats.lookups == 1  # one lookup in flight, not one per ask
    fake.lookup_gate.set()
    until(lambda: side.get_num_new_matched_tokens(req, 0) != (None, False))
    assert side.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    assert side.stats.lookups_not_yet >= 20


def test_a_finished_lookup_answers_a_later_ask_past_the_local_prefix() -> None:
    side, fake = make_side(held=6)
    req = request("a")
    side.on_new_request(req)
    side.calls.wait_idle(5.0)
    # vLLM's own cache now holds 2 blocks: the pool adds blocks 2..5, no new round trip
    assert side.get_num_new_matched_tokens(req, 2 * BS) == (4 * BS, True)
    assert side.get_num_new_matched_tokens(req, 7 * BS) == (0, False)  # local has more than the pool
    assert len(fake.lookups) == 1


def test_a_lease_in_flight_holds_the_load_back_without_blocking_the_step() -> None:
    side, fake = make_side(held=6, lease_on_lookup=False)  # the lease starts at the allocation
    req = request("a")
    side.on_new_request(req)
    side.calls.wait_idle(5.0)
    assert side.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    fake.lease_gate.clear()
    _, took = timed(side.update_state_after_alloc, req, Blocks(9), 6 * BS)
    assert took < FAST_S
    meta, took = timed(step, side)
    assert meta.loads == [] and took < FAST_S
    fake.lease_gate.set()
    side.calls.wait_idle(5.0)
    meta = step(side)
    assert len(meta.loads) == 1
    spec = meta.loads[0]
    assert spec.req_id == "a" and [b.block_ids[0] for b in spec.blocks] == list(range(100, 106))
    assert all(b.remote is not None for b in spec.blocks) and spec.agent_name == "agent-s1"
    assert side.held_leases() == {"a": [("s1", 7)]}
    done, params = side.request_finished(req)
    side.calls.wait_idle(5.0)
    assert fake.released == [7] and not side.held_leases() and params is not None


def test_what_the_request_waited_on_the_pool_from_the_first_ask_is_in_its_load_and_timing() -> None:
    """The cost a FETCH pays before its read is its wait from vLLM's first ask (the lookup still in flight, the
    steps it was skipped, the lease), not only the lease call: ``LoadSpec.wait_s`` (the calibration's transfer
    seconds, ``TransferRecord.seconds``) and the timeline's ``PoolRequestTiming.wait_s``."""
    from kvpool.connector.meta import TransferRecord
    from kvpool.connector.timing import from_params

    side, fake = make_side(held=6)
    fake.lookup_gate.clear()
    req = request("a")
    side.on_new_request(req)
    asked = time.monotonic()
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.15)  # the lookup is frozen for a while: the request waits
    fake.lookup_gate.set()
    until(lambda: side.get_num_new_matched_tokens(req, 0) != (None, False))
    assert side.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    spec = leased_load(side, req, 9, 6 * BS)
    waited = time.monotonic() - asked
    assert 0.15 <= spec.wait_s <= waited and spec.wait_s >= spec.lease_s
    record = TransferRecord("s1", 6, 6 * 4096, spec.lease_s, 0.01, 0, spec.wait_s)
    assert record.seconds == pytest.approx(spec.wait_s + 0.01)
    assert TransferRecord("s1", 6, 6 * 4096, 0.02, 0.01, 0).seconds == pytest.approx(0.03)  # only the lease known
    _, params = side.request_finished(req)
    timing = from_params(params)
    assert timing is not None and timing.wait_s == pytest.approx(spec.wait_s)


def test_aborted_while_leasing_gets_a_failed_load_and_the_late_lease_is_released() -> None:
    side, fake = make_side(held=6, lease_on_lookup=False)  # the lease starts at the allocation
    req = request("a")
    side.on_new_request(req)
    side.calls.wait_idle(5.0)
    assert side.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    fake.lease_gate.clear()
    side.update_state_after_alloc(req, Blocks(9), 6 * BS)
    side.request_finished(req)  # aborted while WAITING_FOR_REMOTE_KVS
    meta = step(side)
    # vLLM frees the request's blocks only once the worker reports its load: a failed one, now
    assert [(s.req_id, s.blocks, s.all_or_nothing) for s in meta.loads] == [("a", [], True)]
    fake.lease_gate.set()
    side.calls.wait_idle(5.0)
    assert step(side).loads == []
    side.calls.wait_idle(5.0)
    assert fake.released == [7] and side.stats.leases_abandoned == 1 and not side.held_leases()


def test_a_failed_lease_is_a_load_without_remote_blocks() -> None:
    side, fake = make_side(held=6, lease_on_lookup=False)  # the lease starts at the allocation
    req = request("a")
    side.on_new_request(req)
    side.calls.wait_idle(5.0)
    assert side.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    fake.lease_fails = True
    side.update_state_after_alloc(req, Blocks(9), 6 * BS)
    side.calls.wait_idle(5.0)
    meta = step(side)
    assert len(meta.loads) == 1 and all(b.remote is None for b in meta.loads[0].blocks)
    assert side.stats.leases_failed == 1 and not side.held_leases()
    # asked again without a preemption in between: offered nothing (recompute once)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_lookup_that_times_out_is_a_miss_and_the_answer_comes_back_by_itself() -> None:
    side, fake = make_side(held=6)
    side.cfg = ConnectorConfig(save=False, lookup_deadline_s=0.1)
    fake.lookup_gate.clear()
    req = request("a")
    side.on_new_request(req)
    side.calls.wait_idle(5.0)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # no answer in time: a miss
    assert side.stats.lookup_failures == 1
    fake.lookup_gate.set()
    side._reqs["a"].found = None  # forget the miss (as after LOOKUP_REFRESH_S)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    side.calls.wait_idle(5.0)
    assert side.get_num_new_matched_tokens(req, 0) == (6 * BS, True)


class CacheManager:
    """vLLM's KV cache manager as the save planner reads it: each request's block table, the null block."""

    def __init__(self) -> None:
        self.block_pool = SimpleNamespace(null_block=SimpleNamespace(block_id=0))

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return (list(range(200, 220)),)


def save_step(side: SchedulerSide, rid: str, computed: int, scheduled: int) -> Any:
    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    new = [SimpleNamespace(req_id=rid, num_computed_tokens=computed)]
    return side.build_connector_meta(SimpleNamespace(preempted_req_ids=set(), scheduled_new_reqs=new,
                                                     scheduled_cached_reqs=cached,
                                                     num_scheduled_tokens={rid: scheduled}))


def test_a_failed_save_is_planned_again_from_a_held_copy_and_a_committed_one_never() -> None:
    from kvpool.connector.meta import SaveReport

    side, _ = make_side()
    side.cfg = ConnectorConfig(save=True)
    side.bind_kv_cache_manager(CacheManager())
    first = request("a", blocks=4)
    side.on_new_request(first)
    (spec,) = save_step(side, "a", 0, first.num_tokens).saves
    assert len(spec.keys) == 4
    side.save_outcomes(SaveReport(saved=spec.keys[:2] + spec.keys[3:], failed=[spec.keys[2]]))
    again = request("b", blocks=4)  # the same prompt: its first 4 blocks come from the engine's own cache
    side.on_new_request(again)
    (retry,) = save_step(side, "b", 4 * BS, again.num_tokens - 4 * BS).saves
    assert retry.keys == [spec.keys[2]] and retry.blocks == [{0: 202}]
    assert side.book.stats.retried == 1


def test_a_saved_block_the_local_shard_lost_is_saved_again() -> None:
    """The book says blocks 0-3 were saved; the local shard's lookup holds only block 0 (it evicted the rest, or
    restarted): they are saved again by the next request that computes them; a short lease on it does the same."""
    from kvpool.connector.meta import SaveReport

    side, fake = make_side(held=4, lease_on_lookup=False)  # the short lease is the allocation's
    side.cfg = ConnectorConfig(save=True, lease_on_lookup=False)
    side.bind_kv_cache_manager(CacheManager())
    first = request("a", blocks=4)
    side.on_new_request(first)
    (spec,) = save_step(side, "a", 0, first.num_tokens).saves
    side.save_outcomes(SaveReport(saved=spec.keys, failed=[]))
    assert all(side.book.is_saved(k) for k in spec.keys)

    fake.held = 1  # the shard lost blocks 1-3
    again = request("b", blocks=4)
    side.on_new_request(again)
    until(lambda: side.get_num_new_matched_tokens(again, 0) != (None, False))
    assert side.get_num_new_matched_tokens(again, 0) == (BS, True)
    assert [side.book.is_saved(k) for k in spec.keys] == [True, False, False, False]
    assert side.book.stats.lost == 3
    side._matches.pop("b")  # vLLM computes it (no allocation for the pool's block here)
    (resave,) = save_step(side, "b", BS, again.num_tokens - BS).saves
    assert resave.keys == spec.keys[1:]  # planned again

    side.save_outcomes(SaveReport(saved=resave.keys, failed=[]))
    fake.held = 4
    short = request("c", blocks=4)
    side.on_new_request(short)
    until(lambda: side.get_num_new_matched_tokens(short, 0) != (None, False))
    assert side.get_num_new_matched_tokens(short, 0) == (4 * BS, True)
    real_client = fake.client

    class ShortClient(FakeClient):
        def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
            reply = super().lease(keys[:2], fingerprint, ttl_s)  # blocks 2-3 evicted since the lookup
            return reply

    fake.client = lambda shard_id: ShortClient(fake)  # type: ignore[method-assign]
    side.update_state_after_alloc(short, Blocks(4), 4 * BS)
    until(lambda: side._leasing["c"].future.done())
    step(side)
    fake.client = real_client  # type: ignore[method-assign]
    assert side.stats.leases_short == 1
    assert [side.book.is_saved(k) for k in spec.keys] == [True, True, False, False]


@pytest.mark.parametrize(("failed", "invalid", "loaded"), [(False, set(), 6), (False, {102}, 2), (True, set(), 0)])
def test_loaded_tokens_count_only_what_the_load_supplied(failed: bool, invalid: set[int], loaded: int) -> None:
    """A lease of 6 blocks whose load then fails from block 2 on (a slot rewritten after its lease expired, a dead
    shard) supplied 2 blocks; a failed request (hybrids) none — the request's timing says so."""
    from kvpool.connector.timing import from_params

    side, _ = make_side(held=6)
    req = request("a")
    assert first_answer(side, req) == (6 * BS, True)
    spec = leased_load(side, req, 8, 6 * BS)
    assert len(spec.blocks) == 6
    side.load_outcomes({"a"}, {"a"} if failed else set(), invalid)
    _, params = side.request_finished(req)
    timing = from_params(params)
    assert timing is not None and timing.loaded_tokens == loaded * BS


class KeyedShards(FakeShards):
    """One shard "s1" holding exactly the keys in ``held_keys``: lookups and leases take the longest held prefix
    of the keys asked for, as the store does (``kvpool.store``); each leased slot's offset names its key."""

    def __init__(self) -> None:
        super().__init__(held=0)
        self.held_keys: set[bytes] = set()
        self.slot_of: dict[bytes, int] = {}
        self.leased: list[list[bytes]] = []

    def prefix(self, keys: list[bytes]) -> int:
        return next((i for i, k in enumerate(keys) if bytes(k) not in self.held_keys), len(keys))

    def lookup_many(self, calls: Any, fingerprint: str, deadline_s: float, *, lease_ttl_s: float | None = None
                    ) -> list[Any]:
        out = [LookupResult(self.prefix(keys), self.prefix(keys), 0) for _, keys in calls]
        if lease_ttl_s is not None:
            out[0] = self.client(calls[0][0]).lease(calls[0][1], fingerprint, lease_ttl_s)
        return out

    def client(self, shard_id: str) -> Any:
        shards = self

        class Client(FakeClient):
            def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
                held = [bytes(k) for k in keys[: shards.prefix(keys)]]
                shards.leased.append(held)
                blocks = [LeasedBlock(k, shards.slot_of.setdefault(k, 4096 * len(shards.slot_of)), 4096, 1,
                                      Tier.DRAM) for k in held]
                return LeaseReply("s1", "e1", "agent-s1", 0, Lease(7, blocks, 0.0, ttl_s, b"g" * 16))

        return Client(self)


@pytest.mark.parametrize("world", [2, 3])
def test_a_tensor_parallel_engine_finds_leases_and_loads_only_blocks_every_rank_holds(world: int) -> None:
    """A TP engine asks for every rank's key of each block (block-major): the shard holds all ranks of blocks 0-3
    and only rank 0 of blocks 4-5 (the router's keys would say 6), so the hit is 4 blocks; the one lease (the
    lookup's own, ``lease_on_lookup``) pins the longest held prefix of those keys — every rank's slots of blocks 0-3
    and rank 0's of block 4, which no load uses — and rank r's slots in the ``LoadSpec`` are those of its own
    keys."""
    from kvpool.keys import rank_key

    side, _ = make_side()
    side.tp_world = world
    fake = KeyedShards()
    side.shards = fake  # type: ignore[assignment]
    req = request("a")
    keys = side._keys(side._track(req))
    fake.held_keys = {bytes(rank_key(k, r, world)) for k in keys[:4] for r in range(world)}
    fake.held_keys |= {bytes(k) for k in keys[4:6]}
    assert first_answer(side, req) == (4 * BS, True)
    spec = leased_load(side, req, 9, 4 * BS)
    assert spec.world == world and len(spec.blocks) == 4 * world and spec.states == []
    assert fake.leased == [[bytes(rank_key(k, r, world)) for k in keys[:4] for r in range(world)]
                           + [bytes(rank_key(keys[4], 0, world))]]
    for rank in range(world):
        mine = spec.blocks[rank::world]
        assert [b.block_ids[0] for b in mine] == list(range(100, 104))
        assert [b.remote.offset for b in mine] == [fake.slot_of[bytes(rank_key(k, rank, world))] for k in keys[:4]]
    assert side.stats.hit_tokens == 4 * BS and side.stats.blocks_to_load == 4


def test_a_short_tensor_parallel_lease_leaves_the_missing_ranks_slots_unleased() -> None:
    """Rank 1's copy of block 2 was evicted between lookup and lease: rank 0 still has a slot for block 2, rank 1
    none (its load error makes vLLM recompute from block 2); the request counts 2 loadable blocks."""
    from kvpool.keys import rank_key

    side, _ = make_side(lease_on_lookup=False)  # evicted between the lookup and the allocation's lease
    side.tp_world = 2
    fake = KeyedShards()
    side.shards = fake  # type: ignore[assignment]
    req = request("a")
    keys = side._keys(side._track(req))
    fake.held_keys = {bytes(rank_key(k, r, 2)) for k in keys[:3] for r in range(2)}
    assert first_answer(side, req) == (3 * BS, True)
    fake.held_keys.discard(bytes(rank_key(keys[2], 1, 2)))
    spec = leased_load(side, req, 9, 3 * BS)
    assert [b.remote is not None for b in spec.blocks] == [True, True, True, True, True, False]
    assert side.stats.leases_short == 1 and side._reqs["a"].loading == [100, 101]


def test_a_planned_holder_looks_up_the_pool_only_when_its_hbm_prefix_is_not_there() -> None:
    """The router's HOLDER counted on 4 blocks in this engine's HBM (``HOLDER_PARAM``). When vLLM's cache has them,
    nothing is looked up and nothing waits; when it has less (the router's view of the HBM was out of date), the
    pool supplies the rest like any request's instead of a full recompute, counted once in ``holders_short``."""
    from kvpool.connector.scheduler import HOLDER_PARAM

    side, fake = make_side(held=6)
    there = request("held")
    there.kv_transfer_params = {HOLDER_PARAM: 4 * BS}
    side.on_new_request(there)
    out, took = timed(side.get_num_new_matched_tokens, there, 4 * BS)
    assert out == (0, False) and took < FAST_S
    side.calls.wait_idle(5.0)
    assert side.stats.lookups == 0 and fake.lookups == [] and side.stats.holders_short == 0

    gone = request("evicted")
    gone.kv_transfer_params = {HOLDER_PARAM: 4 * BS}
    side.on_new_request(gone)
    assert side.stats.lookups == 0  # no eager lookup: vLLM's first ask tells whether the prefix is there
    until(lambda: side.get_num_new_matched_tokens(gone, BS) != (None, False))
    # looked up past vLLM's 1 cached block: keys 1..7, of which the fake holds the first 6
    assert side.get_num_new_matched_tokens(gone, BS) == (6 * BS, True) and fake.lookups == [7]
    assert side.stats.lookups == 1 and side.stats.holders_short == 1


def test_a_lookup_lease_goes_out_with_the_allocation_step() -> None:
    """``lease_on_lookup`` (default): the lookup's job also leased what it found, so the step that allocates the
    request's blocks hands the worker its load — no lease call then, even with the shard frozen by now (with the
    lease taken at the allocation the load goes out a step later: the worker reports a load at the end of the step
    it ran in, so that costs the request one more engine step)."""
    side, fake = make_side(held=6)
    req = request("a")
    assert first_answer(side, req) == (6 * BS, True)
    assert side.stats.lookup_leases == 1 and side.held_leases() == {}  # pinned, not yet a load's
    fake.lease_gate.clear()  # no lease call may be needed from here on
    _, took = timed(side.update_state_after_alloc, req, Blocks(9), 6 * BS)
    meta, took2 = timed(step, side)
    assert took < FAST_S and took2 < FAST_S
    (spec,) = meta.loads
    assert spec.req_id == "a" and [b.block_ids[0] for b in spec.blocks] == list(range(100, 106))
    assert [b.remote.offset for b in spec.blocks] == [i * 4096 for i in range(6)]
    assert side.held_leases() == {"a": [("s1", 7)]} and side.stats.lookup_leases_used == 1
    assert side.stats.leases_taken == 1 and side.stats.hit_tokens == 6 * BS
    side.request_finished(req)
    side.calls.wait_idle(5.0)
    assert fake.released == [7] and side.stats.lookup_leases_unused == 0
    assert side.stats.leases_released == side.stats.leases_taken == 1


def test_a_lookup_lease_offers_what_it_pinned_and_a_load_past_the_local_prefix_uses_its_tail() -> None:
    """Blocks the lease could not pin are not offered (the answer is what the lease pinned, not what the shard
    lists); when vLLM's own cache has grown by the allocation, the load takes the lease's slots from there on."""
    side, fake = make_side(held=6)
    real_client = fake.client

    class ShortClient(FakeClient):
        def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
            return super().lease(keys[:5], fingerprint, ttl_s)  # block 5 failed its checksum as it was leased

    fake.client = lambda shard_id: ShortClient(fake)  # type: ignore[method-assign]
    req = request("a")
    assert first_answer(side, req) == (5 * BS, True)
    fake.client = real_client  # type: ignore[method-assign]
    assert side.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, True)  # vLLM's cache holds blocks 0-1 now
    side.update_state_after_alloc(req, Blocks(9), 3 * BS)
    (spec,) = step(side).loads
    assert [b.block_ids[0] for b in spec.blocks] == [102, 103, 104]
    assert [b.remote.offset for b in spec.blocks] == [2 * 4096, 3 * 4096, 4 * 4096]
    assert len(fake.lookups) == 1 and side.stats.lookup_leases == 1


def test_a_short_lookup_lease_on_the_local_shard_has_what_it_lost_saved_again() -> None:
    """The book says blocks 0-3 were saved; the local shard still lists them, but the lookup's lease pins only 0-1
    (it dropped 2-3 on promotion: a checksum failure): 2 blocks offered, 2-3 wanted again."""
    from kvpool.connector.meta import SaveReport

    side, fake = make_side(held=4)
    side.cfg = ConnectorConfig(save=True)
    side.bind_kv_cache_manager(CacheManager())
    first = request("a", blocks=4)
    side.on_new_request(first)
    (spec,) = save_step(side, "a", 0, first.num_tokens).saves
    side.save_outcomes(SaveReport(saved=spec.keys, failed=[]))
    until(lambda: side._reqs["a"].lookup is None or side._reqs["a"].lookup.done())  # a's own lookup: a full lease

    class ShortClient(FakeClient):
        def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
            return super().lease(keys[:2], fingerprint, ttl_s)

    fake.client = lambda shard_id: ShortClient(fake)  # type: ignore[method-assign]
    assert first_answer(side, request("b", blocks=4)) == (2 * BS, True)
    assert [side.book.is_saved(k) for k in spec.keys] == [True, True, False, False]
    assert side.book.stats.lost == 2


class TwoShards(FakeShards):
    """Shards "s1" (the local one) and "s2", each holding the first ``held[shard]`` blocks of every chain. ``trips``
    records the round trips: ("lookup_many", (shard, "lease" | "lookup"), ...), ("lease", shard), ("release",
    shard, lease id)."""

    def __init__(self, held: dict[str, int], pinnable: dict[str, int] | None = None) -> None:
        super().__init__(held=0)
        self.held_by = held
        self.pinnable = pinnable or {}  # a lease pins at most this many of what the shard holds
        self.shard_ids = ["s1", "s2"]
        self.trips: list[tuple[Any, ...]] = []

    def lookup_many(self, calls: Any, fingerprint: str, deadline_s: float, *, lease_ttl_s: float | None = None
                    ) -> list[Any]:
        self.trips.append(("lookup_many", *((sid, "lease" if i == 0 and lease_ttl_s is not None else "lookup")
                                           for i, (sid, _) in enumerate(calls))))
        out: list[Any] = []
        for i, (sid, keys) in enumerate(calls):
            if i == 0 and lease_ttl_s is not None:
                out.append(self._lease(sid, keys, lease_ttl_s))
            else:
                n = min(self.held_by[sid], len(keys))
                out.append(LookupResult(n, n, 0))
        return out

    def _lease(self, shard_id: str, keys: list[bytes], ttl_s: float) -> LeaseReply:
        held = min(self.held_by[shard_id], len(keys))
        n = min(held, self.pinnable.get(shard_id, held))
        blocks = [LeasedBlock(bytes(k), i * 4096, 4096, 1, Tier.DRAM) for i, k in enumerate(keys[:n])]
        lease_id = {"s1": 7, "s2": 8}[shard_id] if n else 0
        return LeaseReply(shard_id, "e1", f"agent-{shard_id}", 0, Lease(lease_id, blocks, 0.0, ttl_s, b"", held))

    def client(self, shard_id: str) -> Any:
        shards = self

        class Client:
            def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float) -> LeaseReply:
                shards.trips.append(("lease", shard_id))
                return shards._lease(shard_id, keys, ttl_s)

            def release(self, lease_id: int) -> bool:
                shards.trips.append(("release", shard_id, lease_id))
                return True

        return Client()


def two_shard_side(held: dict[str, int], pinnable: dict[str, int] | None = None) -> tuple[SchedulerSide, TwoShards]:
    side, _ = make_side()
    fake = TwoShards(held, pinnable)
    side.shards = fake  # type: ignore[assignment]
    return side, fake


def planned(rid: str, shard: str, end: int | None = None) -> Any:
    """A request whose router plan names ``shard`` (and, with ``end``, the block the plan ends at)."""
    from kvpool.connector.scheduler import PLAN_END_PARAM, PLAN_PARAM

    req = request(rid)
    req.kv_transfer_params = {PLAN_PARAM: shard} if end is None else {PLAN_PARAM: shard, PLAN_END_PARAM: end}
    return req


def test_a_lookup_leases_its_first_shard_in_its_own_round_trip() -> None:
    """``lease_on_lookup``: the local shard (no plan) is leased in the round trip that looks up the others — one
    round trip for a hit, its answer what the lease pinned; a miss there pins nothing and releases nothing."""
    side, fake = two_shard_side({"s1": 6, "s2": 3})
    req = request("a")
    assert first_answer(side, req) == (6 * BS, True)
    assert fake.trips == [("lookup_many", ("s1", "lease"), ("s2", "lookup"))]
    assert side._reqs["a"].found.lease.lease.lease_id == 7 and side.stats.lookup_leases == 1
    spec = leased_load(side, req, 9, 6 * BS)
    assert spec.agent_name == "agent-s1" and len(spec.blocks) == 6
    assert fake.trips == [("lookup_many", ("s1", "lease"), ("s2", "lookup"))]  # the allocation used that lease

    side, fake = two_shard_side({"s1": 0, "s2": 0})
    assert first_answer(side, request("b")) == (0, False)
    side.calls.wait_idle(5.0)
    assert fake.trips == [("lookup_many", ("s1", "lease"), ("s2", "lookup"))] and side.stats.lookup_leases == 0


def test_the_routers_planned_shard_is_leased_first_and_a_shard_holding_more_wins() -> None:
    """The router's planned shard (``PLAN_PARAM``) is the one leased in the lookup's round trip. When another shard
    holds more, that one is leased in a second round trip and the first lease is released (not waited for)."""
    side, fake = two_shard_side({"s1": 2, "s2": 6})
    assert first_answer(side, planned("a", "s2")) == (6 * BS, True)
    assert fake.trips == [("lookup_many", ("s2", "lease"), ("s1", "lookup"))]
    assert side._reqs["a"].found.shard_id == "s2" and side._reqs["a"].found.lease.lease.lease_id == 8

    side, fake = two_shard_side({"s1": 2, "s2": 6})
    assert first_answer(side, request("b")) == (6 * BS, True)  # no plan: the local shard s1 first, s2 holds more
    side.calls.wait_idle(5.0)
    assert fake.trips[0] == ("lookup_many", ("s1", "lease"), ("s2", "lookup"))
    assert sorted(fake.trips[1:]) == [("lease", "s2"), ("release", "s1", 7)]
    found = side._reqs["b"].found
    assert found.shard_id == "s2" and found.lease.lease.lease_id == 8 and found.local_prefix == 2


def test_a_planned_fetch_asks_its_shard_alone_while_it_holds_the_plan() -> None:
    """A plan that names its shard and its end block (``PLAN_END_PARAM``): that shard alone is leased, one call of
    one round trip, no other shard asked. When it holds less than the plan (the router's view was out of date),
    the others are looked up after it, and one holding more is leased instead."""
    side, fake = two_shard_side({"s1": 6, "s2": 6})
    assert first_answer(side, planned("a", "s2", 6)) == (6 * BS, True)
    assert fake.trips == [("lookup_many", ("s2", "lease"))]
    assert side._reqs["a"].found.lease.lease.lease_id == 8 and side._reqs["a"].found.local_prefix is None

    side, fake = two_shard_side({"s1": 6, "s2": 4})
    assert first_answer(side, planned("b", "s2", 6)) == (6 * BS, True)
    side.calls.wait_idle(5.0)
    assert fake.trips[:2] == [("lookup_many", ("s2", "lease")), ("lookup_many", ("s1", "lookup"))]
    assert sorted(fake.trips[2:]) == [("lease", "s1"), ("release", "s2", 8)]
    assert side._reqs["b"].found.shard_id == "s1" and side._reqs["b"].found.local_prefix == 6


@pytest.mark.parametrize("pinnable", [0, 3])
def test_a_lookup_lease_that_pins_less_than_its_shard_holds_offers_what_it_pinned_and_says_so(pinnable: int) -> None:
    """The shard held 6 blocks but its lease pinned fewer (no DRAM to promote SSD blocks into, a checksum): only
    the pinned blocks are offered, counted as a short lease, and as an empty one too when none was pinned (as a
    lease taken after its lookup counts them)."""
    side, fake = two_shard_side({"s1": 6, "s2": 0}, {"s1": pinnable})
    assert first_answer(side, request("a")) == (pinnable * BS, pinnable > 0)
    assert (side.stats.leases_short, side.stats.lookup_leases_empty) == ((1, 0) if pinnable else (1, 1))


def test_an_unused_lookup_lease_is_released() -> None:
    """A lookup's lease no load used is released: when its request ends, when a newer lookup replaces it, and when
    it is too old at the allocation (over half its ttl: the allocation leases again)."""
    side, fake = make_side(held=6)
    ended = request("ended")
    assert first_answer(side, ended) == (6 * BS, True)
    side.request_finished(ended)
    side.calls.wait_idle(5.0)
    assert fake.released == [7] and side.stats.lookup_leases_unused == 1
    assert side.stats.leases_released == side.stats.leases_taken == 0  # a load's leases only

    replaced = request("replaced")
    assert first_answer(side, replaced) == (6 * BS, True)
    r = side._reqs["replaced"]
    r.found = replace(r.found, at=r.found.at - side.cfg.lease_ttl_s)  # a leased answer is refreshed after ttl/4
    assert side.get_num_new_matched_tokens(replaced, 0) == (6 * BS, True)  # answers now, looks up again
    side.calls.wait_idle(5.0)
    assert side.get_num_new_matched_tokens(replaced, 0) == (6 * BS, True)  # the new lookup (and lease) answers
    side.calls.wait_idle(5.0)
    assert fake.released == [7, 7] and side.stats.lookup_leases == 3 and side.stats.lookup_leases_unused == 2
    side.request_finished(replaced)

    side.cfg = ConnectorConfig(save=False, lookup_deadline_s=5.0, lease_ttl_s=0.2)
    old = request("old")
    assert first_answer(side, old) == (6 * BS, True)
    time.sleep(0.15)  # over half the lease's ttl
    side.update_state_after_alloc(old, Blocks(9), 6 * BS)
    assert "old" in side._leasing and side.stats.lookup_leases_unused == 4  # "replaced" ended with one too
    until(lambda: side._leasing["old"].future.done())
    (spec,) = step(side).loads
    assert all(b.remote is not None for b in spec.blocks) and side.stats.lookup_leases_used == 0


def test_a_lookup_lease_of_a_request_that_ended_first_is_released() -> None:
    """A request that ends before vLLM asked again (its lookup done, never read) or while its lookup is still in
    flight leaves no lease behind: the first is released at the end, the second when its lookup comes back."""
    side, fake = make_side(held=6)
    unread = request("unread")
    side.on_new_request(unread)
    side.calls.wait_idle(5.0)
    side.request_finished(unread)
    side.calls.wait_idle(5.0)
    assert fake.released == [7]
    fake.lookup_gate.clear()
    late = request("late")
    side.on_new_request(late)
    side.request_finished(late)
    fake.lookup_gate.set()
    until(lambda: fake.released == [7, 7])
    assert side.stats.lookup_leases == 2 and side.stats.lookup_leases_unused == 2 and side.stats.leases_released == 0


def test_a_small_leased_hit_on_the_own_shard_loads_inline_in_its_allocation_step() -> None:
    """"Inline loads": the lookup leased 6 blocks on the local shard and they fit ``inline_load_max_bytes``, so
    vLLM is told the load is synchronous (no ``WAITING_FOR_REMOTE_KVS`` step): the allocation's step hands the
    worker an inline ``LoadSpec``, with no pool call then. Its outcome is the step's invalid block ids: a block that
    failed from block 2 on leaves 2 blocks loaded in the request's timing."""
    from kvpool.connector.timing import from_params

    side, fake = make_side(held=6)
    side.block_bytes = 4096  # the workers' handshake: 6 blocks = 24 KiB, under the 16 MiB default
    side.inline_shard = "s1"  # ... and every worker maps the local shard s1 through shared memory
    req = request("a")
    assert first_answer(side, req) == (6 * BS, False)
    fake.lease_gate.clear()  # no lease call may be needed from here on
    _, took = timed(side.update_state_after_alloc, req, Blocks(9), 6 * BS)
    meta, took2 = timed(step, side)
    assert took < FAST_S and took2 < FAST_S
    (spec,) = meta.loads
    assert spec.inline and spec.req_id == "a" and [b.block_ids[0] for b in spec.blocks] == list(range(100, 106))
    assert all(b.remote is not None for b in spec.blocks)
    assert side.stats.loads_inline == 1 and side.stats.lookup_leases_used == 1
    side.load_outcomes(set(), set(), {102, 104})  # the step's output: blocks 102 and 104 failed
    _, params = side.request_finished(req)
    timing = from_params(params)
    assert timing is not None and timing.loaded_tokens == 2 * BS


@pytest.mark.parametrize("why", ["too_big", "other_shard", "not_mapped", "no_lookup_lease", "off"])
def test_a_hit_that_cannot_load_inline_waits_for_its_load_as_before(why: str) -> None:
    """Over ``inline_load_max_bytes``, on a shard the workers do not read through shared memory (another node's; or
    the handshake named none: shared memory off, a shard that does not export its arena), without a lease from its
    lookup, or with inline loads off: vLLM is told the load is asynchronous, and the spec is not inline."""
    side, fake = make_side(held=6, lease_on_lookup=why != "no_lookup_lease")
    side.block_bytes, side.inline_shard = 4096, "s1" if why != "not_mapped" else ""
    if why == "too_big":
        side.cfg = replace_cfg(side.cfg, inline_load_max_bytes=5 * 4096)
    elif why == "off":
        side.cfg = replace_cfg(side.cfg, inline_load_max_bytes=0)
    elif why == "other_shard":
        side.inline_shard = "s2"
    req = request("a")
    assert first_answer(side, req) == (6 * BS, True)
    spec = leased_load(side, req, 9, 6 * BS)
    assert not spec.inline and side.stats.loads_inline == 0


def test_an_inline_hit_that_vllm_trims_is_recomputed_never_waited_for() -> None:
    """vLLM allocated fewer external tokens than the inline answer (it trimmed the hit): the connector cannot vouch
    for them, and vLLM will not wait, so the step's spec carries those blocks without a slot: the worker reports
    them invalid and vLLM recomputes them."""
    side, _ = make_side(held=6)
    side.block_bytes, side.inline_shard = 4096, "s1"
    req = request("a")
    assert first_answer(side, req) == (6 * BS, False)
    side.update_state_after_alloc(req, Blocks(9), 4 * BS)
    (spec,) = step(side).loads
    assert spec.inline and [b.block_ids[0] for b in spec.blocks] == list(range(100, 104))
    assert all(b.remote is None for b in spec.blocks)


def replace_cfg(cfg: ConnectorConfig, **kw: Any) -> ConnectorConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **kw)
