"""The pull mechanism (``kvpool.shard.pull.Puller``) between two real ``BlockStore``s of this process.

Bytes move through ``tests.fakes.transfer.LoopbackEndpoint`` (the transfer interface over local memory) and the
source is ``tests.fakes.shard.StoreSource`` (the pull-source interface over a real store), so the pull's own logic is
what is under test: skipping held keys, pulling only the leased prefix, checksum rejection, partial reservations, the
reservation abort and the lease release on every path, deadlines, caching and re-resolution of sources. The real
thing (shard actors on a Ray cluster, NIXL) is ``tests/integration/test_pool_pull.py``. Also: ``BlockStore.commit``
with ``slot_index`` and ``BlockStore.held``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.checksum import block_checksum
from kvpool.keys import Namespace, block_keys
from kvpool.shard.pull import Puller
from kvpool.shard.wire import PullRequest, ShardUnavailableError, check_pull
from kvpool.store import BlockStore, StoreConfig
from tests.fakes.shard import StoreSource
from tests.fakes.transfer import LoopbackEndpoint, LoopbackFabric

SLOT = 4096
FP = "cd" * 16


def payload(seed: int, size: int = SLOT) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def keys_for(n: int, salt: str = "") -> list[bytes]:
    return block_keys(Namespace("pull-unit", FP, salt), list(range(n * 4)), 4)


def fill(store: BlockStore, keys: list[bytes], seeds: list[int]) -> None:
    """reserve → local copy → commit (the writer path, in-process)."""
    res = store.reserve(len(keys))
    assert len(res.slots) == len(keys)
    for slot, s in zip(res.slots, seeds, strict=True):
        store.arena.view(slot)[:] = payload(s, store.config.slot_bytes)
    out = store.commit(res.reservation_id, keys, [block_checksum(payload(s, store.config.slot_bytes)) for s in seeds],
                       FP)
    assert out.committed == list(range(len(keys)))


class Pair:
    """A source store behind a ``StoreSource`` and a target store with a ``Puller``."""

    def __init__(self, *, src_slots: int = 16, dst_slots: int = 16, src_slot_bytes: int = SLOT,
                 verify_on_lease: bool = True, with_endpoint: bool = True) -> None:
        self.fabric = LoopbackFabric()
        self.src = BlockStore(StoreConfig(slot_bytes=src_slot_bytes, dram_slots=src_slots,
                                          verify_dram_on_lease=verify_on_lease), shard_id="src")
        self.source = StoreSource(self.src, self.fabric)
        self.dst = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=dst_slots), shard_id="dst")
        self.endpoint: LoopbackEndpoint | None = None
        region = -1
        if with_endpoint:
            self.endpoint = LoopbackEndpoint(self.fabric, "kvpool-dst")
            region = self.endpoint.register(self.dst.arena.buffer)
        self.resolved: list[str] = []
        self.resolve: Callable[[str], StoreSource] = self._resolve
        self.puller = Puller(self.dst, self.endpoint, region, lambda sid: self.resolve(sid))

    def _resolve(self, shard_id: str) -> StoreSource:
        self.resolved.append(shard_id)
        if shard_id != self.source.shard_id:
            raise ShardUnavailableError(f"unknown source shard {shard_id!r} (fake registry)")
        return self.source

    def pull(self, keys: list[bytes], deadline_s: float = 2.0, source: str = "src", lease_ttl_s: float = 10.0
             ) -> object:
        return self.puller.pull(PullRequest(source, keys, FP, deadline_s, lease_ttl_s))

    def dst_bytes(self, key: bytes) -> bytes | None:
        return self.dst.read_block(key, FP)

    def assert_clean(self) -> None:
        """No lease left on the source, no reservation left on the target."""
        assert self.src.stats().leases == 0
        st = self.dst.stats()
        assert st.reservations == 0 and st.reserved_slots == 0


def test_pull_copies_blocks_and_releases_the_lease() -> None:
    p = Pair()
    keys = keys_for(5, "all")
    fill(p.src, keys, [1, 2, 3, 4, 5])
    rep = p.pull(keys)
    assert (rep.requested, rep.present, rep.pulled, rep.failed, rep.missing) == (5, 0, 5, 0, 0)
    assert rep.error == "" and rep.bytes_moved == 5 * SLOT and rep.shard_id == "dst" and rep.epoch == p.dst.epoch
    assert 0 <= rep.read_seconds <= rep.seconds
    assert p.dst.lookup(keys, FP).prefix == 5
    assert [p.dst_bytes(k) for k in keys] == [payload(s) for s in (1, 2, 3, 4, 5)]
    assert p.source.released and p.source.metadata_calls == 1
    p.assert_clean()
    c = p.puller.counters()
    assert (c["pulls"], c["pulled_blocks"], c["pull_bytes"], c["pull_errors"]) == (1, 5, 5 * SLOT, 0)


def test_held_keys_are_skipped_not_only_a_prefix() -> None:
    p = Pair()
    keys = keys_for(5, "skip")
    fill(p.src, keys, [10, 11, 12, 13, 14])
    fill(p.dst, [keys[1], keys[3]], [11, 13])
    rep = p.pull(keys)
    assert (rep.present, rep.pulled, rep.failed) == (2, 3, 0)
    assert p.source.leased == [[keys[0], keys[2], keys[4]]]  # only what was missing here was leased
    assert p.dst.lookup(keys, FP).prefix == 5
    again = p.pull(keys)
    assert (again.present, again.pulled, again.bytes_moved) == (5, 0, 0)
    assert len(p.source.leased) == 1  # nothing to pull: the source was not asked
    p.assert_clean()


def test_only_the_leased_prefix_is_pulled() -> None:
    p = Pair()
    keys = keys_for(6, "prefix")
    fill(p.src, keys[:2] + keys[3:], [20, 21, 23, 24, 25])  # keys[2] missing: the source's prefix is 2
    rep = p.pull(keys)
    assert (rep.pulled, rep.missing, rep.failed, rep.error) == (2, 4, 0, "")
    assert p.dst.held(keys, FP) == [True, True, False, False, False, False]
    p.assert_clean()


def test_corrupted_source_block_is_never_committed() -> None:
    p = Pair(verify_on_lease=False)  # the source hands out the stored checksum without rechecking its bytes
    keys = keys_for(4, "corrupt")
    fill(p.src, keys, [30, 31, 32, 33])
    info = p.src.entry_info(keys[1])
    assert info is not None
    p.src.arena.buffer[info.offset + 7] ^= 0xFF
    rep = p.pull(keys)
    assert (rep.pulled, rep.failed, rep.missing) == (3, 1, 0)
    assert "checksum" in rep.error
    assert p.dst.held(keys, FP) == [True, False, True, True]  # the blocks around the bad one are committed
    assert p.dst_bytes(keys[1]) is None
    assert p.dst_bytes(keys[2]) == payload(32)
    assert p.dst.stats().counters["commit_rejected"] == 1
    p.assert_clean()


def test_transfer_failure_aborts_the_reservation_and_releases() -> None:
    p = Pair()
    keys = keys_for(3, "xfer")
    fill(p.src, keys, [40, 41, 42])
    p.fabric.dead.add(p.source.agent_name)
    rep = p.pull(keys)
    assert (rep.pulled, rep.failed) == (0, 3) and "failed" in rep.error
    assert p.dst.stats().dram.free == 16
    p.assert_clean()
    p.fabric.dead.clear()
    ok = p.pull(keys)  # the peer is trusted again after a refetch of its metadata
    assert ok.pulled == 3 and p.source.metadata_calls == 2
    p.assert_clean()


def test_partial_transfer_commits_the_blocks_that_arrived_in_their_slots() -> None:
    p = Pair()
    keys = keys_for(4, "partial")
    fill(p.src, keys, [45, 46, 47, 48])
    p.fabric.fail_ops = {1}
    rep = p.pull(keys)
    assert (rep.pulled, rep.failed, rep.bytes_moved) == (3, 1, 3 * SLOT) and "injected" in rep.error
    assert p.dst.held(keys, FP) == [True, False, True, True]
    assert [p.dst_bytes(k) for k in (keys[0], keys[2], keys[3])] == [payload(s) for s in (45, 47, 48)]
    assert p.dst.stats().counters["commit_rejected"] == 0  # nothing was committed from a wrong slot
    p.assert_clean()


@pytest.mark.parametrize("mode", ["dead", "refuse"])
def test_failing_source_is_an_error_reply(mode: str) -> None:
    p = Pair()
    keys = keys_for(3, mode)
    fill(p.src, keys, [50, 51, 52])
    p.source.mode = mode
    rep = p.pull(keys)
    assert (rep.requested, rep.pulled, rep.failed, rep.missing) == (3, 0, 3, 0)
    assert rep.error
    assert p.dst.stats().dram.blocks == 0
    p.assert_clean()


def test_frozen_source_answers_within_the_deadline() -> None:
    p = Pair()
    keys = keys_for(2, "frozen")
    fill(p.src, keys, [60, 61])
    assert p.pull(keys[:1]).pulled == 1  # the source is cached
    p.source.mode = "frozen"
    t0 = time.monotonic()
    rep = p.pull(keys, deadline_s=0.3)
    took = time.monotonic() - t0
    assert (rep.present, rep.failed) == (1, 1) and "no answer within" in rep.error
    assert took < 1.0, took
    assert p.resolved == ["src"]  # a slow source is not resolved again (only a dead one is)
    p.assert_clean()


def test_unknown_source() -> None:
    p = Pair()
    rep = p.pull(keys_for(2, "unknown"), source="nosuch")
    assert rep.failed == 2 and "unknown source shard" in rep.error
    p.assert_clean()


def test_cached_dead_source_is_resolved_again_once() -> None:
    p = Pair()
    keys = keys_for(2, "reresolve")
    fill(p.src, keys, [70, 71])
    assert p.pull(keys[:1]).pulled == 1
    assert p.resolved == ["src"]
    dead = p.source
    fresh = StoreSource(p.src, p.fabric, epoch="e2")  # the same shard, restarted: a new handle
    dead.mode = "dead"
    p.source = fresh
    rep = p.pull(keys)
    assert (rep.present, rep.pulled, rep.error) == (1, 1, "")
    assert p.resolved == ["src", "src"]
    p.assert_clean()


def test_new_source_epoch_refetches_the_transfer_metadata() -> None:
    p = Pair()
    keys = keys_for(2, "epoch")
    fill(p.src, keys, [80, 81])
    assert p.pull(keys[:1]).pulled == 1
    assert p.source.metadata_calls == 1
    p.src.epoch = "restarted"  # what a lease reply of a restarted source carries
    assert p.pull(keys).pulled == 1
    assert p.source.metadata_calls == 2


def test_slot_size_mismatch_is_refused() -> None:
    p = Pair(src_slot_bytes=2 * SLOT)
    keys = keys_for(2, "slots")
    fill(p.src, keys, [90, 91])
    rep = p.pull(keys)
    assert rep.pulled == 0 and rep.failed == 2 and "slot size mismatch" in rep.error
    assert p.dst.stats().dram.free == 16
    p.assert_clean()


def test_target_dram_full_of_pinned_blocks_pulls_what_fits() -> None:
    p = Pair(dst_slots=4)
    pinned = keys_for(3, "pinned")
    fill(p.dst, pinned, [1, 2, 3])
    lease = p.dst.lease(pinned, FP, 60.0)
    keys = keys_for(3, "full")
    fill(p.src, keys, [100, 101, 102])
    rep = p.pull(keys)
    assert (rep.pulled, rep.failed) == (1, 2) and "full" in rep.error
    assert p.dst.held(keys, FP) == [True, False, False]
    p.dst.release(lease.lease_id)
    p.assert_clean()


def test_target_without_endpoint() -> None:
    p = Pair(with_endpoint=False)
    keys = keys_for(1, "noep")
    fill(p.src, keys, [5])
    rep = p.pull(keys)
    assert rep.failed == 1 and "no transfer endpoint" in rep.error
    assert not p.source.leased


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (PullRequest("dst", keys_for(1), FP, 1.0), "same shard"),
        (PullRequest("", keys_for(1), FP, 1.0), "empty source"),
        (PullRequest("src", keys_for(1), "", 1.0), "fingerprint"),
        (PullRequest("src", keys_for(1), FP, 0.0), "deadline_s"),
        (PullRequest("src", keys_for(1), FP, float("nan")), "deadline_s"),
        (PullRequest("src", keys_for(1), FP, 5.0, lease_ttl_s=1.0), "lease_ttl_s"),
        (PullRequest("src", [b"short"], FP, 1.0), "bytes"),
    ],
)
def test_invalid_requests_raise(req: PullRequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_pull("dst", req)
    p = Pair()
    with pytest.raises(ValueError, match=match):
        p.puller.pull(req)


# ---------------------------------------------------------------------------------------------- store additions
def test_commit_with_slot_index_uses_the_named_slots() -> None:
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=4), shard_id="s")
    keys = keys_for(2, "slots")
    res = store.reserve(3)
    for slot, seed in zip(res.slots, (1, 2, 3), strict=True):
        store.arena.view(slot)[:] = payload(seed)
    out = store.commit(res.reservation_id, keys, [block_checksum(payload(1)), block_checksum(payload(3))], FP,
                       slot_index=[0, 2])
    assert out.committed == [0, 1]
    assert store.read_block(keys[0], FP) == payload(1) and store.read_block(keys[1], FP) == payload(3)
    st = store.stats()
    assert st.dram.free == 2 and st.reserved_slots == 0  # slot 1 went back


@pytest.mark.parametrize("slot_index", [[0, 0], [0, 3], [0]])
def test_commit_with_a_bad_slot_index_raises(slot_index: list[int]) -> None:
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=4), shard_id="s")
    res = store.reserve(3)
    with pytest.raises(ValueError):
        store.commit(res.reservation_id, keys_for(2), [0, 0], FP, slot_index=slot_index)
    assert store.abort(res.reservation_id)  # the reservation survived the refused commit


def test_held_is_per_key_and_per_fingerprint() -> None:
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=4), shard_id="s")
    keys = keys_for(3, "held")
    fill(store, [keys[0], keys[2]], [1, 3])
    assert store.held(keys, FP) == [True, False, True]
    assert store.held(keys, "other") == [False, False, False]
