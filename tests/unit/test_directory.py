"""Directory client copy (kvpool/directory.py): deltas, gaps, epochs, failures, prefix answers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.checksum import block_checksum
from kvpool.directory import Directory, DirectorySync, key_range
from kvpool.events import EventBatch, ShardSnapshot, Tier
from kvpool.store import BlockStore, StoreConfig

SLOT = 256
FP = "fp"


class StoreSource:
    """The real store behind the EventSource protocol, in-process (the Ray path is ShardEventSource)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.shard_id = store.shard_id
        self.fail = False
        self.snapshots = 0

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float) -> EventBatch:
        if self.fail:
            raise ConnectionError("shard down")
        return self.store.events_since(after_seq, max_events)

    async def snapshot(self, deadline_s: float) -> ShardSnapshot:
        if self.fail:
            raise ConnectionError("shard down")
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


def mirror_matches(d: Directory, store: BlockStore) -> bool:
    snap = store.snapshot()
    mine = {k: t for k, t in zip(snap.keys, snap.tiers, strict=True)}
    theirs = {k: h[store.shard_id] for k in mine for h in [d.locate(k)] if store.shard_id in h}
    return mine == theirs and d.cursor(store.shard_id) == (store.epoch, snap.seq)


def test_deltas_follow_the_store(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a")
    d = Directory()
    sync = DirectorySync(d)
    src = StoreSource(store)
    sync.set_sources([src])
    asyncio.run(sync.poll_once())  # unknown shard → snapshot
    assert src.snapshots == 1
    for i in range(0, 12, 2):
        put(store, [key(i), key(i + 1)])  # DRAM 4 + SSD 4: demotions and evictions happen
        rep = asyncio.run(sync.poll_once())
        assert rep.applied["a"] > 0 and not rep.resynced
        assert mirror_matches(d, store)
    assert src.snapshots == 1  # never needed another


def test_gap_triggers_resync(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a", log_cap=4)
    d = Directory()
    sync = DirectorySync(d)
    src = StoreSource(store)
    sync.set_sources([src])
    asyncio.run(sync.poll_once())
    for i in range(0, 8, 2):
        put(store, [key(i), key(i + 1)])  # far more than 4 events: the ring forgot our position
    rep = asyncio.run(sync.poll_once())
    assert rep.resynced == ["a"] and src.snapshots == 2
    assert mirror_matches(d, store)


def test_restarted_shard_new_epoch_resyncs(tmp_path: Path) -> None:
    old = new_store(tmp_path, "a")
    put(old, [key(1), key(2)])
    d = Directory()
    sync = DirectorySync(d)
    sync.set_sources([StoreSource(old)])
    asyncio.run(sync.poll_once())
    assert d.locate(key(1)) == {"a": Tier.DRAM}
    old.close()
    new = new_store(tmp_path, "a")  # same shard id, new epoch, empty
    put(new, [key(7)])
    sync.set_sources([StoreSource(new)])
    rep = asyncio.run(sync.poll_once())
    assert rep.resynced == ["a"]
    assert d.locate(key(1)) == {} and d.locate(key(7)) == {"a": Tier.DRAM}
    assert mirror_matches(d, new)


def test_failing_shard_is_forgotten_then_resynced(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a")
    put(store, [key(1)])
    d = Directory()
    sync = DirectorySync(d, forget_after_failures=2)
    src = StoreSource(store)
    sync.set_sources([src])
    asyncio.run(sync.poll_once())
    src.fail = True
    rep1 = asyncio.run(sync.poll_once())
    assert "a" in rep1.failed and d.locate(key(1)) == {"a": Tier.DRAM}  # one failure: kept
    rep2 = asyncio.run(sync.poll_once())
    assert rep2.forgotten == ["a"] and d.locate(key(1)) == {}
    src.fail = False
    asyncio.run(sync.poll_once())
    assert d.locate(key(1)) == {"a": Tier.DRAM}


def test_prefix_per_shard_longest_first(tmp_path: Path) -> None:
    a, b = new_store(tmp_path, "a", dram=8), new_store(tmp_path, "b", dram=2, ssd=8)
    keys = [key(i) for i in range(5)]
    put(a, keys[:2])
    put(b, keys[:2])
    put(b, keys[2:4])  # b demotes its first two
    d = Directory()
    sync = DirectorySync(d)
    sync.set_sources([StoreSource(a), StoreSource(b)])
    asyncio.run(sync.poll_once())
    holdings = d.prefix(keys)
    assert [(h.shard_id, h.prefix, h.dram, h.ssd) for h in holdings] == [("b", 4, 2, 2), ("a", 2, 2, 0)]
    assert d.prefix([key(99)] + keys) == []
    sync.set_sources([StoreSource(a)])  # b left the cluster
    assert [h.shard_id for h in d.prefix(keys)] == ["a"]


def test_apply_refuses_out_of_order_batches(tmp_path: Path) -> None:
    store = new_store(tmp_path, "a")
    d = Directory()
    d.load_snapshot(store.snapshot())
    put(store, [key(1), key(2)])
    batch = store.events_since(1)  # skips event 1
    assert not d.apply(batch)
    assert d.apply(store.events_since(0))


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "lease", "demote"]), st.integers(0, 9)), max_size=25),
       cap=st.integers(2, 16))
def test_random_histories_converge(tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]],
                                   cap: int) -> None:
    store = new_store(tmp_path_factory.mktemp("h"), "a", log_cap=cap, dram=3, ssd=3)
    d = Directory()
    sync = DirectorySync(d, max_events=3)
    sync.set_sources([StoreSource(store)])
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
    assert mirror_matches(d, store)
    store.close()


def test_key_range_partition() -> None:
    assert key_range(b"\x00\x00" + bytes(14), 4) == 0
    assert key_range(b"\xff\xff" + bytes(14), 4) == 3
    assert key_range(b"\x80\x00" + bytes(14), 2) == 1
    with pytest.raises(ValueError):
        key_range(bytes(16), 0)
