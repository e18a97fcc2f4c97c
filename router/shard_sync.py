"""ShardSync: pulls every pool shard's event stream into the router's ``router.index.PrefixIndex``.

Who calls what: ``router.live_view.LiveView`` owns one ``ShardSync`` over its index and runs ``run(list_shards)`` as
a background task; ``list_shards`` (an async callable) returns the current shards as ``(event source, node id)``
pairs, the event source being kvpool's typed client ``kvpool.shard.client.ShardEventSource`` (``events_since`` /
``snapshot``, deadline-bounded). Tests drive ``set_shards`` + ``poll_once`` with in-process sources.

Cursors live in the index (``PrefixIndex.cursor``: epoch and last applied seq per shard; None when unknown or stale);
this module decides what to ask each shard: the events after the cursor, drained while full batches come back
(bounded, so one busy shard cannot starve the loop), or a snapshot when the index has no usable cursor (a shard
first seen, a gap in its ring, a restarted shard with a new epoch). Every call has a deadline (``deadline_s``).

Concurrency: each shard syncs on its own (``poll_once`` gathers them; ``run`` keeps one loop per shard), so a slow
or dead shard costs only its own deadline, never the others' freshness. ``run``'s loops long-poll (``wait_s`` > 0:
the first events call of a sync waits at the shard up to ``wait_s`` for an event) and start a sync at most once per
``interval_s``: an idle shard costs one call per ``wait_s`` instead of one per interval, and a burst of events after
a quiet spell reaches the index when the shard logs it, not at the next poll. A shard that fails
``forget_after_failures`` syncs in a row is forgotten (its blocks are treated as gone) and resynced from a snapshot
when it answers again; a shard no longer listed is forgotten at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.events import EventBatch, ShardSnapshot
from router.index import PrefixIndex

log = logging.getLogger("kvstack.router")


class ShardEvents(Protocol):
    """One shard's event stream (``kvpool.shard.client.ShardEventSource`` implements it)."""

    shard_id: str

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float,
                           wait_s: float = 0.0) -> EventBatch: ...

    async def snapshot(self, deadline_s: float) -> ShardSnapshot: ...


@dataclass
class SyncReport:
    """What one ``poll_once`` did, per shard id."""

    applied: dict[str, int] = field(default_factory=dict)  # events applied
    resynced: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # error text
    forgotten: list[str] = field(default_factory=list)


class ShardSync:
    """Owns the shard set and what to ask each shard; the index owns the cursors. One event loop."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        deadline_s: float = 5.0,
        max_events: int = 4096,
        max_batches: int = 64,
        forget_after_failures: int = 3,
        wait_s: float = 0.0,
    ) -> None:
        """``wait_s``: how long ``run``'s first events call of a sync may wait at the shard for an event (0: plain
        polls)."""
        if deadline_s <= 0 or max_events <= 0 or max_batches <= 0 or forget_after_failures <= 0:
            raise ValueError("deadline_s, max_events, max_batches and forget_after_failures must be positive")
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.wait_s = wait_s
        self.index = index
        self.deadline_s = deadline_s
        self.max_events = max_events
        self.max_batches = max_batches
        self.forget_after_failures = forget_after_failures
        self._shards: dict[str, tuple[ShardEvents, str]] = {}  # shard id -> (source, node id)
        self._failures: dict[str, int] = {}

    def set_shards(self, shards: Iterable[tuple[ShardEvents, str]]) -> None:
        """The current shards as (event source, node id); shards no longer listed are forgotten."""
        new = {src.shard_id: (src, node_id) for src, node_id in shards}
        for gone in set(self._shards) - set(new):
            self.index.remove_source("shard", gone)
            self._failures.pop(gone, None)
        self._shards = new

    def shard_ids(self) -> list[str]:
        return list(self._shards)

    def node_of(self, shard_id: str) -> str | None:
        """The node a listed shard runs on (None: not listed)."""
        entry = self._shards.get(shard_id)
        return None if entry is None else entry[1]

    async def poll_once(self) -> SyncReport:
        """Sync every listed shard once, concurrently."""
        report = SyncReport()
        shards = list(self._shards)
        await asyncio.gather(*(self._sync_and_count(sid, report) for sid in shards))
        return report

    async def run(
        self, list_shards: Callable[[], Awaitable[list[tuple[ShardEvents, str]]]], *, interval_s: float,
        relist_s: float = 5.0,
    ) -> None:
        """Until cancelled: relist the shards every ``relist_s`` and keep one sync loop per listed shard (each
        syncs, long-polling with ``wait_s``, and starts its next sync ``interval_s`` after the last one started, or at
        once when that one took longer), so a shard stuck up to its deadline delays nobody else."""
        loops: dict[str, asyncio.Task[None]] = {}
        clock = asyncio.get_running_loop().time

        async def loop(sid: str) -> None:
            while sid in self._shards:
                started = clock()
                await self._sync_and_count(sid, SyncReport(), self.wait_s)
                await asyncio.sleep(max(0.0, interval_s - (clock() - started)))

        try:
            while True:
                try:
                    shards = await asyncio.wait_for(list_shards(), timeout=self.deadline_s)
                    self.set_shards(shards)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - keep the shards we know, list again later
                    log.warning("listing pool shards failed: %s", exc)
                for sid in [s for s, t in loops.items() if t.done() or s not in self._shards]:
                    loops.pop(sid).cancel()
                for sid in self._shards:
                    if sid not in loops:
                        loops[sid] = asyncio.create_task(loop(sid))
                await asyncio.sleep(relist_s)
        finally:
            for t in loops.values():
                t.cancel()

    # ---- one shard ---------------------------------------------------------------------------------------

    async def _sync_and_count(self, sid: str, report: SyncReport, wait_s: float = 0.0) -> None:
        try:
            await self._sync(sid, report, wait_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing shard is counted, the others go on
            n = self._failures.get(sid, 0) + 1
            self._failures[sid] = n
            report.failed[sid] = f"{type(exc).__name__}: {exc}"
            if n == 1:
                log.warning("pool shard %s sync failed: %s", sid, report.failed[sid])
            if n >= self.forget_after_failures and ("shard", sid) in self.index.sources():
                self.index.remove_source("shard", sid)
                report.forgotten.append(sid)
                log.warning("pool shard %s forgotten after %d failed syncs (%s)", sid, n, exc)
        else:
            self._failures[sid] = 0

    async def _sync(self, sid: str, report: SyncReport, wait_s: float = 0.0) -> None:
        """Drain the shard's events into the index; the first call may wait ``wait_s`` at the shard for one."""
        entry = self._shards.get(sid)
        if entry is None:  # no longer listed (set_shards ran meanwhile): nothing to sync
            return
        src, node_id = entry
        applied = 0
        for _ in range(self.max_batches):
            cursor = self.index.cursor("shard", sid)
            if cursor is None:
                await self._resync(sid, src, node_id, report)
                cursor = self.index.cursor("shard", sid)
                if cursor is None:  # events overflowed the index's buffer meanwhile: snapshot again next time
                    break
            batch = await src.events_since(cursor[1], self.max_events, self.deadline_s, wait_s=wait_s)
            wait_s = 0.0  # the rest of the drain does not wait
            if batch.shard_id != sid:
                raise ValueError(f"source {sid} answered for shard {batch.shard_id}")
            self.index.apply_shard_batch(batch, node_id)
            if self.index.cursor("shard", sid) is None:
                continue  # a gap or another epoch: the index wants a snapshot
            applied += len(batch.events)
            if len(batch.events) < self.max_events:
                break
        report.applied[sid] = applied

    async def _resync(self, sid: str, src: ShardEvents, node_id: str, report: SyncReport) -> None:
        snap = await src.snapshot(self.deadline_s)
        if snap.shard_id != sid:
            raise ValueError(f"source {sid} sent a snapshot of shard {snap.shard_id}")
        self.index.apply_shard_snapshot(snap, node_id)
        report.resynced.append(sid)
