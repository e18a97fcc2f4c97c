"""The connector's background saver: new KV blocks reach the local shard without the forward pass waiting.

Who calls what: ``WorkerSide.wait_for_save`` (vLLM's model runner, after every forward) calls
``BlockSaver.stage`` with the blocks this step completed. ``stage`` copies their bytes into the saver's own
staging slots — one memcpy per block, on the model runner's thread; nothing else happens there — because a KV
cache block may be freed and reused as soon as the step ends (a preempted request's blocks are, at once), so
nothing may read the cache later. It then queues one job and returns. The saver's thread takes the jobs in order:
one reservation on the shard, one transfer write from the staging slots (with its *own* endpoints, so it never shares
state with the loads the model runner's thread runs; a memory copy when the shard exports its arena through shared
memory, ``kvpool.transfer.shm``), one commit with the checksums of the staged bytes (the shard verifies them). The
reserve and commit calls are deadline-bounded shard calls; the write has ``save_deadline_s``.

The saver's thread runs at its own lower priority (``nice``; the connector passes ``ConnectorConfig.saver_nice``,
19 by default). It shares the worker's cores with the forward pass and with the path that sends a first token out,
and it ran ahead of them. At the saver's old priority, new 2,600-token first turns on the tiny model took
0.236–0.310 s at p50, against 0.203–0.236 s with the pool off. At nice 19 they took 0.226–0.231 s
(bench/reports/saver_priority). A save that waits for an idle core only delays when the pool holds the blocks.

That delay is bounded (``max_lag_s``, ``ConnectorConfig.saver_max_lag_s``). Beside threads that keep every core busy
(an engine that saturates them, other processes on the node) a nice-19 thread gets ~1.5% of a core, and saves fell
behind without end: with two busy processes beside the fault suite's engine, none of 8 requests found the prefix
that the requests before them had saved (``tests/faults/test_frozen_shard.py`` without its settle). A thread cannot
raise its priority again without privileges, so a second thread, started at the caller's priority and left there,
takes every job that has waited ``max_lag_s`` in the queue — the catch-up lane, with its own endpoints
(``catch_up_peers``). Either lane runs a job once; jobs are independent (their own keys, reservation and commit).

The staging slots are the bound on bytes in flight (``ConnectorConfig.save_staging_bytes``): when none is free,
the blocks are not saved (``SaveStats.blocks_dropped``) — a future miss, never a wait on the forward path. A failed
job is a future miss too (``save_failures``); its reservation is aborted or expires. A job that never reached its
shard (its breaker open, no actor of its name) is ``saves_skipped``: its keys come back from ``take_skipped()``,
not as failures (no retry attempt spent while a shard restarts). Every staged or dropped key
ends in ``take_outcomes()``: saved (committed, or already held by the shard) or failed (dropped, no room, a failed
job, rejected by the shard's checksum check) — the scheduler role plans the failed ones again, bounded
(``kvpool.connector.save_book``). ``wait_idle(deadline_s)`` (the in-process bench and tests, shutdown) waits until
every queued job is done.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from kvpool.checksum import slot_checksum
from kvpool.connector.pool import KnownPeers
from kvpool.transfer.base import BlockOp, TransferEndpoint

log = logging.getLogger(__name__)


@dataclass
class SaveStats:
    """Counters of the save path (written by the saver's thread; plain ints, read by anyone)."""

    saves: int = 0  # jobs run (one per step that saved something)
    save_failures: int = 0
    saves_skipped: int = 0  # jobs not attempted: the shard was unreachable (breaker open, no actor); not failures
    blocks_staged: int = 0
    blocks_dropped: int = 0  # no staging slot free: not saved
    blocks_no_room: int = 0  # the shard reserved fewer slots than asked (DRAM full of pinned blocks): not saved
    blocks_committed: int = 0
    blocks_rejected: int = 0
    blocks_duplicate: int = 0
    bytes_written: int = 0
    bytes_written_shm: int = 0  # of bytes_written: through shared memory (the own node's shard)
    stage_seconds: float = 0.0  # time on the model runner's thread (the copies)
    write_seconds: float = 0.0
    job_seconds: float = 0.0  # reserve + write + commit, on the saver's thread
    queue_max: int = 0  # most jobs waiting at once
    save_fences: int = 0  # writes that might still land after their deadline: the endpoint was closed and remade
    catch_up_saves: int = 0  # of saves: jobs run by the catch-up lane (they had waited max_lag_s)


def _merged(a: SaveStats, b: SaveStats) -> SaveStats:
    """Two lanes' counters as one: sums, and the larger ``queue_max``."""
    out = SaveStats(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(SaveStats)})
    out.queue_max = max(a.queue_max, b.queue_max)
    return out


@dataclass
class _Job:
    shard_id: str
    fingerprint: str
    keys: list[bytes]
    slots: list[int]  # staging slot per key
    payloads: list[int]  # bytes staged per key
    staged_at: float = 0.0  # time.monotonic() when queued
    reported: set[bytes] = field(default_factory=set)  # keys whose outcome is out (take_outcomes)


class _Lane:
    """One saver thread's own state: its endpoints, the staging buffer's (and the padding's) region ids in them,
    its counters."""

    def __init__(self, peers: KnownPeers | TransferEndpoint, staging: np.ndarray) -> None:
        self.peers = peers if isinstance(peers, KnownPeers) else KnownPeers(peers)
        self.staging_region = self.peers.register(memoryview(staging))
        self.zero: np.ndarray | None = None
        self.zero_region = -1
        self.stats = SaveStats()
        self.thread: threading.Thread | None = None

    def zeros(self, size: int) -> int:
        """Region id of a registered zero buffer of at least ``size`` bytes (slot padding)."""
        if self.zero is None or self.zero.size < size:
            self.zero = np.zeros(size, dtype=np.uint8)
            self.zero_region = self.peers.register(memoryview(self.zero))
        return self.zero_region


class _Unreachable(Exception):
    """A job that never reached its shard (``__cause__`` says why)."""


class BlockSaver:
    """A background thread writing staged blocks to a shard (and the catch-up lane's, see the module doc).
    ``clients(shard_id)`` gives the ``ShardClient`` (the saver's own ``PoolShards``); ``peers`` holds the saver's
    own endpoints (a bare ``TransferEndpoint`` is wrapped): the transfer endpoint and, when there is one, the
    shared-memory one its node's shard is written through (``kvpool.transfer.shm``)."""

    def __init__(self, peers: KnownPeers | TransferEndpoint, clients: Callable[[str], Any],
                 forget: Callable[[str], None], *, slot_bytes: int, staging_bytes: int, deadline_s: float,
                 name: str = "kvpool-saver", model: str = "", nice: int = 0,
                 catch_up_peers: KnownPeers | TransferEndpoint | None = None, max_lag_s: float = 0.0) -> None:
        """``nice``: the saver thread's own nice value (0..19, ``ConnectorConfig.saver_nice``), taken by the thread
        before its first job (Linux only). ``catch_up_peers`` and ``max_lag_s`` > 0: the catch-up lane's endpoints
        and the queue wait after which it takes a job (``ConnectorConfig.saver_max_lag_s``); without them, one
        lane."""
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.n_slots = max(1, staging_bytes // slot_bytes)
        self.deadline_s = deadline_s
        self.model = model  # labels the commits (the shard's per-model accounting)
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice}")
        self.nice = nice
        if max_lag_s < 0:
            raise ValueError(f"max_lag_s must be >= 0, got {max_lag_s}")
        self.max_lag_s = max_lag_s
        self._stage_stats = SaveStats()  # the model runner's thread's counters (stage)
        self._clients = clients
        self._forget = forget
        self._staging = np.zeros(self.n_slots * slot_bytes, dtype=np.uint8)
        self._lane = _Lane(peers, self._staging)
        self._catch_up = _Lane(catch_up_peers, self._staging) if catch_up_peers is not None and max_lag_s > 0 else None
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._saved: list[bytes] = []  # outcomes since the last take_outcomes (under _lock)
        self._failed: list[bytes] = []
        self._skipped: list[bytes] = []  # never attempted: the shard was unreachable (_Unreachable)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # a job finished (wait_idle)
        self._queued = threading.Condition(self._lock)  # a job was queued (the saver's lane)
        self._started = threading.Condition(self._lock)  # a job was queued into an empty queue (the catch-up lane)
        self._pending = 0  # jobs queued or running
        self._jobs: deque[_Job] = deque()  # queued, oldest first (under _lock)
        self._stopping = False
        self._lane.thread = threading.Thread(target=self._run, args=(self._lane,), name=name, daemon=True)
        self._lane.thread.start()
        if self._catch_up is not None:
            self._catch_up.thread = threading.Thread(target=self._run_catch_up, args=(self._catch_up,),
                                                     name=f"{name}-catch-up", daemon=True)
            self._catch_up.thread.start()

    @property
    def stats(self) -> SaveStats:
        """The counters of ``stage`` and of both lanes, as one (a copy)."""
        out = _merged(self._stage_stats, self._lane.stats)
        return out if self._catch_up is None else _merged(out, self._catch_up.stats)

    # ------------------------------------------------------------------ model runner's thread
    def stage(self, shard_id: str, fingerprint: str, blocks: list[tuple[bytes, list[np.ndarray]]]) -> int:
        """Copy each block (its key and the byte pieces that make it up, in order) into a free staging slot and
        queue them; blocks beyond the free slots are dropped. Returns how many were staged. Never waits."""
        t0 = time.perf_counter()
        payloads = [sum(piece.nbytes for piece in pieces) for _, pieces in blocks]
        if any(p > self.slot_bytes for p in payloads):
            raise ValueError(f"a block of {max(payloads)} bytes does not fit a staging slot of {self.slot_bytes}")
        stats = self._stage_stats
        with self._lock:
            take = min(len(blocks), len(self._free))
            slots = [self._free.pop() for _ in range(take)]
            self._failed.extend(key for key, _ in blocks[take:])
        stats.blocks_dropped += len(blocks) - take
        if not take:
            return 0
        keys = []
        for (key, pieces), slot in zip(blocks, slots, strict=False):
            off = slot * self.slot_bytes
            for piece in pieces:
                self._staging[off : off + piece.nbytes] = piece
                off += piece.nbytes
            keys.append(key)
        payloads = payloads[:take]
        with self._lock:
            self._pending += 1
            self._jobs.append(_Job(shard_id, fingerprint, keys, slots, payloads, time.monotonic()))
            queued = len(self._jobs)
            self._queued.notify()
            if queued == 1:  # the catch-up lane times the queue's oldest job: only a new oldest one wakes it
                self._started.notify()
        stats.blocks_staged += take
        stats.stage_seconds += time.perf_counter() - t0
        stats.queue_max = max(stats.queue_max, queued)
        return take

    def take_skipped(self) -> list[bytes]:
        """Keys whose job never reached the shard (its breaker was open, no actor of its name) since the last call:
        no attempt was spent on them."""
        with self._lock:
            skipped, self._skipped = self._skipped, []
        return skipped

    def take_outcomes(self) -> tuple[list[bytes], list[bytes]]:
        """(saved keys, failed keys) since the last call."""
        with self._lock:
            saved, failed, self._saved, self._failed = self._saved, self._failed, [], []
        return saved, failed

    def _report(self, job: _Job, saved: list[bytes], failed: list[bytes]) -> None:
        with self._lock:
            self._saved.extend(saved)
            self._failed.extend(failed)
        job.reported.update(saved)
        job.reported.update(failed)

    def wait_idle(self, deadline_s: float) -> bool:
        """Wait until every queued job is done; False if some are still running at the deadline."""
        end = time.monotonic() + deadline_s
        with self._idle:
            while self._pending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, deadline_s: float = 5.0) -> None:
        """Finish the queued jobs (within ``deadline_s``), stop the threads, close the endpoints."""
        self.wait_idle(deadline_s)
        with self._lock:
            self._stopping = True
            self._queued.notify_all()
            self._started.notify_all()
        for lane in (self._lane, self._catch_up):
            if lane is not None and lane.thread is not None:
                lane.thread.join(timeout=deadline_s)
                lane.peers.close()

    # ------------------------------------------------------------------ saver's thread
    def _lower_priority(self) -> None:
        """(The saver's thread, first thing) Take this thread's nice value. Linux schedules threads one by one, so
        this lowers the saver alone, not the forward pass beside it."""
        if self.nice <= 0 or sys.platform != "linux":
            return
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(self.nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except OSError as exc:  # a sandbox without setpriority: the saver keeps the engine's priority
            log.warning("kvpool connector: could not set the saver thread's nice value to %d: %s", self.nice, exc)

    def _run(self, lane: _Lane) -> None:
        """The saver's thread: every job, oldest first, at ``nice``."""
        self._lower_priority()
        while True:
            with self._lock:
                while not self._jobs and not self._stopping:
                    self._queued.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self._run_job(lane, job)

    def _run_catch_up(self, lane: _Lane) -> None:
        """The catch-up lane's thread (the caller's priority): the jobs that waited ``max_lag_s`` in the queue."""
        while True:
            with self._lock:
                while True:
                    if self._stopping:
                        return
                    if not self._jobs:
                        self._started.wait()
                        continue
                    waited = time.monotonic() - self._jobs[0].staged_at
                    if waited >= self.max_lag_s:
                        job = self._jobs.popleft()
                        break
                    self._started.wait(self.max_lag_s - waited)  # the oldest job's age, read again after
            lane.stats.catch_up_saves += 1
            self._run_job(lane, job)

    def _run_job(self, lane: _Lane, job: _Job) -> None:
        stats = lane.stats
        t0 = time.perf_counter()
        try:
            self._write(lane, job)
        except _Unreachable as exc:  # nothing was attempted: the keys are not failures of theirs
            with self._lock:
                self._skipped.extend(k for k in job.keys if k not in job.reported)
            stats.saves_skipped += 1
            log.info("kvpool connector: save of %d block(s) to %s not attempted: %s", len(job.keys),
                     job.shard_id, exc.__cause__)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an error
            self._report(job, [], [k for k in job.keys if k not in job.reported])
            stats.save_failures += 1
            log.warning("kvpool connector: save of %d block(s) to %s failed: %s", len(job.keys), job.shard_id, exc)
        finally:
            stats.saves += 1
            stats.job_seconds += time.perf_counter() - t0
            with self._idle:
                self._free.extend(job.slots)
                self._pending -= 1
                self._idle.notify_all()

    def _write(self, lane: _Lane, job: _Job) -> None:
        stats = lane.stats
        try:
            client = self._clients(job.shard_id)
        except Exception as exc:  # its breaker is open (it failed recently), or no actor of its name
            raise _Unreachable() from exc
        reservation_id: int | None = None
        try:
            reply = client.reserve(len(job.keys))
            res = reply.reservation
            reservation_id = res.reservation_id
            n = min(len(job.keys), len(res.offsets))
            stats.blocks_no_room += len(job.keys) - n
            self._report(job, [], job.keys[n:])
            if not n:
                return
            # The saver writes to its own node's shard: through shared memory when that shard exports its arena.
            lane.peers.ensure(reply.agent_name, reply.epoch, client.transfer_metadata, lambda: client.shm_metadata())
            ops: list[BlockOp] = []
            checksums: list[int] = []
            for slot, payload, remote_off in zip(job.slots[:n], job.payloads[:n], res.offsets[:n], strict=True):
                if payload > res.slot_bytes:
                    raise ValueError(f"block of {payload} bytes does not fit {res.slot_bytes}-byte shard slots")
                local = slot * self.slot_bytes
                ops.append(BlockOp(reply.region_id, remote_off, lane.staging_region, local, payload))
                if res.slot_bytes > payload:
                    pad = res.slot_bytes - payload
                    ops.append(BlockOp(reply.region_id, remote_off + payload, lane.zeros(pad), 0, pad))
                checksums.append(slot_checksum([self._staging[local : local + payload]], res.slot_bytes))
            t0 = time.perf_counter()
            endpoint = lane.peers.endpoint_for(reply.agent_name)
            result = endpoint.write(reply.agent_name, ops, self.deadline_s, grants=[res.grant])
            stats.write_seconds += time.perf_counter() - t0
            stats.bytes_written += result.bytes_moved
            if endpoint.backend == "shm":
                stats.bytes_written_shm += result.bytes_moved
            if not result.settled:  # the late write may still land in the reserved slots: end it before they are
                lane.peers.fence()  # committed (checked) or given back
                stats.save_fences += 1
            commit = client.commit(reservation_id, job.keys[:n], checksums, job.fingerprint, model=self.model,
                                   epoch=reply.epoch)
            reservation_id = None
            self._report(job, [job.keys[i] for i in commit.committed + commit.duplicate],
                         [job.keys[i] for i in commit.rejected])
            stats.blocks_committed += len(commit.committed)
            stats.blocks_rejected += len(commit.rejected)
            stats.blocks_duplicate += len(commit.duplicate)
        except Exception:
            lane.peers.forget()
            self._forget(job.shard_id)
            raise
        finally:
            if reservation_id is not None:
                try:
                    client.abort(reservation_id)
                except Exception:  # noqa: BLE001 - the reservation expires on its own
                    pass
