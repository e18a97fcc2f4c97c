"""One conformance suite for the block store, run against each tier a block can live in (DRAM, SSD).

A ``TierPlacement`` puts committed blocks into the tier under test (SSD: commit, then demote) and corrupts a block
where it lives (DRAM: the arena bytes; SSD: the slab file), so every test below states the contract once and checks
it for both tiers. The SSD tier is a real slab file in a temporary directory; the clock is injected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.checksum import block_checksum
from kvpool.events import EventKind, Tier
from kvpool.keys import Namespace, block_keys
from kvpool.store import BlockStore, StoreConfig
from router.index import PrefixIndex
from router.policies.base import PoolHit

SLOT = 4096
FP = "f" * 32


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def keys_for(n: int, salt: str = "") -> list[bytes]:
    return block_keys(Namespace("m", FP, salt), list(range(n * 4)), 4)


def write_and_commit(store: BlockStore, keys: list[bytes], seeds: list[int], fingerprint: str = FP) -> list[int]:
    res = store.reserve(len(keys))
    assert len(res.slots) == len(keys), "test setup: not enough DRAM slots"
    for slot, seed in zip(res.slots, seeds, strict=True):
        store.arena.view(slot)[:] = payload(seed)
    out = store.commit(res.reservation_id, keys, [block_checksum(payload(s)) for s in seeds], fingerprint)
    return out.committed


def leased_bytes(store: BlockStore, keys: list[bytes], ttl: float = 30.0) -> tuple[int, list[bytes]]:
    lease = store.lease(keys, FP, ttl)
    return lease.lease_id, [bytes(store.arena.buffer[b.offset : b.offset + b.length]) for b in lease.blocks]


class TierPlacement:
    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def place(self, store: BlockStore, keys: list[bytes], seeds: list[int]) -> None:
        assert write_and_commit(store, keys, seeds) == list(range(len(keys)))
        if self.tier is Tier.SSD:
            assert store.demote(keys) == len(keys)
        for k in keys:
            info = store.entry_info(k)
            assert info is not None and info.tier is self.tier

    def corrupt(self, store: BlockStore, key: bytes) -> None:
        info = store.entry_info(key)
        assert info is not None and info.tier is self.tier
        if self.tier is Tier.DRAM:
            store.arena.array[info.offset + 17] ^= 0xFF
        else:
            with open(info.path, "r+b") as f:
                f.seek(info.offset + 17)
                b = f.read(1)
                f.seek(info.offset + 17)
                f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(params=[Tier.DRAM, Tier.SSD], ids=["dram", "ssd"])
def tier(request: pytest.FixtureRequest) -> TierPlacement:
    return TierPlacement(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(tmp_path: Path, clock: FakeClock) -> Iterator:
    made: list[BlockStore] = []

    def _make(dram: int = 8, ssd: int = 8, **kw: object) -> BlockStore:
        cfg = StoreConfig(slot_bytes=SLOT, dram_slots=dram, ssd_dir=os.fspath(tmp_path / f"ssd{len(made)}"),
                          ssd_slots=ssd, **kw)  # type: ignore[arg-type]
        s = BlockStore(cfg, shard_id=f"s{len(made)}", clock=clock)
        made.append(s)
        return s

    yield _make
    for s in made:
        s.close()


def test_committed_blocks_are_visible_in_their_tier(tier: TierPlacement, make_store) -> None:
    store = make_store()
    keys = keys_for(4)
    tier.place(store, keys, [0, 1, 2, 3])
    res = store.lookup(keys, FP)
    assert res.prefix == 4
    assert (res.dram, res.ssd) == ((4, 0) if tier.tier is Tier.DRAM else (0, 4))
    lease_id, data = leased_bytes(store, keys)
    assert lease_id and data == [payload(i) for i in range(4)]
    assert store.read_block(keys[2], FP) == payload(2)


def test_only_committed_blocks_are_visible(tier: TierPlacement, make_store) -> None:
    store = make_store()
    done, pending = keys_for(2, "a"), keys_for(2, "b")
    tier.place(store, done, [0, 1])
    res = store.reserve(2)
    for slot in res.slots:
        store.arena.view(slot)[:] = payload(9)
    assert store.lookup(pending, FP).prefix == 0
    assert store.lease(pending, FP, 5.0).blocks == []
    assert store.lookup(done, FP).prefix == 2


def test_abort_and_expiry_leave_nothing(tier: TierPlacement, make_store, clock: FakeClock) -> None:
    store = make_store(dram=4)
    base = keys_for(1, "base")
    tier.place(store, base, [7])
    seq = store.stats().event_seq
    free_before = store.stats().dram.free
    keys = keys_for(2)
    res = store.reserve(2)
    for slot, seed in zip(res.slots, [0, 1], strict=True):
        store.arena.view(slot)[:] = payload(seed)
    assert store.abort(res.reservation_id)
    assert not store.abort(res.reservation_id)
    late = store.commit(res.reservation_id, keys, [block_checksum(payload(0)), block_checksum(payload(1))], FP)
    assert late.committed == [] and late.error
    # Expiry: a reservation that is never committed is swept by the clock.
    res2 = store.reserve(2)
    clock.advance(store.config.reservation_ttl_s + 0.1)
    assert store.sweep() == (0, 1)
    assert store.commit(res2.reservation_id, keys, [0, 0], FP).error
    st = store.stats()
    assert st.dram.free == free_before and st.reserved_slots == 0 and st.reservations == 0
    assert store.lookup(keys, FP).prefix == 0
    assert st.event_seq == seq  # nothing was ever announced
    assert store.lookup(base, FP).prefix == 1


def test_commit_verifies_checksums_over_the_arena(make_store) -> None:
    store = make_store()
    keys = keys_for(3)
    res = store.reserve(3)
    for slot, seed in zip(res.slots, [0, 1, 2], strict=True):
        store.arena.view(slot)[:] = payload(seed)
    sums = [block_checksum(payload(0)), block_checksum(payload(99)), block_checksum(payload(2))]
    out = store.commit(res.reservation_id, keys, sums, FP)
    assert out.committed == [0, 2] and out.rejected == [1]
    assert store.lookup(keys, FP).prefix == 1  # the prefix stops at the rejected block
    assert store.metrics.value("kvstack_pool_checksum_failures_total", tier="dram", stage="commit") == 1
    assert store.stats().dram.free == store.config.dram_slots - 2


def test_checksum_verified_on_read_corruption_is_a_miss(tier: TierPlacement, make_store) -> None:
    store = make_store()
    keys = keys_for(4)
    tier.place(store, keys, [0, 1, 2, 3])
    tier.corrupt(store, keys[2])
    before = store.metrics.value("kvstack_pool_checksum_failures_total", tier=tier.tier.value)
    lease = store.lease(keys, FP, 10.0)
    assert [b.key for b in lease.blocks] == keys[:2]  # served up to the bad block, never the bad bytes
    assert lease.held == 4  # the store held all 4 when asked: the lease says it pinned fewer than that
    data = [bytes(store.arena.buffer[b.offset : b.offset + b.length]) for b in lease.blocks]
    assert data == [payload(0), payload(1)]
    after = store.metrics.value("kvstack_pool_checksum_failures_total", tier=tier.tier.value)
    assert after == before + 1
    assert store.lookup(keys, FP).prefix == 2  # the corrupted block is gone
    assert store.entry_info(keys[2]) is None
    assert store.read_block(keys[3], FP) == payload(3)  # later blocks intact


def test_read_block_detects_corruption(tier: TierPlacement, make_store) -> None:
    store = make_store()
    keys = keys_for(1)
    tier.place(store, keys, [5])
    tier.corrupt(store, keys[0])
    assert store.read_block(keys[0], FP) is None
    assert store.counters[f"checksum_failures_{tier.tier.value}"] == 1


def test_fingerprint_mismatch_is_a_miss(tier: TierPlacement, make_store) -> None:
    store = make_store()
    keys = keys_for(3)
    tier.place(store, keys, [0, 1, 2])
    other = "0" * 32
    assert store.lookup(keys, other).prefix == 0
    assert store.lease(keys, other, 5.0).blocks == []
    assert store.read_block(keys[0], other) is None
    assert store.lookup(keys, FP).prefix == 3


def test_lookup_has_no_side_effects(tier: TierPlacement, make_store) -> None:
    store = make_store(dram=4, ssd=8)
    old, new = keys_for(2, "old"), keys_for(2, "new")
    tier.place(store, old, [0, 1])
    tier.place(store, new, [2, 3])
    before = store.stats()
    for _ in range(3):
        store.lookup(old, FP)
    after = store.stats()
    assert (after.event_seq, after.dram, after.ssd, after.leases) == (
        before.event_seq, before.dram, before.ssd, before.leases)
    if tier.tier is Tier.DRAM:  # a lookup does not refresh LRU: `old` is still demoted first
        write_and_commit(store, keys_for(2, "more"), [4, 5])
        assert store.lookup(old, FP).ssd == 2 and store.lookup(new, FP).dram == 2


def test_leased_blocks_are_never_evicted(tier: TierPlacement, make_store) -> None:
    store = make_store(dram=4, ssd=4)
    leased, other = keys_for(2, "leased"), keys_for(2, "other")
    tier.place(store, leased, [0, 1])
    tier.place(store, other, [2, 3])
    lease = store.lease(leased, FP, 60.0)
    assert len(lease.blocks) == 2
    # Pressure: fill everything several times over; only unleased blocks may move or go.
    for round_ in range(4):
        write_and_commit(store, keys_for(2, f"fill{round_}"), [10 + 2 * round_, 11 + 2 * round_])
        assert store.lookup(leased, FP).dram == 2
    data = [bytes(store.arena.buffer[b.offset : b.offset + b.length]) for b in lease.blocks]
    assert data == [payload(0), payload(1)]
    assert store.lookup(other, FP).prefix == 0  # evicted through SSD
    assert store.counters["evictions_ssd"] > 0
    # With DRAM = 2 leased + 2 free slots, a reserve of 4 gets only what is not pinned.
    assert len(store.reserve(4).slots) == 2
    assert store.release(lease.lease_id) and not store.release(lease.lease_id)


def test_lease_expiry_with_injected_clock(tier: TierPlacement, make_store, clock: FakeClock) -> None:
    store = make_store(dram=2, ssd=2)
    keys = keys_for(2)
    tier.place(store, keys, [0, 1])
    lease = store.lease(keys, FP, 5.0)
    assert len(lease.blocks) == 2 and lease.expires_at == clock.now + 5.0
    assert store.reserve(2).slots == []  # everything pinned
    clock.advance(4.9)
    assert store.sweep() == (0, 0)
    clock.advance(0.2)
    assert store.sweep() == (1, 0)
    assert store.metrics.value("kvstack_pool_leases_expired_total") == 1
    assert not store.release(lease.lease_id)  # already expired
    assert len(store.reserve(2).slots) == 2  # now evictable: demoted to SSD
    assert store.lookup(keys, FP).ssd == 2


def test_demotion_and_read_back(tier: TierPlacement, make_store) -> None:
    store = make_store(dram=3, ssd=6)
    first = keys_for(3, "first")
    tier.place(store, first, [0, 1, 2])
    write_and_commit(store, keys_for(3, "second"), [3, 4, 5])  # DRAM full → `first` (if in DRAM) demoted
    res = store.lookup(first, FP)
    assert (res.prefix, res.ssd) == (3, 3)
    assert store.counters["demotions"] >= 3
    lease_id, data = leased_bytes(store, first)
    assert data == [payload(0), payload(1), payload(2)]  # promoted back, checksum verified
    assert store.lookup(first, FP).dram == 3
    assert store.counters["promotions"] == 3
    assert store.release(lease_id)


def test_lease_larger_than_dram_serves_the_prefix_that_fits(tier: TierPlacement, make_store) -> None:
    store = make_store(dram=3, ssd=8)
    keys = keys_for(5)
    write_and_commit(store, keys[:3], [0, 1, 2])
    write_and_commit(store, keys[3:], [3, 4])  # first blocks demoted
    if tier.tier is Tier.SSD:
        store.demote(keys)
    lease_id, data = leased_bytes(store, keys)
    assert data == [payload(i) for i in range(3)]  # the servable prefix: DRAM holds 3
    assert store.lookup(keys, FP).prefix == 5  # nothing was lost on the way
    store.release(lease_id)


def test_prefix_stops_at_the_first_missing_block(tier: TierPlacement, make_store) -> None:
    store = make_store()
    keys = keys_for(4)
    tier.place(store, [keys[0], keys[1], keys[3]], [0, 1, 3])
    assert store.lookup(keys, FP).prefix == 2
    lease = store.lease(keys, FP, 5.0)
    assert len(lease.blocks) == 2 and lease.held == 2


def test_duplicate_commit_keeps_the_first_copy(tier: TierPlacement, make_store) -> None:
    store = make_store()
    keys = keys_for(2)
    tier.place(store, keys, [0, 1])
    res = store.reserve(2)
    for slot in res.slots:
        store.arena.view(slot)[:] = payload(8)
    out = store.commit(res.reservation_id, keys, [block_checksum(payload(8))] * 2, FP)
    assert out.duplicate == [0, 1] and out.committed == []
    assert store.read_block(keys[0], FP) == payload(0)


def test_no_ssd_tier_evicts_from_dram(make_store, tmp_path: Path, clock: FakeClock) -> None:
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=2), clock=clock)
    a, b = keys_for(2, "a"), keys_for(2, "b")
    write_and_commit(store, a, [0, 1])
    write_and_commit(store, b, [2, 3])
    assert store.lookup(a, FP).prefix == 0 and store.lookup(b, FP).prefix == 2
    assert store.counters["evictions_dram"] == 2
    store.close()


def test_events_describe_the_store(tier: TierPlacement, make_store, clock: FakeClock) -> None:
    store = make_store(dram=3, ssd=3)
    index = PrefixIndex(clock=lambda: 0.0)
    index.apply_shard_snapshot(store.snapshot(), "node")
    for i in range(4):
        tier.place(store, keys_for(2, f"r{i}"), [2 * i, 2 * i + 1])
        tier.corrupt(store, keys_for(2, f"r{i}")[1])
        store.lease(keys_for(2, f"r{i}"), FP, 1.0)
        clock.advance(2.0)
    batch = store.events_since(0)
    kinds = {e.kind for e in batch.events}
    assert {EventKind.STORED, EventKind.REMOVED} <= kinds
    if tier.tier is Tier.SSD:
        assert EventKind.TIER_CHANGED in kinds
    assert [e.seq for e in batch.events] == list(range(1, len(batch.events) + 1))
    index.apply_shard_batch(batch, "node")
    snap = store.snapshot()
    assert index.cursor("shard", store.shard_id) == (store.epoch, snap.seq)  # applied in order, no resync wanted
    expected = {k: [PoolHit(store.shard_id, "node", t.value, 1)] for k, t in zip(snap.keys, snap.tiers, strict=True)}
    assert {k: list(index.query([k]).pool) for k in snap.keys} == expected
    assert len(index) == len(snap.keys)


def test_touched_blocks_outlive_untouched_ones(make_store, tmp_path: Path, clock: FakeClock) -> None:
    """A prefix an engine keeps serving from HBM is touched, never leased: touch keeps it in the pool's DRAM."""
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=4), clock=clock)
    hot, cold, new = keys_for(2, "hot"), keys_for(2, "cold"), keys_for(2, "new")
    write_and_commit(store, hot, [0, 1])
    write_and_commit(store, cold, [2, 3])
    assert store.touch(hot + keys_for(1, "absent"), FP) == 2  # only held keys count
    assert store.touch(hot, "other-layout") == 0
    write_and_commit(store, new, [4, 5])  # evicts the least recently used two: cold, not hot
    assert store.lookup(hot, FP).prefix == 2 and store.lookup(cold, FP).prefix == 0
    assert store.counters["touched"] == 2
    store.close()


def test_without_touch_the_oldest_blocks_go_first(make_store, tmp_path: Path, clock: FakeClock) -> None:
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=4), clock=clock)
    hot, cold, new = keys_for(2, "hot"), keys_for(2, "cold"), keys_for(2, "new")
    write_and_commit(store, hot, [0, 1])
    write_and_commit(store, cold, [2, 3])
    write_and_commit(store, new, [4, 5])
    assert store.lookup(hot, FP).prefix == 0 and store.lookup(cold, FP).prefix == 2
    store.close()


def test_each_model_has_its_own_accounting(make_store) -> None:
    """Blocks are counted per layout fingerprint (one model each) and tier, labelled with the writer's model id,
    through commit, demotion, promotion on lease and eviction — in the stats and the ``model_blocks`` gauge."""
    from prometheus_client import generate_latest

    store = make_store(dram=4, ssd=2)
    fa, fb = "a" * 32, "b" * 32

    def commit(keys: list[bytes], seeds: list[int], fp: str, model: str) -> None:
        res = store.reserve(len(keys))
        for slot, seed in zip(res.slots, seeds, strict=True):
            store.arena.view(slot)[:] = payload(seed)
        out = store.commit(res.reservation_id, keys, [block_checksum(payload(s)) for s in seeds], fp, model=model)
        assert out.committed == list(range(len(keys)))

    def counts() -> dict[str, tuple[str, int, int]]:
        return {fp: (ls.model, ls.dram_blocks, ls.ssd_blocks) for fp, ls in store.stats().layouts.items()}

    alpha, beta = keys_for(3, "alpha"), keys_for(1, "beta")
    commit(alpha, [0, 1, 2], fa, "alpha")
    commit(beta, [3], fb, "beta")
    assert counts() == {fa: ("alpha", 3, 0), fb: ("beta", 1, 0)}
    assert store.demote(alpha[:2]) == 2
    assert counts() == {fa: ("alpha", 1, 2), fb: ("beta", 1, 0)}
    lease = store.lease(alpha[:1], fa, 30.0)  # promotes the first block back to DRAM
    assert len(lease.blocks) == 1
    assert counts() == {fa: ("alpha", 2, 1), fb: ("beta", 1, 0)}
    store.release(lease.lease_id)
    text = generate_latest(store.metrics.registry).decode()
    assert f'kvstack_pool_model_blocks{{layout="{fa}",model="alpha",shard="{store.shard_id}",tier="ssd"}} 1.0' in text
    commit(keys_for(4, "gamma"), [4, 5, 6, 7], fb, "beta")  # fills DRAM: the older blocks go to SSD or out
    st = store.stats()
    assert sum(ls.dram_blocks for ls in st.layouts.values()) == st.dram.blocks
    assert sum(ls.ssd_blocks for ls in st.layouts.values()) == st.ssd.blocks
    assert counts()[fb][0] == "beta" and counts()[fb][1] == 4
    if fa not in counts():  # every alpha block evicted: its series is gone too
        assert f'layout="{fa}"' not in generate_latest(store.metrics.registry).decode()


def test_grants_cover_exactly_what_their_lease_or_reservation_holds(make_store, tier: TierPlacement, clock) -> None:
    """Module doc, "Grants": a lease's grant covers its blocks' slots for reading (an SSD block: the DRAM slot it
    was promoted to), a reservation's its slots for reading and writing; nothing else, not across a slot's end, and
    nothing once the lease or reservation is gone (release, expiry, commit, abort)."""
    store = make_store()
    keys, others = keys_for(2, "granted"), keys_for(1, "other")
    tier.place(store, keys, [1, 2])
    tier.place(store, others, [3])
    lease = store.lease(keys, FP, 30.0)
    other = store.lease(others, FP, 30.0)
    assert len(lease.blocks) == 2 and len(lease.grant) == 16 and lease.grant != other.grant
    spans = [(b.offset, b.length) for b in lease.blocks]
    assert store.granted([lease.grant], spans, write=False)
    assert store.granted([lease.grant], [(spans[1][0] + 100, 50)], write=False)  # a piece of a slot
    assert store.granted([other.grant, lease.grant], spans + [(other.blocks[0].offset, SLOT)], write=False)
    assert not store.granted([lease.grant], spans, write=True)  # a lease never grants writing
    assert not store.granted([], spans, write=False)
    assert not store.granted([b"\0" * 16], spans, write=False)
    assert not store.granted([lease.grant], [(other.blocks[0].offset, SLOT)], write=False)
    assert not store.granted([lease.grant], [(spans[0][0] + 1, SLOT)], write=False)  # across the slot's end
    assert not store.granted([lease.grant], [(spans[0][0], 0)], write=False)
    assert store.release(lease.lease_id)
    assert not store.granted([lease.grant], spans, write=False)
    clock.advance(31.0)
    store.sweep()
    assert not store.granted([other.grant], [(other.blocks[0].offset, SLOT)], write=False)  # expired

    res = store.reserve(2)
    mine = [(off, SLOT) for off in res.offsets]
    assert store.granted([res.grant], mine, write=True) and store.granted([res.grant], mine, write=False)
    assert not store.granted([res.grant], spans, write=True)  # committed blocks are nobody's to write
    for slot, seed in zip(res.slots, (5, 6), strict=True):
        store.arena.view(slot)[:] = payload(seed)
    store.commit(res.reservation_id, keys_for(2, "new"), [block_checksum(payload(s)) for s in (5, 6)], FP)
    assert not store.granted([res.grant], mine, write=True)  # committed: the grant is gone
    res = store.reserve(1)
    assert store.abort(res.reservation_id) and not store.granted([res.grant], [(res.offsets[0], SLOT)], write=True)
