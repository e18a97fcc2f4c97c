"""The connector's background saver (``kvpool.connector.saver.BlockSaver``): the model runner's thread only copies;
the saver's thread reserves, writes and commits; a frozen or dead shard costs the forward path nothing.

The shard is the saver's neighbour: ``tests.fakes.shard.StoreShardClient``, a real ``BlockStore`` (which verifies
every checksum at commit) behind the loopback transport.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from kvpool.connector.saver import BlockSaver
from kvpool.store import BlockStore, StoreConfig
from tests.fakes.shard import StoreShardClient
from tests.fakes.transfer import LoopbackEndpoint, LoopbackFabric

SLOT = 4096  # the shard's slots
BLOCK = 3000  # a block's payload: two pieces (say K and V), padded with zeros up to the slot
FP = "layout-fp"


def key(i: int) -> bytes:
    return hashlib.blake2b(f"block-{i}".encode(), digest_size=16).digest()


def block(i: int) -> list[np.ndarray]:
    rng = np.random.default_rng(i)
    data = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    return [data[:1000], data[1000:]]


@pytest.fixture
def rig():
    fabric = LoopbackFabric()
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=64), shard_id="local")
    shard = StoreShardClient(store, fabric)
    forgotten: list[str] = []
    saver = BlockSaver(LoopbackEndpoint(fabric, "engine-saver"), lambda sid: shard, forgotten.append,
                       slot_bytes=BLOCK, staging_bytes=4 * BLOCK, deadline_s=5.0, model="tiny")
    yield saver, shard, store, forgotten
    shard.release()
    saver.close()


def saved_bytes(store: BlockStore, i: int) -> bytes | None:
    return store.read_block(key(i), FP)


def test_staged_blocks_are_committed_with_their_bytes_and_padding(rig) -> None:
    saver, _, store, _ = rig
    assert saver.stage("local", FP, [(key(i), block(i)) for i in range(3)]) == 3
    assert saver.wait_idle(10)
    for i in range(3):
        expected = np.concatenate(block(i)).tobytes() + bytes(SLOT - BLOCK)
        assert saved_bytes(store, i) == expected
    assert saver.stats.blocks_committed == 3 and saver.stats.save_failures == 0
    assert saver.stats.blocks_rejected == 0  # the store recomputed every checksum
    (layout,) = store.stats().layouts.values()  # counted under the saver's model
    assert (layout.model, layout.dram_blocks) == ("tiny", 3)


def test_the_cache_may_change_right_after_stage(rig) -> None:
    """Blocks are copied at ``stage``: a KV cache block reused the moment the step ends (a preempted request's)
    never changes what is saved under its key."""
    saver, shard, store, _ = rig
    shard.hold.set()  # the write happens after the cache changed
    pieces = block(7)
    original = np.concatenate(pieces).tobytes()
    saver.stage("local", FP, [(key(7), pieces)])
    for p in pieces:
        p[:] = 0
    shard.release()
    assert saver.wait_idle(10)
    assert saved_bytes(store, 7) == original + bytes(SLOT - BLOCK)


def test_a_frozen_shard_never_blocks_stage_and_a_full_staging_drops(rig) -> None:
    saver, shard, store, _ = rig
    shard.hold.set()  # reserve waits: the saver's thread is stuck, the caller's is not
    assert saver.stage("local", FP, [(key(0), block(0)), (key(1), block(1))]) == 2
    assert saver.stage("local", FP, [(key(i), block(i)) for i in range(2, 6)]) == 2  # 4 staging slots in all
    assert saver.stats.blocks_dropped == 2
    assert not saver.wait_idle(0.2)  # still in flight
    shard.release()
    assert saver.wait_idle(10)
    assert [saved_bytes(store, i) is not None for i in range(6)] == [True] * 4 + [False] * 2
    assert saver.stage("local", FP, [(key(9), block(9))]) == 1  # the slots came back
    assert saver.wait_idle(10) and saved_bytes(store, 9) is not None
    saved, failed = saver.take_outcomes()  # every key's fate, for the scheduler's save book
    assert sorted(saved) == sorted([key(i) for i in (0, 1, 2, 3, 9)]) and sorted(failed) == sorted([key(4), key(5)])
    assert saver.take_outcomes() == ([], [])


def test_a_dead_shard_is_a_counted_failure_and_the_slots_come_back(rig) -> None:
    saver, shard, store, forgotten = rig
    shard.fail = True
    assert saver.stage("local", FP, [(key(i), block(i)) for i in range(4)]) == 4
    assert saver.wait_idle(10)
    assert saver.stats.save_failures == 1 and saver.stats.blocks_committed == 0
    assert forgotten == ["local"]  # the client is looked up again next time
    assert saver.take_outcomes() == ([], [key(i) for i in range(4)])  # failed once each, not twice
    shard.fail = False
    assert saver.stage("local", FP, [(key(i), block(i)) for i in range(4)]) == 4
    assert saver.wait_idle(10) and saver.stats.blocks_committed == 4
    assert saver.take_outcomes() == ([key(i) for i in range(4)], [])
    assert saver.stage("local", FP, [(key(0), block(0))]) == 1  # already held: a duplicate counts as saved
    assert saver.wait_idle(10) and saver.stats.blocks_duplicate == 1 and saver.take_outcomes() == ([key(0)], [])


def test_a_shard_with_fewer_free_slots_saves_the_leading_blocks() -> None:
    fabric = LoopbackFabric()
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=2), shard_id="small")
    shard = StoreShardClient(store, fabric)
    saver = BlockSaver(LoopbackEndpoint(fabric, "engine-saver"), lambda sid: shard, lambda sid: None,
                       slot_bytes=BLOCK, staging_bytes=8 * BLOCK, deadline_s=5.0)
    try:
        saver.stage("small", FP, [(key(i), block(i)) for i in range(3)])
        assert saver.wait_idle(10)
        assert [saved_bytes(store, i) is not None for i in range(3)] == [True, True, False]
        assert saver.take_outcomes() == ([key(0), key(1)], [key(2)])  # no room: failed, planned again later
    finally:
        saver.close()


def test_a_block_larger_than_a_staging_slot_is_refused(rig) -> None:
    saver, *_ = rig
    with pytest.raises(ValueError, match="does not fit a staging slot"):
        saver.stage("local", FP, [(key(0), [np.zeros(BLOCK + 1, dtype=np.uint8)])])


def test_slot_checksum_equals_the_checksum_of_the_padded_slot() -> None:
    from kvpool.checksum import block_checksum, slot_checksum

    pieces = block(3)
    padded = np.concatenate([*pieces, np.zeros(SLOT - BLOCK, dtype=np.uint8)])
    assert slot_checksum(pieces, SLOT) == block_checksum(padded.data)
    assert slot_checksum(pieces, BLOCK) == block_checksum(np.concatenate(pieces).data)  # no padding
    assert slot_checksum(pieces, SLOT) != slot_checksum(pieces[::-1], SLOT)  # the order counts


def test_a_write_that_may_still_land_fences_the_endpoint_before_the_slots_are_checked(rig) -> None:
    """A write the transport could not confirm cancelled (``settled=False``): the saver closes and remakes its
    endpoint before it commits (the store checks every slot's bytes) or gives the slots back; the blocks count as
    failed unless their bytes all arrived; the next save goes through the new endpoint."""
    _, shard, store, _ = rig
    fabric = shard.endpoint.fabric
    made: list[LoopbackEndpoint] = []

    def remake() -> LoopbackEndpoint:
        made.append(LoopbackEndpoint(fabric, f"saver-{len(made)}"))
        return made[-1]

    from kvpool.connector.pool import KnownPeers

    saver = BlockSaver(KnownPeers(remake(), remake=remake), lambda sid: shard, lambda sid: None, slot_bytes=BLOCK,
                       staging_bytes=4 * BLOCK, deadline_s=5.0, model="tiny")
    try:
        fabric.unsettled.add(shard.agent_name)
        assert saver.stage("local", FP, [(key(i), block(i)) for i in range(2)]) == 2
        assert saver.wait_idle(10)
        assert saver.stats.save_fences == 1 and "saver-0" not in fabric.buffers and len(made) == 2
        fabric.unsettled.clear()
        assert saver.stage("local", FP, [(key(5), block(5))]) == 1
        assert saver.wait_idle(10) and saved_bytes(store, 5) is not None
        saved, _failed = saver.take_outcomes()
        assert key(5) in saved
    finally:
        saver.close()


def test_a_shard_it_cannot_reach_spends_no_attempt(rig) -> None:
    """Its breaker open (it failed recently, e.g. while it restarts) or no actor of its name: the job never reaches
    the shard; its keys are skipped, not failed (the scheduler's save book spends no retry on them)."""
    from kvpool.shard.wire import ShardUnavailableError

    saver, shard, store, _ = rig

    def unreachable(shard_id: str) -> None:
        raise ShardUnavailableError(f"shard {shard_id}: skipped (it failed recently; retried after a backoff)")

    saver._clients = unreachable
    assert saver.stage("local", FP, [(key(i), block(i)) for i in range(2)]) == 2
    assert saver.wait_idle(10)
    assert saver.stats.saves_skipped == 1 and saver.stats.save_failures == 0
    assert saver.take_outcomes() == ([], []) and saver.take_skipped() == [key(0), key(1)]
    saver._clients = lambda sid: shard
    assert saver.stage("local", FP, [(key(0), block(0))]) == 1
    assert saver.wait_idle(10) and saver.take_outcomes() == ([key(0)], []) and saver.take_skipped() == []


def thread_nice(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_saver_thread_runs_at_its_own_nice_value_and_the_caller_keeps_its_own() -> None:
    """``nice`` lowers the saver's thread alone: the thread that calls ``stage`` (vLLM's model runner) keeps its
    priority, and a save still completes."""
    fabric = LoopbackFabric()
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=64), shard_id="local")
    shard = StoreShardClient(store, fabric)
    caller_before = thread_nice(threading.current_thread())
    saver = BlockSaver(LoopbackEndpoint(fabric, "engine-saver"), lambda sid: shard, lambda sid: None,
                       slot_bytes=BLOCK, staging_bytes=4 * BLOCK, deadline_s=5.0, nice=19)
    try:
        assert saver.stage("local", FP, [(key(1), block(1))]) == 1
        assert saver.wait_idle(10)  # the job ran on the saver's thread, after it took its nice value
        assert saver.stats.blocks_committed == 1
        assert thread_nice(saver._lane.thread) == 19
        assert thread_nice(threading.current_thread()) == caller_before
    finally:
        shard.release()
        saver.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_default_saver_keeps_the_priority_it_was_started_with(rig) -> None:
    saver, _, _, _ = rig
    assert saver.stage("local", FP, [(key(1), block(1))]) == 1 and saver.wait_idle(10)
    assert saver.nice == 0 and thread_nice(saver._lane.thread) == thread_nice(threading.current_thread())


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_nice_value_outside_0_to_19_is_refused(nice: int) -> None:
    with pytest.raises(ValueError, match="nice"):
        BlockSaver(LoopbackEndpoint(LoopbackFabric(), "x"), lambda sid: None, lambda sid: None, slot_bytes=BLOCK,
                   staging_bytes=4 * BLOCK, deadline_s=5.0, nice=nice)


class FirstReserveStuck:
    """The shard, with the first ``reserve`` stuck until ``go`` (the lowered lane, starved mid-job)."""

    def __init__(self, shard: StoreShardClient) -> None:
        self.shard = shard
        self.go = threading.Event()
        self.reserves = 0
        self._lock = threading.Lock()

    def reserve(self, n: int):
        with self._lock:
            self.reserves += 1
            first = self.reserves == 1
        if first:
            self.go.wait(30)
        return self.shard.reserve(n)

    def __getattr__(self, name: str):
        return getattr(self.shard, name)


@contextmanager
def lagged_saver(*, max_lag_s: float, catch_up: bool = True, nice: int = 0, stuck: bool = False):
    """A saver with (or without) its catch-up lane over a real store: yields (saver, store, shard); ``stuck``: the
    shard's first ``reserve`` waits for ``shard.go``."""
    fabric = LoopbackFabric()
    store = BlockStore(StoreConfig(slot_bytes=SLOT, dram_slots=64), shard_id="local")
    shard = StoreShardClient(store, fabric)
    client = FirstReserveStuck(shard) if stuck else shard
    saver = BlockSaver(LoopbackEndpoint(fabric, "engine-saver"), lambda sid: client, lambda sid: None,
                       slot_bytes=BLOCK, staging_bytes=4 * BLOCK, deadline_s=5.0, nice=nice, max_lag_s=max_lag_s,
                       catch_up_peers=LoopbackEndpoint(fabric, "engine-saver-catch-up") if catch_up else None)
    try:
        yield saver, store, client
    finally:
        if stuck:
            client.go.set()
        saver.close()


def test_a_save_left_waiting_max_lag_goes_by_the_catch_up_lane() -> None:
    """The lowered lane is stuck in a job; the next job, once it has waited ``max_lag_s``, is written and committed
    by the catch-up lane (its own endpoint) while the first is still stuck; then the first completes too."""
    with lagged_saver(max_lag_s=0.2, stuck=True) as (saver, store, stuck):
        assert saver.stage("local", FP, [(key(0), block(0))]) == 1
        deadline = time.monotonic() + 10
        while stuck.reserves < 1 and time.monotonic() < deadline:  # the lowered lane took the first job
            time.sleep(0.01)
        staged = time.monotonic()
        assert saver.stage("local", FP, [(key(1), block(1))]) == 1
        while saved_bytes(store, 1) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert saved_bytes(store, 1) == np.concatenate(block(1)).tobytes() + bytes(SLOT - BLOCK)
        assert time.monotonic() - staged >= 0.2  # not before it had waited max_lag_s
        assert saved_bytes(store, 0) is None and not saver.wait_idle(0.05)  # the first job: still stuck
        assert saver.take_outcomes() == ([key(1)], [])
        stuck.go.set()
        assert saver.wait_idle(10) and saved_bytes(store, 0) is not None
        stats = saver.stats
        assert (stats.catch_up_saves, stats.saves, stats.blocks_committed, stats.blocks_staged) == (1, 2, 2, 2)
        assert saver.take_outcomes() == ([key(0)], [])


def test_without_a_catch_up_lane_a_stuck_save_holds_the_queue() -> None:
    with lagged_saver(max_lag_s=0.1, catch_up=False, stuck=True) as (saver, store, stuck):
        assert saver.stage("local", FP, [(key(0), block(0))]) == 1
        assert saver.stage("local", FP, [(key(1), block(1))]) == 1
        assert not saver.wait_idle(0.5) and saved_bytes(store, 1) is None
        stuck.go.set()
        assert saver.wait_idle(10) and saved_bytes(store, 1) is not None and saver.stats.catch_up_saves == 0


def test_saves_the_lowered_lane_keeps_up_with_are_its_own() -> None:
    with lagged_saver(max_lag_s=5.0) as (saver, _, _):
        for i in range(6):
            assert saver.stage("local", FP, [(key(i), block(i))]) == 1
            assert saver.wait_idle(10)
        stats = saver.stats
        assert (stats.saves, stats.blocks_committed, stats.catch_up_saves) == (6, 6, 0)


def test_a_negative_max_lag_is_refused() -> None:
    with pytest.raises(ValueError, match="max_lag_s"):
        BlockSaver(LoopbackEndpoint(LoopbackFabric(), "x"), lambda sid: None, lambda sid: None, slot_bytes=BLOCK,
                   staging_bytes=4 * BLOCK, deadline_s=5.0, max_lag_s=-1.0)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_catch_up_lane_keeps_the_callers_priority() -> None:
    caller = thread_nice(threading.current_thread())
    with lagged_saver(max_lag_s=1.0, nice=19) as (saver, _, _):
        assert saver.stage("local", FP, [(key(1), block(1))]) == 1 and saver.wait_idle(10)
        assert saver._catch_up is not None and saver._catch_up.thread is not None
        assert thread_nice(saver._lane.thread) == 19 and thread_nice(saver._catch_up.thread) == caller
