"""The block store's locking contract (``kvpool.store``, "Thread-safe"): SSD reads and writes run outside its lock.

The store is under test; its neighbour, the disk, is a real ``SsdSlab`` in a temporary directory whose ``write`` /
``read_into`` can be made to block on a ``threading.Event`` (``GatedSlab``: a slow disk). While a demotion's write
(during a ``reserve`` or a ``demote``) or a promotion's read (during a ``lease``) is blocked, calls on other threads
must complete within a deadline; once the copy is let go the store must be consistent: counts, tiers, checksums,
every slot in exactly one place (an entry, a reservation, a free list or a move in flight), free counts adding up.
The races: a block leased while it demotes, leases released or expired while a promotion is in flight, a second lease
of a block being promoted, a corrupted SSD block found by a promotion outside the lock.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpool.store
from kvpool.checksum import block_checksum
from kvpool.events import EventKind, Tier
from kvpool.keys import Namespace, block_keys
from kvpool.ssd import SsdSlab
from kvpool.store import BlockStore, StoreConfig

SLOT = 4096
FP = "c" * 32
DEADLINE_S = 5.0  # a call that does not wait on the blocked copy answers well within this


class Gate:
    """Armed: the next callers wait (``entered`` is set) until ``go``; then every caller passes."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.go = threading.Event()
        self.waiting = 0

    def arm(self) -> None:
        self.armed, self.waiting = True, 0
        self.entered.clear()
        self.go.clear()

    def open(self) -> None:
        self.armed = False
        self.go.set()

    def pass_through(self) -> None:
        if self.armed:
            self.waiting += 1
            self.entered.set()
            assert self.go.wait(30), "test gate never opened"


class GatedSlab(SsdSlab):
    """A real slab whose writes / reads wait at a gate (a slow disk); ``delay`` sleeps a random bit in each."""

    made: list[GatedSlab] = []

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.write_gate = Gate()
        self.read_gate = Gate()
        self.delay: Callable[[], None] = lambda: None
        GatedSlab.made.append(self)

    def write(self, slot: int, data: memoryview) -> None:
        self.write_gate.pass_through()
        self.delay()
        super().write(slot, data)

    def read_into(self, slot: int, out: memoryview) -> int:
        self.read_gate.pass_through()
        self.delay()
        return super().read_into(slot, out)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def keys_for(n: int, salt: str) -> list[bytes]:
    return block_keys(Namespace("m", FP, salt), list(range(n * 4)), 4)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(max_workers=8, thread_name_prefix="store-test")
    yield ex
    for slab in GatedSlab.made:  # never leave a thread at a gate, even when a test failed
        slab.write_gate.open()
        slab.read_gate.open()
    ex.shutdown(wait=True)
    GatedSlab.made.clear()


@pytest.fixture
def make_store(tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setattr(kvpool.store, "SsdSlab", GatedSlab)
    made: list[BlockStore] = []

    def _make(dram: int = 8, ssd: int = 8, **kw: Any) -> tuple[BlockStore, GatedSlab]:
        cfg = StoreConfig(slot_bytes=SLOT, dram_slots=dram, ssd_dir=os.fspath(tmp_path / f"ssd{len(made)}"),
                          ssd_slots=ssd, **kw)
        s = BlockStore(cfg, shard_id=f"s{len(made)}", clock=clock)
        made.append(s)
        assert isinstance(s.ssd, GatedSlab)
        return s, s.ssd

    yield _make
    for s in made:
        s.close(timeout_s=1.0)


class Book:
    """What the test wrote: key → payload seed, to check every block's bytes at the end."""

    def __init__(self) -> None:
        self.seeds: dict[bytes, int] = {}

    def commit(self, store: BlockStore, keys: list[bytes], seeds: list[int]) -> None:
        res = store.reserve(len(keys))
        assert len(res.slots) == len(keys), "test setup: not enough DRAM slots"
        self.fill(store, res.reservation_id, res.slots, keys, seeds)

    def fill(self, store: BlockStore, rid: int, slots: list[int], keys: list[bytes], seeds: list[int]) -> None:
        for slot, seed in zip(slots, seeds, strict=True):
            store.arena.view(slot)[:] = payload(seed)
        out = store.commit(rid, keys, [block_checksum(payload(s)) for s in seeds], FP)
        assert out.committed == list(range(len(keys)))
        self.seeds.update(zip(keys, seeds, strict=True))


def within(fut: Future) -> Any:
    """The call's result, which must come within the deadline (it must not wait on the blocked copy)."""
    return fut.result(timeout=DEADLINE_S)


def entered(gate: Gate) -> None:
    assert gate.entered.wait(DEADLINE_S), "the copy never started"


def leased_bytes(store: BlockStore, lease: kvpool.store.Lease) -> list[bytes]:
    return [bytes(store.arena.buffer[b.offset : b.offset + b.length]) for b in lease.blocks]


def check_consistent(store: BlockStore, book: Book | None = None, *, settled: bool = True) -> None:
    """Counts, tiers, slots and (when ``book`` is given) every visible block's bytes. Reads the store's private
    state on purpose: no slot may be in two places."""
    st = store.stats()
    assert store.ssd is not None
    with store._lock:
        entries = list(store._entries.values())
        reserved = [s for r in store._reservations.values() for s in r.slots]
        moves = list(store._moves)
        dram_free, ssd_free = list(store.arena._free), list(store.ssd._free)
        pins_by_key: dict[bytes, int] = {}
        for lease in store._leases.values():
            for k in lease.keys:
                pins_by_key[k] = pins_by_key.get(k, 0) + 1
    dram_owned = [e.slot for e in entries if e.tier is Tier.DRAM] + reserved + dram_free
    ssd_owned = [e.slot for e in entries if e.tier is Tier.SSD] + ssd_free
    for m in moves:  # the slots a move holds beyond its entry's own
        if m.kind.value == "demote":
            ssd_owned.append(m.ssd_slot)
            dram_owned += [m.dram_slot] if m.dropped else []
        elif m.kind.value == "promote":
            dram_owned += [m.dram_slot] if m.dram_slot >= 0 else []
            ssd_owned += [m.ssd_slot] if m.dropped else []
        else:
            ssd_owned += [m.ssd_slot] if m.dropped else []
    assert len(dram_owned) == len(set(dram_owned)), f"a DRAM slot is in two places: {sorted(dram_owned)}"
    assert len(ssd_owned) == len(set(ssd_owned)), f"an SSD slot is in two places: {sorted(ssd_owned)}"
    assert set(dram_owned) == set(range(store.arena.n_slots)), "a DRAM slot is lost"
    assert set(ssd_owned) == set(range(store.ssd.n_slots)), "an SSD slot is lost"
    n_dram = sum(e.tier is Tier.DRAM for e in entries)
    assert (st.dram.blocks, st.ssd.blocks) == (n_dram, len(entries) - n_dram)
    assert st.dram.blocks + st.dram.free + st.reserved_slots + st.dram.in_transit == st.dram.capacity
    assert st.ssd.blocks + st.ssd.free + st.ssd.in_transit == st.ssd.capacity
    assert sum(ls.dram_blocks for ls in st.layouts.values()) == st.dram.blocks
    assert sum(ls.ssd_blocks for ls in st.layouts.values()) == st.ssd.blocks
    if settled:
        assert not moves and st.dram.in_transit == 0 and st.ssd.in_transit == 0
        assert all(e.move is None for e in entries)
        for e in entries:
            assert e.pins == pins_by_key.get(e.key, 0), f"pins of {e.key.hex()[:8]}: {e.pins}"
            assert e.tier is Tier.DRAM or e.pins == 0, "a pinned block in SSD"
    if book is not None:
        for e in entries:
            assert store.read_block(e.key, FP) == payload(book.seeds[e.key]), f"bytes of {e.key.hex()[:8]}"


# ---------------------------------------------------------------------------------------------- demotion blocked
def test_calls_complete_while_a_reserves_demotion_write_is_blocked(make_store, pool) -> None:
    store, slab = make_store(dram=8, ssd=8)
    book = Book()
    old, hot, new = keys_for(4, "old"), keys_for(2, "hot"), keys_for(2, "new")
    book.commit(store, old, [0, 1, 2, 3])
    book.commit(store, hot, [10, 11])
    pre = store.reserve(2)  # DRAM is full now: 6 blocks + 2 reserved slots
    assert len(pre.slots) == 2
    victim_slots = [store.entry_info(k).slot for k in old[:2]]  # type: ignore[union-attr]

    slab.write_gate.arm()
    reserving = pool.submit(store.reserve, 2)  # demotes old[0], old[1] (LRU), the write blocks
    entered(slab.write_gate)
    assert within(pool.submit(store.lookup, old, FP)) == kvpool.store.LookupResult(4, 4, 0)  # still in DRAM
    lease = within(pool.submit(store.lease, hot, FP, 30.0))
    assert leased_bytes(store, lease) == [payload(10), payload(11)]
    assert within(pool.submit(store.release, lease.lease_id))
    assert within(pool.submit(book.fill, store, pre.reservation_id, pre.slots, new, [20, 21])) is None
    assert within(pool.submit(store.touch, hot, FP)) == 2
    assert within(pool.submit(store.held, old + new, FP)) == [True] * 6
    assert within(pool.submit(store.sweep)) == (0, 0)
    st = within(pool.submit(store.stats))
    assert st.ssd.in_transit == 2 and st.dram.in_transit == 0
    check_consistent(store, settled=False)
    assert not reserving.done()

    slab.write_gate.open()
    res = within(reserving)
    assert sorted(res.slots) == sorted(victim_slots)  # the demoted blocks' slots, now the reservation's
    assert [store.entry_info(k).tier for k in old] == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]  # type: ignore
    assert store.stats().counters["demotions"] == 2
    store.abort(res.reservation_id)
    check_consistent(store, book)


def test_a_block_leased_while_it_demotes_stays_in_dram(make_store, pool) -> None:
    store, slab = make_store(dram=4, ssd=4)
    book = Book()
    keys = keys_for(4, "k")
    book.commit(store, keys, [0, 1, 2, 3])
    slab.write_gate.arm()
    demoting = pool.submit(store.demote, keys[:1])
    entered(slab.write_gate)
    lease = within(pool.submit(store.lease, keys[:1], FP, 30.0))
    assert [b.from_tier for b in lease.blocks] == [Tier.DRAM]
    slab.write_gate.open()
    assert within(demoting) == 0  # abandoned: it was leased meanwhile
    info = store.entry_info(keys[0])
    assert info is not None and info.tier is Tier.DRAM and info.pins == 1
    assert leased_bytes(store, lease) == [payload(0)]
    st = store.stats()
    assert st.ssd.free == 4 and st.counters["demotions"] == 0
    check_consistent(store, book)
    assert store.release(lease.lease_id)
    assert store.demote(keys[:1]) == 1  # unpinned: it moves now
    check_consistent(store, book)


def test_a_corrupted_block_dropped_while_it_demotes_keeps_its_slot_until_the_write_ends(make_store, pool) -> None:
    store, slab = make_store(dram=4, ssd=4)
    book = Book()
    keys = keys_for(2, "k")
    book.commit(store, keys, [0, 1])
    slot = store.entry_info(keys[0]).slot  # type: ignore[union-attr]
    store.arena.array[store.arena.offset(slot) + 5] ^= 0xFF  # bit rot in DRAM
    slab.write_gate.arm()
    demoting = pool.submit(store.demote, keys[:1])
    entered(slab.write_gate)
    lease = within(pool.submit(store.lease, keys, FP, 30.0))  # its DRAM check fails: dropped, never served
    assert lease.blocks == [] and store.entry_info(keys[0]) is None
    assert slot not in store.arena._free  # the write still reads it: on no free list
    res = within(pool.submit(store.reserve, 2))
    assert slot not in res.slots and len(res.slots) == 2  # the free slots, not the one the copy reads
    check_consistent(store, settled=False)
    slab.write_gate.open()
    assert within(demoting) == 0
    assert store.stats().counters["checksum_failures_dram"] == 1
    store.abort(res.reservation_id)
    check_consistent(store, book)
    assert slot in store.arena._free and store.stats().ssd.free == 4


def test_a_reserve_gets_fewer_slots_when_its_victim_is_leased_during_the_write(make_store, pool) -> None:
    store, slab = make_store(dram=4, ssd=4)
    book = Book()
    keys = keys_for(4, "k")
    book.commit(store, keys, [0, 1, 2, 3])
    slab.write_gate.arm()
    reserving = pool.submit(store.reserve, 1)  # victim: keys[0]
    entered(slab.write_gate)
    lease = within(pool.submit(store.lease, keys[:1], FP, 30.0))
    slab.write_gate.open()
    res = within(reserving)
    assert res.slots == []  # DRAM full of pinned blocks after all: fewer slots, never a leased block's slot
    assert store.entry_info(keys[0]).tier is Tier.DRAM  # type: ignore[union-attr]
    assert leased_bytes(store, lease) == [payload(0)]
    check_consistent(store, book)


# ---------------------------------------------------------------------------------------------- promotion blocked
def test_calls_complete_while_a_leases_promotion_read_is_blocked(make_store, pool) -> None:
    store, slab = make_store(dram=6, ssd=4)
    book = Book()
    cold, hot, new = keys_for(2, "cold"), keys_for(2, "hot"), keys_for(2, "new")
    book.commit(store, cold, [0, 1])
    assert store.demote(cold) == 2
    book.commit(store, hot, [10, 11])

    slab.read_gate.arm()
    promoting = pool.submit(store.lease, cold, FP, 30.0)
    entered(slab.read_gate)
    assert within(pool.submit(store.lookup, cold, FP)) == kvpool.store.LookupResult(2, 0, 2)  # still in SSD
    lease = within(pool.submit(store.lease, hot, FP, 30.0))
    assert leased_bytes(store, lease) == [payload(10), payload(11)]
    assert within(pool.submit(store.release, lease.lease_id))
    res = within(pool.submit(store.reserve, 2))  # the 2 free slots: no demotion needed
    assert len(res.slots) == 2
    within(pool.submit(book.fill, store, res.reservation_id, res.slots, new, [20, 21]))
    st = within(pool.submit(store.stats))
    assert st.dram.in_transit == 2 and st.dram.free == 0
    check_consistent(store, settled=False)
    second = pool.submit(store.lease, cold, FP, 30.0)  # waits for the promotion, then leases the DRAM copies
    assert not promoting.done()

    slab.read_gate.open()
    first = within(promoting)
    assert [b.from_tier for b in first.blocks] == [Tier.SSD, Tier.SSD]
    assert leased_bytes(store, first) == [payload(0), payload(1)]
    again = within(second)
    assert [b.from_tier for b in again.blocks] == [Tier.DRAM, Tier.DRAM]
    assert [b.offset for b in again.blocks] == [b.offset for b in first.blocks]
    assert store.stats().counters["promotions"] == 2
    check_consistent(store, book)
    assert store.entry_info(cold[0]).pins == 2  # type: ignore[union-attr]


def test_leases_released_or_expired_while_a_promotion_is_in_flight(make_store, pool, clock) -> None:
    store, slab = make_store(dram=4, ssd=4)
    book = Book()
    keys = keys_for(2, "k")
    book.commit(store, keys, [0, 1])
    assert store.demote(keys[1:]) == 1  # keys[0] in DRAM, keys[1] in SSD
    other = store.lease(keys[:1], FP, 30.0)

    slab.read_gate.arm()
    promoting = pool.submit(store.lease, keys, FP, 1.0)  # pins keys[0] too; expires 1 s after it was asked for
    entered(slab.read_gate)
    assert within(pool.submit(store.release, other.lease_id))  # a lease of the same block, released meanwhile
    short = within(pool.submit(store.lease, keys[:1], FP, 0.5))
    clock.now += 2.0
    assert within(pool.submit(store.sweep)) == (1, 0)  # ... and one expired meanwhile
    assert store.entry_info(keys[0]).pins == 1  # type: ignore[union-attr]  # only the lease in flight
    slab.read_gate.open()
    lease = within(promoting)
    assert leased_bytes(store, lease) == [payload(0), payload(1)]
    assert lease.expires_at < clock.now  # its own TTL ran out while its read was blocked
    check_consistent(store, book)
    assert store.sweep() == (1, 0)
    assert not store.release(lease.lease_id) and not store.release(short.lease_id)
    assert [store.entry_info(k).pins for k in keys] == [0, 0]  # type: ignore[union-attr]
    assert store.entry_info(keys[1]).tier is Tier.DRAM  # type: ignore[union-attr]
    check_consistent(store, book)


def test_a_corrupted_ssd_block_found_by_a_promotion_outside_the_lock_is_dropped(make_store, pool) -> None:
    store, slab = make_store(dram=4, ssd=4)
    book = Book()
    keys = keys_for(3, "k")
    book.commit(store, keys, [0, 1, 2])
    assert store.demote(keys) == 3
    info = store.entry_info(keys[1])
    assert info is not None
    with open(info.path, "r+b") as f:  # a bit flip on the disk
        f.seek(info.offset + 17)
        b = f.read(1)
        f.seek(info.offset + 17)
        f.write(bytes([b[0] ^ 0xFF]))
    seq = store.stats().event_seq

    slab.read_gate.arm()
    first = pool.submit(store.lease, keys, FP, 30.0)
    entered(slab.read_gate)
    second = pool.submit(store.lease, keys, FP, 30.0)  # waits for the first one's promotions
    assert within(pool.submit(store.lookup, keys, FP)).ssd == 3
    slab.read_gate.open()
    for lease in (within(first), within(second)):
        assert [b.key for b in lease.blocks] == keys[:1]  # the prefix ends at the bad block: never its bytes
        assert leased_bytes(store, lease) == [payload(0)]
    assert store.entry_info(keys[1]) is None
    assert store.lookup(keys, FP).prefix == 1
    assert store.read_block(keys[1], FP) is None
    st = store.stats()
    assert st.counters["checksum_failures_ssd"] == 1
    removed = [e for e in store.events_since(seq).events if e.kind is EventKind.REMOVED]
    assert [e.key for e in removed] == [keys[1]]
    check_consistent(store, book)


def test_read_block_reads_ssd_outside_the_lock(make_store, pool) -> None:
    store, slab = make_store(dram=4, ssd=4)
    book = Book()
    cold, hot = keys_for(1, "cold"), keys_for(1, "hot")
    book.commit(store, cold, [0])
    assert store.demote(cold) == 1
    book.commit(store, hot, [1])
    slab.read_gate.arm()
    reading = pool.submit(store.read_block, cold[0], FP)
    entered(slab.read_gate)
    assert within(pool.submit(store.read_block, hot[0], FP)) == payload(1)
    lease = within(pool.submit(store.lease, hot, FP, 30.0))
    assert within(pool.submit(store.release, lease.lease_id))
    leasing = pool.submit(store.lease, cold, FP, 30.0)  # waits for the read, then promotes
    slab.read_gate.open()
    assert within(reading) == payload(0)
    got = within(leasing)
    assert leased_bytes(store, got) == [payload(0)] and got.blocks[0].from_tier is Tier.SSD
    check_consistent(store, book)


# ---------------------------------------------------------------------------------------------- many threads
def test_many_threads_on_a_slow_disk_keep_the_store_consistent(make_store, pool) -> None:
    store, slab = make_store(dram=12, ssd=16)
    rng = random.Random(7)
    slab.delay = lambda: threading.Event().wait(rng.random() * 0.002)
    book = Book()
    groups = [keys_for(3, f"g{i}") for i in range(12)]
    seeds = {k: 100 * gi + j for gi, g in enumerate(groups) for j, k in enumerate(g)}
    book.seeds.update(seeds)
    bad: list[str] = []

    def worker(wid: int) -> None:
        r = random.Random(wid)
        for _ in range(120):
            g = r.choice(groups)
            op = r.random()
            if op < 0.35:
                res = store.reserve(len(g))
                if len(res.slots) < len(g):
                    store.abort(res.reservation_id)
                    continue
                for slot, k in zip(res.slots, g, strict=True):
                    store.arena.view(slot)[:] = payload(seeds[k])
                store.commit(res.reservation_id, g, [block_checksum(payload(seeds[k])) for k in g], FP)
            elif op < 0.8:
                lease = store.lease(g, FP, 30.0)
                for b, data in zip(lease.blocks, leased_bytes(store, lease), strict=True):
                    if data != payload(seeds[b.key]) or b.checksum != block_checksum(data):
                        bad.append(f"lease of {b.key.hex()[:8]} served wrong bytes")
                if lease.lease_id:
                    store.release(lease.lease_id)
            elif op < 0.9:
                store.demote(g)
            else:
                data = store.read_block(g[0], FP)
                if data is not None and data != payload(seeds[g[0]]):
                    bad.append(f"read_block of {g[0].hex()[:8]} returned wrong bytes")

    futs = [pool.submit(worker, w) for w in range(4)]
    for f in futs:
        f.result(timeout=120)
    assert not bad, bad[:5]
    st = store.stats()
    assert st.counters["demotions"] > 0 and st.counters["promotions"] > 0
    assert st.counters["checksum_failures_dram"] == st.counters["checksum_failures_ssd"] == 0
    check_consistent(store, book)


def test_a_lease_or_read_waits_for_a_stuck_copy_at_most_move_wait_s(make_store, pool) -> None:
    """A disk that never answers holds no other call past ``move_wait_s``: a second lease of the blocks being
    promoted ends before them (a miss), a read of one misses; both come back once the wait is over."""
    store, slab = make_store(dram=6, ssd=4, move_wait_s=0.3)
    book = Book()
    hot, cold = keys_for(1, "hot"), keys_for(2, "cold")
    book.commit(store, cold, [0, 1])
    assert store.demote(cold) == 2
    slab.read_gate.arm()
    promoting = pool.submit(store.lease, cold, FP, 30.0)
    entered(slab.read_gate)
    t = time.monotonic()
    second = within(pool.submit(store.lease, cold, FP, 30.0))
    assert second.blocks == [] and second.lease_id == 0
    assert within(pool.submit(store.read_block, cold[0], FP)) is None
    assert 0.3 <= time.monotonic() - t < DEADLINE_S
    book.commit(store, hot, [5])  # meanwhile the rest of the store serves as always
    assert leased_bytes(store, within(pool.submit(store.lease, hot, FP, 30.0))) == [payload(5)]
    slab.read_gate.open()
    assert leased_bytes(store, within(promoting)) == [payload(0), payload(1)]
    assert store.read_block(cold[0], FP) == payload(0)
    check_consistent(store)
