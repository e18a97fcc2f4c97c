"""The pool directory: block key → {shard: tier}, kept as a client-side copy fed by the shards' event streams.

Who calls what:
- Each shard (``kvpool.shard``) is the authority for its own blocks and serves ``events_since(after_seq)`` and
  ``snapshot()`` (``kvpool.events``): sequence-numbered, per shard epoch.
- The router (its cluster view) owns a ``Directory`` and a ``DirectorySync`` that polls every shard's
  ``EventSource`` and applies the deltas. ``Directory.prefix(keys)`` then answers, per shard, how many leading
  keys it holds and in which tier, without asking any shard (the answer is a hint: the lease is the truth).

Consistency: a batch is applied only if it continues exactly where this copy stopped (same epoch,
``after_seq`` == our seq). A gap (the shard's ring no longer holds our position), another epoch (the shard
restarted) or an unknown shard → resync: the shard's entries are replaced by a full snapshot, then deltas resume
from the snapshot's seq. A shard that fails ``forget_after_failures`` polls in a row is forgotten (its blocks are
treated as gone) and resynced from scratch when it answers again.

Sharding by key range later: block keys are uniform 128-bit digests, so the key space splits evenly by the leading
bits (range r of R = keys whose first two bytes, big-endian, fall in [r·65536/R, (r+1)·65536/R)). Each shard then
keeps one ``EventLog`` (own seq) per range and serves ``events_since(range, after_seq)`` / ``snapshot(range)``;
a directory replica owns some ranges and holds one cursor per (shard, range); a prefix query splits its keys by
range, asks each owning replica for per-key holdings, and walks the prefix in key order on the caller's side.
Nothing here assumes a single owner of all keys except ``prefix`` walking one process-local index; ``key_range``
below is the partition function to use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvpool.events import EVENTS_WIRE_VERSION, EventBatch, EventKind, ShardSnapshot, Tier

log = logging.getLogger(__name__)


def key_range(key: bytes, n_ranges: int) -> int:
    """The key-range partition of ``key`` among ``n_ranges`` (1..65536) equal ranges."""
    if not 1 <= n_ranges <= 65536:
        raise ValueError(f"n_ranges must be in [1, 65536], got {n_ranges}")
    return int.from_bytes(key[:2], "big") * n_ranges // 65536


class ShardHolding(msgspec.Struct, frozen=True):
    """Leading keys one shard holds (per the directory) and how many of those per tier."""

    shard_id: str
    prefix: int
    dram: int
    ssd: int


@dataclass
class _ShardView:
    epoch: str
    seq: int
    blocks: dict[bytes, Tier] = field(default_factory=dict)


class Directory:
    """Client copy of key → {shard: tier}. Not thread-safe; one owner (the router's event loop)."""

    def __init__(self) -> None:
        self._shards: dict[str, _ShardView] = {}
        self._by_key: dict[bytes, dict[str, Tier]] = {}

    # -------------------------------------------------------------- updates
    def apply(self, batch: EventBatch) -> bool:
        """Apply a delta batch; False (nothing applied) when the copy must resync from a snapshot."""
        if batch.version != EVENTS_WIRE_VERSION:
            raise ValueError(f"event batch version {batch.version}, expected {EVENTS_WIRE_VERSION}")
        view = self._shards.get(batch.shard_id)
        if batch.gap or view is None or view.epoch != batch.epoch or view.seq != batch.after_seq:
            return False
        expected = view.seq
        for ev in batch.events:
            expected += 1
            if ev.seq != expected:
                raise ValueError(f"shard {batch.shard_id}: event seq {ev.seq}, expected {expected} (corrupt batch)")
        for ev in batch.events:
            if ev.kind is EventKind.REMOVED:
                self._unset(batch.shard_id, view, ev.key)
            else:
                self._set(batch.shard_id, view, ev.key, ev.tier)
        view.seq = batch.last_seq
        return True

    def load_snapshot(self, snap: ShardSnapshot) -> None:
        """Replace everything known about ``snap.shard_id`` with the snapshot."""
        if snap.version != EVENTS_WIRE_VERSION:
            raise ValueError(f"snapshot version {snap.version}, expected {EVENTS_WIRE_VERSION}")
        if len(snap.keys) != len(snap.tiers):
            raise ValueError(f"snapshot of {snap.shard_id}: {len(snap.keys)} keys, {len(snap.tiers)} tiers")
        self.forget_shard(snap.shard_id)
        view = _ShardView(snap.epoch, snap.seq)
        self._shards[snap.shard_id] = view
        for key, tier in zip(snap.keys, snap.tiers, strict=True):
            self._set(snap.shard_id, view, key, tier)

    def forget_shard(self, shard_id: str) -> None:
        view = self._shards.pop(shard_id, None)
        if view is None:
            return
        for key in view.blocks:
            holders = self._by_key.get(key)
            if holders is not None:
                holders.pop(shard_id, None)
                if not holders:
                    del self._by_key[key]

    # -------------------------------------------------------------- queries
    def cursor(self, shard_id: str) -> tuple[str, int] | None:
        """(epoch, seq) this copy is at for a shard, or None if unknown."""
        view = self._shards.get(shard_id)
        return None if view is None else (view.epoch, view.seq)

    def shards(self) -> list[str]:
        return sorted(self._shards)

    def locate(self, key: bytes) -> dict[str, Tier]:
        return dict(self._by_key.get(bytes(key), {}))

    def prefix(self, keys: Sequence[bytes]) -> list[ShardHolding]:
        """Per known shard holding at least the first key: leading keys held and their tiers; longest first."""
        out: list[ShardHolding] = []
        first = self._by_key.get(bytes(keys[0])) if keys else None
        for shard_id in sorted(first or ()):
            blocks = self._shards[shard_id].blocks
            dram = ssd = 0
            for key in keys:
                tier = blocks.get(bytes(key))
                if tier is None:
                    break
                if tier is Tier.DRAM:
                    dram += 1
                else:
                    ssd += 1
            out.append(ShardHolding(shard_id, dram + ssd, dram, ssd))
        out.sort(key=lambda h: (-h.prefix, -h.dram, h.shard_id))
        return out

    def __len__(self) -> int:
        return len(self._by_key)

    # -------------------------------------------------------------- internals
    def _set(self, shard_id: str, view: _ShardView, key: bytes, tier: Tier) -> None:
        view.blocks[key] = tier
        self._by_key.setdefault(key, {})[shard_id] = tier

    def _unset(self, shard_id: str, view: _ShardView, key: bytes) -> None:
        view.blocks.pop(key, None)
        holders = self._by_key.get(key)
        if holders is not None:
            holders.pop(shard_id, None)
            if not holders:
                del self._by_key[key]


class EventSource(Protocol):
    """One shard's event stream, as seen by a directory client (``kvpool.shard.ShardClient`` implements it)."""

    shard_id: str

    async def events_since(self, after_seq: int, max_events: int, deadline_s: float) -> EventBatch: ...

    async def snapshot(self, deadline_s: float) -> ShardSnapshot: ...


class SyncReport(msgspec.Struct):
    """What one ``poll_once`` did, per shard id."""

    applied: dict[str, int] = msgspec.field(default_factory=dict)  # events applied
    resynced: list[str] = msgspec.field(default_factory=list)
    failed: dict[str, str] = msgspec.field(default_factory=dict)  # error text
    forgotten: list[str] = msgspec.field(default_factory=list)


class DirectorySync:
    """Pulls every source's deltas into a ``Directory``; every call has a deadline."""

    def __init__(
        self,
        directory: Directory,
        *,
        deadline_s: float = 2.0,
        max_events: int = 4096,
        forget_after_failures: int = 3,
    ) -> None:
        if deadline_s <= 0 or max_events <= 0 or forget_after_failures <= 0:
            raise ValueError("deadline_s, max_events and forget_after_failures must be positive")
        self.directory = directory
        self.deadline_s = deadline_s
        self.max_events = max_events
        self.forget_after_failures = forget_after_failures
        self._sources: dict[str, EventSource] = {}
        self._failures: dict[str, int] = {}

    def set_sources(self, sources: Iterable[EventSource]) -> None:
        """The current shard set; shards no longer listed are forgotten."""
        new = {s.shard_id: s for s in sources}
        for gone in set(self._sources) - set(new):
            self.directory.forget_shard(gone)
            self._failures.pop(gone, None)
        self._sources = new

    async def poll_once(self) -> SyncReport:
        report = SyncReport()
        results = await asyncio.gather(
            *(self._poll_shard(sid, src, report) for sid, src in self._sources.items()), return_exceptions=True
        )
        for sid, res in zip(list(self._sources), results, strict=True):
            if isinstance(res, BaseException):
                n = self._failures.get(sid, 0) + 1
                self._failures[sid] = n
                report.failed[sid] = f"{type(res).__name__}: {res}"
                if n >= self.forget_after_failures and self.directory.cursor(sid) is not None:
                    self.directory.forget_shard(sid)
                    report.forgotten.append(sid)
                    log.warning("directory: forgot shard %s after %d failed polls (%s)", sid, n, res)
            else:
                self._failures[sid] = 0
        return report

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Poll every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            await self.poll_once()
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                pass

    async def _poll_shard(self, sid: str, src: EventSource, report: SyncReport) -> None:
        cursor = self.directory.cursor(sid)
        applied = 0
        if cursor is None:
            await self._resync(sid, src, report)
        # Drain: keep asking while full batches come back (bounded so one busy shard cannot starve the loop).
        for _ in range(64):
            cursor = self.directory.cursor(sid)
            assert cursor is not None  # set by the resync above
            batch = await src.events_since(cursor[1], self.max_events, self.deadline_s)
            if batch.shard_id != sid:
                raise ValueError(f"source {sid} answered for shard {batch.shard_id}")
            if not self.directory.apply(batch):
                await self._resync(sid, src, report)
                continue
            applied += len(batch.events)
            if len(batch.events) < self.max_events:
                break
        report.applied[sid] = applied

    async def _resync(self, sid: str, src: EventSource, report: SyncReport) -> None:
        snap = await src.snapshot(self.deadline_s)
        if snap.shard_id != sid:
            raise ValueError(f"source {sid} sent a snapshot of shard {snap.shard_id}")
        self.directory.load_snapshot(snap)
        report.resynced.append(sid)
