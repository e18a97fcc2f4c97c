"""ShardSync (router/shard_sync.py) over the real block store: deltas, gaps, epochs, failures, concurrency."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.checksum import block_checksum
from kvpool.events import EventBatch, ShardSnapshot
from kvpool.store import BlockStore, StoreConfig
from router.index import PrefixIndex
from router.shard_sync import ShardSync
from tests.fakes.router import RouterClock

SLOT = 256
FP = "fp"
NODE = "node-x"


class StoreSource:
    """The real store behind the ShardEvents protocol, in-process (the Ray path is
    kvpool.shard.client.ShardEventSource)."""

    def __init__(self, store: BlockStore, *, hang: bool = False) -> None:
        self.store = store
        self.shard_id = store.shard_id
        self.fail = False
        self.hang = hang  # never answers: the call runs into its deadline
        self.snapshots = 0
        self.calls = 0  # events calls

    async def _check(self, deadline_s: float) -> None:
        if self.fail:
            raise ConnectionError("shard down")
        if self.hang:
            await asyncio.wait_for(asyncio.Event().wait(), timeout=deadline_s)

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float,
                           wait_s: float = 0.0) -> EventBatch:
        await self._check(deadline_s)
        self.calls += 1
        if wait_s > 0:  # the store's long poll holds its thread (a thread of the shard actor's "events" group)
            return await asyncio.to_thread(self.store.events_since, after_seq, max_events, wait_s)
        return self.store.events_since(after_seq, max_events)

    async def snapshot(self, deadline_s: float) -> ShardSnapshot:
        await self._check(deadline_s)
        self.snapshots += 1
        return self.store.snapshot()


def new_store(tmp: Path, sid: str, *, log_cap: int = 1024, dram: int = 4, ssd: int = 4) -> BlockStore:
    cfg = StoreConfig(slot_bytes=SLOT, dram_slots=dram, ssd_dir=os.fspath(tmp / sid), ssd_slots=ssd,
                      event_log_capacity=log_cap)
    return BlockStore(cfg, shard_id=sid)


def put(store: BlockStore, keys: list[bytes]) -> None:
    res = store.reserve(len(keys))
    sums = []
    for slot, k in zip(res.slots, keys, strict=False):
        store.arena.view(slot)[:] = (k * (SLOT // len(k)))[:SLOT]
        sums.append(block_checksum(store.arena.view(slot)))
    store.commit(res.reservation_id, keys[: len(res.slots)], sums, FP)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def new_sync(**kw: object) -> ShardSync:
    return ShardSync(PrefixIndex(clock=RouterClock()), **kw)  # type: ignore[arg-type]


def tier_of(idx: PrefixIndex, shard_id: str, k: bytes) -> str | None:
    """Where the index says ``shard_id`` holds ``k`` (a one-block query: block 0 of its own chain)."""
    hits = [h for h in idx.query([k]).pool if h.shard_id == shard_id]
    assert len(hits) <= 1 and all(h.prefix_blocks == 1 and h.node_id == NODE for h in hits)
    return hits[0].tier if hits else None


def mirror_matches(idx: PrefixIndex, store: BlockStore) -> bool:
    snap = store.snapshot()
    sid = store.shard_id
    mine = {k: t.value for k, t in zip(snap.keys, snap.tiers, strict=True)}
    theirs = {k: tier_of(idx, sid, k) for k in mine}
    counted = idx.held_blocks("shard", sid, "dram") + idx.held_blocks("shard", sid, "ssd")
    return mine == theirs and counted == len(mine) and idx.cursor("shard", sid) == (store.epoch, snap.seq)


def test_deltas_follow_the_store(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a")
    sync = new_sync()
    src = StoreSource(store)
    sync.set_shards([(src, NODE)])
    asyncio.run(sync.poll_once())  # unknown shard → snapshot
    assert src.snapshots == 1
    for i in range(0, 12, 2):
        put(store, [key(i), key(i + 1)])  # DRAM 4 + SSD 4: demotions and evictions happen
        rep = asyncio.run(sync.poll_once())
        assert rep.applied["a"] > 0 and not rep.resynced
        assert mirror_matches(sync.index, store)
    assert src.snapshots == 1  # never needed another


def test_gap_triggers_resync(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a", log_cap=4)
    sync = new_sync()
    src = StoreSource(store)
    sync.set_shards([(src, NODE)])
    asyncio.run(sync.poll_once())
    for i in range(0, 8, 2):
        put(store, [key(i), key(i + 1)])  # far more than 4 events: the ring forgot our position
    rep = asyncio.run(sync.poll_once())
    assert rep.resynced == ["a"] and src.snapshots == 2
    assert mirror_matches(sync.index, store)


def test_out_of_order_batch_makes_the_shard_stale_and_the_next_poll_resyncs(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a")
    sync = new_sync()
    src = StoreSource(store)
    sync.set_shards([(src, NODE)])
    sync.index.apply_shard_snapshot(store.snapshot(), NODE)
    put(store, [key(1), key(2)])
    sync.index.apply_shard_batch(store.events_since(1), NODE)  # skips event 1
    assert sync.index.cursor("shard", "a") is None
    rep = asyncio.run(sync.poll_once())
    assert rep.resynced == ["a"] and mirror_matches(sync.index, store)


def test_restarted_shard_new_epoch_resyncs(tmp_path: Path) -> None:
    old = new_store(tmp_path, "a")
    put(old, [key(1), key(2)])
    sync = new_sync()
    sync.set_shards([(StoreSource(old), NODE)])
    asyncio.run(sync.poll_once())
    assert tier_of(sync.index, "a", key(1)) == "dram"
    old.close()
    new = new_store(tmp_path, "a")  # same shard id, new epoch, empty
    put(new, [key(7)])
    sync.set_shards([(StoreSource(new), NODE)])
    rep = asyncio.run(sync.poll_once())
    assert rep.resynced == ["a"]
    assert tier_of(sync.index, "a", key(1)) is None and tier_of(sync.index, "a", key(7)) == "dram"
    assert mirror_matches(sync.index, new)


def test_failing_shard_is_forgotten_then_resynced(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a")
    put(store, [key(1)])
    sync = new_sync(forget_after_failures=2)
    src = StoreSource(store)
    sync.set_shards([(src, NODE)])
    asyncio.run(sync.poll_once())
    src.fail = True
    rep1 = asyncio.run(sync.poll_once())
    assert "a" in rep1.failed and tier_of(sync.index, "a", key(1)) == "dram"  # one failure: kept
    rep2 = asyncio.run(sync.poll_once())
    assert rep2.forgotten == ["a"] and tier_of(sync.index, "a", key(1)) is None
    src.fail = False
    asyncio.run(sync.poll_once())
    assert tier_of(sync.index, "a", key(1)) == "dram"


def test_pool_hits_per_shard_tier_and_unlisted_shards_are_forgotten(tmp_path: Path) -> None:
    a, b = new_store(tmp_path, "a", dram=8), new_store(tmp_path, "b", dram=2, ssd=8)
    keys = [key(i) for i in range(5)]
    put(a, keys[:2])
    put(b, keys[:2])
    put(b, keys[2:4])  # b demotes its first two
    sync = new_sync()
    sync.set_shards([(StoreSource(a), NODE), (StoreSource(b), NODE)])
    asyncio.run(sync.poll_once())
    hits = {(h.shard_id, h.tier): h.prefix_blocks for h in sync.index.query(keys).pool}
    assert hits == {("a", "dram"): 2, ("b", "ssd"): 2}  # b's DRAM copy starts at block 2: no prefix
    assert sync.index.query([key(99)] + keys).pool == ()
    assert sync.node_of("b") == NODE and sorted(sync.shard_ids()) == ["a", "b"]
    sync.set_shards([(StoreSource(a), NODE)])  # b left the cluster
    assert [h.shard_id for h in sync.index.query(keys).pool] == ["a"] and sync.node_of("b") is None


def test_a_hung_shard_costs_only_its_own_deadline(tmp_path: Path) -> None:
    fast = new_store(tmp_path, "fast")
    put(fast, [key(1)])
    sync = new_sync(deadline_s=0.5)
    hung = [(StoreSource(new_store(tmp_path, f"slow{i}"), hang=True), NODE) for i in range(3)]
    sync.set_shards([*hung, (StoreSource(fast), NODE)])
    t0 = time.monotonic()
    rep = asyncio.run(sync.poll_once())
    took = time.monotonic() - t0
    assert sorted(rep.failed) == ["slow0", "slow1", "slow2"]
    assert all("TimeoutError" in why for why in rep.failed.values())
    assert rep.resynced == ["fast"] and mirror_matches(sync.index, fast)
    assert took < 1.0  # side by side: one deadline (0.5 s), not three one after the other (1.5 s)


def test_run_keeps_syncing_the_others_while_one_shard_hangs(tmp_path: Path) -> None:
    fast, slow = new_store(tmp_path, "fast"), new_store(tmp_path, "slow")
    sync = new_sync(deadline_s=5.0)
    shards = [(StoreSource(slow, hang=True), NODE), (StoreSource(fast), NODE)]

    async def listed() -> list:  # type: ignore[type-arg]
        return shards

    async def scenario() -> float:
        task = asyncio.create_task(sync.run(listed, interval_s=0.01, relist_s=0.05))
        try:
            await asyncio.sleep(0.1)
            put(fast, [key(3)])
            t0 = time.monotonic()
            while tier_of(sync.index, "fast", key(3)) is None:
                await asyncio.sleep(0.01)
                assert time.monotonic() - t0 < 2.0, "the fast shard's events did not arrive"
            return time.monotonic() - t0
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    assert asyncio.run(scenario()) < 1.0  # far below the hung shard's 5 s deadline
    assert sync.index.cursor("shard", "slow") is None


def test_the_stores_long_poll_answers_at_the_next_event_or_after_its_wait(tmp_path: Path) -> None:
    store = new_store(tmp_path, "s")
    put(store, [key(1)])
    seq = store.events_since(0).last_seq
    t0 = time.monotonic()
    assert [e.key for e in store.events_since(0, wait_s=5.0).events] == [key(1)]  # events there: at once
    assert store.events_since(seq + 7, wait_s=5.0).gap  # a cursor of another epoch: at once
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    quiet = store.events_since(seq, wait_s=0.2)  # nothing new: waits, then answers with nothing
    assert not quiet.events and not quiet.gap and quiet.last_seq == seq
    assert 0.15 <= time.monotonic() - t0 < 2.0
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(store.events_since, seq, 4096, 10.0)
        time.sleep(0.1)
        assert not waiting.done()
        put(store, [key(2)])
        # timed from the event, not from the submit: on a box busy with other work the put itself once took 10 s
        put_at = time.monotonic()
        got = waiting.result(timeout=5.0)
        took = time.monotonic() - put_at
    assert [e.key for e in got.events] == [key(2)]
    assert took < 2.0  # woken by the event, far before its 10 s wait


def test_run_long_polls_an_idle_shard_and_still_sees_a_new_event_at_once(tmp_path: Path) -> None:
    """``run`` with ``wait_s``: an idle shard is asked once per wait, not once per interval; an event written while
    the router waits reaches the index without waiting for the next poll. The same loop without ``wait_s`` polls
    every interval (the contrast)."""

    async def scenario(wait_s: float) -> tuple[int, float]:
        store = new_store(tmp_path, f"idle-{wait_s}")
        src = StoreSource(store)
        sync = new_sync(deadline_s=5.0, wait_s=wait_s)

        async def listed() -> list:  # type: ignore[type-arg]
            return [(src, NODE)]

        task = asyncio.create_task(sync.run(listed, interval_s=0.02, relist_s=5.0))
        try:
            await asyncio.sleep(0.8)  # idle
            calls = src.calls
            put(store, [key(9)])
            t0 = time.monotonic()
            while tier_of(sync.index, store.shard_id, key(9)) is None:
                await asyncio.sleep(0.005)
                assert time.monotonic() - t0 < 5.0, "the event never reached the index"
            return calls, time.monotonic() - t0
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    calls, seen_after = asyncio.run(scenario(wait_s=0.5))
    assert calls <= 4  # 0.8 s idle: the snapshot's call, then about one call per 0.5 s wait
    assert seen_after < 0.3  # not at the next poll, half a second later
    plain_calls, _ = asyncio.run(scenario(wait_s=0.0))
    assert plain_calls >= 15  # one call per 20 ms interval


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "lease", "demote"]), st.integers(0, 9)), max_size=25),
       cap=st.integers(2, 16))
def test_random_histories_converge(tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]],
                                   cap: int) -> None:
    store = new_store(tmp_path_factory.mktemp("h"), "a", log_cap=cap, dram=3, ssd=3)
    sync = new_sync(max_events=3)
    sync.set_shards([(StoreSource(store), NODE)])
    for op, i in ops:
        if op == "put":
            put(store, [key(i)])
        elif op == "lease":
            store.release(store.lease([key(i)], FP, 5.0).lease_id)
        else:
            store.demote([key(i)])
        if i % 3 == 0:
            asyncio.run(sync.poll_once())
    asyncio.run(sync.poll_once())
    assert mirror_matches(sync.index, store)
    store.close()
