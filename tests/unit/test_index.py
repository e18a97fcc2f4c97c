"""The cluster prefix view: longest prefixes per holder, event ordering / resync per source, TTL, snapshots."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.events import EVENTS_WIRE_VERSION, BlockEvent, EventBatch, EventKind, ShardSnapshot, Tier
from router.hub import ReplicaReport
from router.index import PrefixIndex
from router.policies.base import PoolHit, ReplicaColumns
from tests.fakes.router import RouterClock, router_keys, router_replica, router_request

KEYS = router_keys(64)


def rep(replica: str, seq: int, *, stored: Sequence[bytes] = (), removed: Sequence[bytes] = (), full: bool = False,
        node: str = "node-0", version: int | None = None) -> ReplicaReport:
    """Report ``seq`` of a replica, as it publishes it to the hub (a delta after ``seq - 1``, or ``full``)."""
    extra = {} if version is None else {"version": version}
    return ReplicaReport(replica_id=replica, node_id=node, seq=seq, running=0, waiting=0, stored=list(stored),
                         removed=list(removed), full=full, **extra)


def sbatch(shard: str, after: int, events: list[tuple[EventKind, bytes, Tier]], *, epoch: str = "e1",
           gap: bool = False) -> EventBatch:
    evs = [BlockEvent(after + i + 1, kind, key, tier) for i, (kind, key, tier) in enumerate(events)]
    return EventBatch(EVENTS_WIRE_VERSION, shard, epoch, after, after + len(evs), evs, gap)


def test_longest_prefix_per_replica_and_shard_tier() -> None:
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_replica_report(rep("r0", 1, stored=KEYS[:10]))
    idx.apply_replica_report(rep("r1", 1, stored=KEYS[:3] + KEYS[4:20]))  # a hole at block 3
    idx.apply_shard_batch(
        sbatch("s0", 0, [(EventKind.STORED, k, Tier.DRAM) for k in KEYS[:5]]
               + [(EventKind.STORED, k, Tier.SSD) for k in KEYS[:30]]),
        node_id="node-3",
    )
    m = idx.query(KEYS[:40])
    assert m.hbm == {"r0": 10, "r1": 3}
    assert sorted(m.pool, key=lambda h: h.tier) == [
        PoolHit("s0", "node-3", "dram", 5),
        PoolHit("s0", "node-3", "ssd", 30),
    ]
    assert idx.query([]).hbm == {} and idx.query(router_keys(3, salt="other")).pool == ()
    idx.apply_replica_report(rep("r0", 2, removed=KEYS[7:10]))
    assert idx.query(KEYS).hbm["r0"] == 7
    idx.apply_replica_report(rep("r0", 3, full=True))  # the whole key set: empty (vLLM reset its prefix cache)
    assert "r0" not in idx.query(KEYS).hbm and idx.held_blocks("replica", "r0", "hbm") == 0


def test_shard_tier_moves() -> None:
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_shard_batch(sbatch("s0", 0, [(EventKind.STORED, k, Tier.DRAM) for k in KEYS[:8]]), node_id="n")
    idx.apply_shard_batch(sbatch("s0", 8, [(EventKind.TIER_CHANGED, k, Tier.SSD) for k in KEYS[4:8]]), node_id="n")
    tiers = {h.tier: h.prefix_blocks for h in idx.query(KEYS).pool}
    assert tiers == {"dram": 4}  # the SSD copy starts at block 4, so it is no prefix
    idx.apply_shard_batch(sbatch("s0", 12, [(EventKind.TIER_CHANGED, k, Tier.SSD) for k in KEYS[:4]]), node_id="n")
    assert {h.tier: h.prefix_blocks for h in idx.query(KEYS).pool} == {"ssd": 8}


def test_query_cost_is_proportional_to_the_matched_length() -> None:
    class Counting(list):  # type: ignore[type-arg]
        touched = 0

        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            out = super().__getitem__(i)
            Counting.touched += len(out) if isinstance(i, slice) else 1
            return out

    keys = router_keys(20_000)
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_replica_report(rep("r0", 1, stored=keys[:10]))
    idx.apply_replica_report(rep("r1", 1, stored=keys[:5000]))
    req = Counting(keys)
    assert idx.query(req).hbm == {"r0": 10, "r1": 5000}
    assert Counting.touched <= 2 * 5000 + 64
    Counting.touched = 0
    idx.remove_source("replica", "r1")
    assert idx.query(req).hbm == {"r0": 10} and Counting.touched <= 64


def test_gap_marks_stale_requests_resync_and_snapshot_repairs() -> None:
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_replica_report(rep("r0", 1, stored=KEYS[:4]))
    assert not idx.is_stale("replica", "r0") and idx.take_resync_requests("replica") == []
    # seq 2 is lost: the batch after seq 2 arrives; it is applied but the source is stale.
    idx.apply_replica_report(rep("r0", 3, stored=KEYS[10:12]))
    assert idx.is_stale("replica", "r0") and idx.cursor("replica", "r0") is None
    assert idx.take_resync_requests("shard") == []
    (req,) = idx.take_resync_requests("replica")
    assert (req.source_kind, req.source_id) == ("replica", "r0") and "gap" in req.reason
    # More events while waiting (seq 4), then the snapshot taken at seq 3 arrives: state = snapshot + seq 4.
    idx.apply_replica_report(rep("r0", 4, removed=KEYS[:1]))
    idx.apply_replica_report(rep("r0", 3, stored=KEYS[:8], full=True))
    assert not idx.is_stale("replica", "r0") and idx.cursor("replica", "r0") == ("r0", 4)
    assert idx.query(KEYS).hbm == {}  # block 0 removed at seq 4, replayed after the snapshot
    assert idx.held_blocks("replica", "r0", "hbm") == 7
    # A duplicate / overlapping batch is ignored.
    idx.apply_replica_report(rep("r0", 4, removed=KEYS[:1]))
    idx.apply_replica_report(rep("r0", 5, stored=KEYS[:1]))
    assert idx.query(KEYS).hbm == {"r0": 8}


def test_publisher_gap_flag_and_mid_epoch_join() -> None:
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_replica_report(rep("r5", 41, stored=KEYS[:2]))  # first seen at seq 41
    assert idx.is_stale("replica", "r5")
    assert "mid-epoch" in idx.take_resync_requests("replica")[0].reason
    idx.apply_shard_batch(sbatch("s1", 0, [], gap=True), node_id="n1")
    (req,) = idx.take_resync_requests("shard")
    assert (req.source_kind, req.source_id) == ("shard", "s1")
    snap = ShardSnapshot(EVENTS_WIRE_VERSION, "s1", "e1", 9, list(KEYS[:3]), [Tier.DRAM, Tier.DRAM, Tier.SSD])
    idx.apply_shard_snapshot(snap, node_id="n1")
    assert {h.tier: h.prefix_blocks for h in idx.query(KEYS).pool} == {"dram": 2}
    assert not idx.is_stale("shard", "s1") and idx.cursor("shard", "s1") == ("e1", 9)


def test_new_epoch_resets_the_source() -> None:
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_shard_batch(sbatch("s0", 0, [(EventKind.STORED, k, Tier.DRAM) for k in KEYS[:6]]), node_id="n")
    # restarted, full history
    idx.apply_shard_batch(sbatch("s0", 0, [(EventKind.STORED, k, Tier.DRAM) for k in KEYS[:2]], epoch="e2"), "n")
    assert {h.tier: h.prefix_blocks for h in idx.query(KEYS).pool} == {"dram": 2}
    assert not idx.is_stale("shard", "s0") and idx.cursor("shard", "s0") == ("e2", 2)


def test_sources_not_heard_from_within_ttl_are_dropped() -> None:
    clock = RouterClock()
    idx = PrefixIndex(ttl_s=10, clock=clock)
    idx.apply_replica_report(rep("r0", 1, stored=KEYS[:4]))
    idx.apply_replica_report(rep("r1", 1, stored=KEYS[:4]))
    clock.advance(6)
    idx.apply_replica_report(rep("r1", 2))  # heartbeat
    clock.advance(6)
    assert idx.expire() == [("replica", "r0")]
    assert idx.query(KEYS).hbm == {"r1": 4} and len(idx) == 4
    clock.advance(11)
    idx.apply_shard_batch(sbatch("s0", 0, []), node_id="n")  # any event triggers the periodic sweep
    assert idx.query(KEYS).hbm == {} and len(idx) == 0


def test_bits_are_reused_after_a_holder_goes() -> None:
    idx = PrefixIndex(clock=RouterClock())
    for i in range(50):
        idx.apply_replica_report(rep(f"r{i}", 1, stored=KEYS[:i + 1]))
        if i >= 2:
            idx.remove_source("replica", f"r{i - 2}")
    assert len(idx._by_bit) <= 3  # the masks stay small as replicas churn
    assert idx.query(KEYS).hbm == {"r48": 49, "r49": 50}


def test_snapshot_fills_prefixes_and_shard_queues() -> None:
    idx = PrefixIndex(clock=RouterClock())
    request = router_request(64 * 16)
    keys = list(request.block_keys)
    idx.apply_replica_report(rep("r1", 1, stored=keys[:20]))
    idx.apply_shard_batch(sbatch("s0", 0, [(EventKind.STORED, k, Tier.DRAM) for k in keys]), node_id="node-2")
    reps = [router_replica("r0"), router_replica("r1"), router_replica("r2", hbm_prefix_blocks=5)]  # r2: stale value
    snap = idx.snapshot(request, reps, {"s0": 0.02})
    assert [r.hbm_prefix_blocks for r in snap.replicas] == [0, 20, 0]
    assert snap.replicas[0] is reps[0]  # untouched replicas are not copied
    assert snap.pool_hits == (PoolHit("s0", "node-2", "dram", 64, 0.02),)


def test_snapshot_passes_the_columns_on_with_the_hbm_prefixes_it_set() -> None:
    """With the caller's columns (``ReplicaBook.view``), the snapshot's columns are its replicas' (HBM prefixes set,
    a stale value cleared) and share the unchanged columns; the caller's are left as they were."""
    idx = PrefixIndex(clock=RouterClock())
    request = router_request(64 * 16)
    keys = list(request.block_keys)
    idx.apply_replica_report(rep("r1", 1, stored=keys[:20]))
    reps = [router_replica("r0"), router_replica("r1"), router_replica("r2", hbm_prefix_blocks=5)]
    cols = ReplicaColumns.of(reps)
    snap = idx.snapshot(request, reps, columns=cols)
    assert snap.columns == ReplicaColumns.of(snap.replicas)
    assert snap.columns.hbm == [0, 20, 0] and cols.hbm == [0, 0, 5]
    assert snap.columns.queues is cols.queues and snap.columns.ids is cols.ids
    plain = [router_replica("r3"), router_replica("r4")]  # nothing held: the caller's columns as they are
    assert idx.snapshot(request, plain, columns=ReplicaColumns.of(plain)).columns == ReplicaColumns.of(plain)
    assert idx.snapshot(request, reps).columns is None
    with pytest.raises(ValueError, match="columns of 2 replicas"):
        idx.snapshot(request, reps, columns=ReplicaColumns.of(plain))


def test_one_report_removes_then_stores_and_versions_are_checked() -> None:
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_replica_report(rep("r0", 1, stored=KEYS[:4]))
    idx.apply_replica_report(rep("r0", 2, removed=KEYS[2:4], stored=KEYS[3:6]))  # one seq, both changes
    assert idx.held_blocks("replica", "r0", "hbm") == 5 and idx.query(KEYS).hbm == {"r0": 2}
    assert idx.cursor("replica", "r0") == ("r0", 2) and not idx.is_stale("replica", "r0")
    with pytest.raises(ValueError, match="version 99"):
        idx.apply_replica_report(rep("r0", 3, version=99))
    with pytest.raises(ValueError, match="version 99"):
        idx.apply_shard_batch(EventBatch(99, "s0", "e", 0, 0, []), node_id="n")


@settings(max_examples=60, deadline=None)
@given(
    holdings=st.lists(st.sets(st.integers(0, 30), max_size=31), min_size=1, max_size=6),
    length=st.integers(0, 31),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30)), max_size=40),
)
def test_query_matches_brute_force(holdings: list[set[int]], length: int, ops: list[tuple[int, int]]) -> None:
    keys = router_keys(31)
    idx = PrefixIndex(clock=RouterClock())
    seqs = [0] * len(holdings)
    held = [set(h) for h in holdings]
    for r, h in enumerate(holdings):
        idx.apply_replica_report(rep(f"r{r}", 1, stored=[keys[i] for i in sorted(h)]))
        seqs[r] = 1
    rng = random.Random(len(ops))
    for r, i in ops:  # random removals / re-adds
        if r >= len(holdings):
            continue
        remove = i in held[r] and rng.random() < 0.7
        (held[r].discard if remove else held[r].add)(i)
        change = {"removed" if remove else "stored": [keys[i]]}
        idx.apply_replica_report(rep(f"r{r}", seqs[r] + 1, **change))
        seqs[r] += 1
    expected = {}
    for r, h in enumerate(held):
        n = 0
        while n < length and n in h:
            n += 1
        if n:
            expected[f"r{r}"] = n
    assert idx.query(keys[:length]).hbm == expected


def _tree_keys(branch_at: int, length: int) -> tuple[list[bytes], list[bytes]]:
    """Two chains that share their first ``branch_at`` keys (a conversation and a fork of it)."""
    import hashlib

    def chain(tokens: list[int]) -> list[bytes]:
        out, prev = [], b"root"
        for i, t in enumerate(tokens):
            prev = hashlib.blake2b(prev + i.to_bytes(4, "little") + t.to_bytes(4, "little"), digest_size=16).digest()
            out.append(prev)
        return out

    a = chain([0] * length)
    b = chain([0] * branch_at + [1] * (length - branch_at))
    assert a[:branch_at] == b[:branch_at] and (branch_at == length or a[branch_at] != b[branch_at])
    return a, b


@settings(max_examples=150, deadline=None)
@given(
    branch_at=st.integers(0, 24),
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "remove", "query"]), st.integers(0, 3), st.integers(0, 1),
                  st.sampled_from([0, 0, 0, 1, 3, 6, 11, 17, 23]), st.integers(1, 24)),
        max_size=60,
    ),
)
def test_learned_chains_stay_exact_under_interleaved_queries(
    branch_at: int, ops: list[tuple[str, int, int, int, int]]
) -> None:
    """Queries (which learn chains) interleaved with stores / removals of runs of blocks on two branching chains
    answer exactly what a brute-force scan of the holdings says, every time."""
    chains = _tree_keys(branch_at, 24)
    idx = PrefixIndex(clock=RouterClock())
    held: list[set[bytes]] = [set() for _ in range(4)]
    seqs = [0] * 4
    for op, r, c, start, run in ops:
        keys = chains[c]
        if op == "query":
            n = min(24, start + run)
            expected = {}
            for rr, h in enumerate(held):
                m = 0
                while m < n and keys[m] in h:
                    m += 1
                if m:
                    expected[f"r{rr}"] = m
            assert idx.query(keys[:n]).hbm == expected
            continue
        chunk = keys[start : start + run]
        (held[r].update if op == "store" else held[r].difference_update)(chunk)
        change = {"stored" if op == "store" else "removed": chunk}
        idx.apply_replica_report(rep(f"r{r}", seqs[r] + 1, **change))
        seqs[r] += 1
    assert idx.learned_blocks() <= len(set().union(*held))


def test_learned_branches_follow_removals_and_additions_in_their_shared_part() -> None:
    a, b = _tree_keys(8, 24)
    idx = PrefixIndex(clock=RouterClock())
    idx.apply_replica_report(rep("r0", 1, stored=a + b[8:]))
    idx.apply_replica_report(rep("r1", 1, stored=a[:20] + b[8:20]))
    assert idx.query(a).hbm == {"r0": 24, "r1": 20}
    assert idx.query(b).hbm == {"r0": 24, "r1": 20}  # learns a branch off a's chain at block 8
    assert idx.learned_blocks() == 24 + 16
    idx.apply_replica_report(rep("r0", 2, removed=[a[3]]))  # in the shared part: both branches lose r0
    assert idx.query(b).hbm == {"r0": 3, "r1": 20}
    assert idx.query(a).hbm == {"r0": 3, "r1": 20}
    idx.apply_replica_report(rep("r0", 3, stored=[a[3]]))  # the hole is filled: r0 rejoins both
    assert idx.query(b).hbm == {"r0": 24, "r1": 20}
    assert idx.query(a).hbm == {"r0": 24, "r1": 20}
    idx.apply_replica_report(rep("r1", 2, removed=[a[0]]))  # r1 leaves every prefix
    assert idx.query(b).hbm == {"r0": 24}
    idx.apply_replica_report(rep("r0", 4, removed=[a[0]]))  # nobody holds block 0: all learned is forgotten
    assert idx.learned_blocks() == 0
    assert idx.query(b).hbm == {} and idx.query(a).hbm == {}
