"""Pool events: what a shard tells the world about its blocks, sequence-numbered so a reader can detect gaps.

Who calls what: the block store (``kvpool.store``) appends an event to its ``EventLog`` for every visible change
(a block stored, removed, or moved between tiers); the shard actor (``kvpool.shard.actor``) serves
``events_since`` / ``snapshot`` from it; each router pulls them (``router.shard_sync``) into its cluster view
(``router.index``), which resyncs from a snapshot when a batch reports a gap or the shard's epoch changed (a
restarted shard). kvpool never imports router: the names are for the reader.

Sequence numbers start at 1 per epoch and have no holes; ``seq`` of a snapshot is the last event it includes.
The log is a bounded ring: a reader that fell further behind than the ring holds gets ``gap=True`` and resyncs.
All structs cross processes: versioned msgspec structs, encoded with msgpack.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

import msgspec

EVENTS_WIRE_VERSION = 1


class Tier(enum.Enum):
    """Where a block lives inside a shard. Data on an entry, not a class hierarchy."""

    DRAM = "dram"
    SSD = "ssd"


class EventKind(enum.Enum):
    STORED = "stored"  # a block became visible (tier = where)
    REMOVED = "removed"  # a block is gone (evicted, corrupted, dropped); tier = where it was
    TIER_CHANGED = "tier_changed"  # a block moved (demotion DRAM→SSD, promotion SSD→DRAM); tier = new tier


class BlockEvent(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    kind: EventKind
    key: bytes
    tier: Tier


class EventBatch(msgspec.Struct, frozen=True, tag="event_batch"):
    """Events ``(after_seq, last_seq]`` of one shard epoch. ``gap`` = the reader must resync from a snapshot."""

    version: int
    shard_id: str
    epoch: str
    after_seq: int
    last_seq: int
    events: list[BlockEvent]
    gap: bool = False


class ShardSnapshot(msgspec.Struct, frozen=True, tag="shard_snapshot"):
    """Every visible block of a shard at ``seq`` (parallel lists)."""

    version: int
    shard_id: str
    epoch: str
    seq: int
    keys: list[bytes]
    tiers: list[Tier]


class EventLog:
    """Bounded, gap-detecting event log of one shard epoch (not thread-safe; the store's lock covers it)."""

    def __init__(self, shard_id: str, epoch: str, capacity: int = 65536,
                 on_append: Callable[[], None] | None = None) -> None:
        """``on_append``: called after every append, under the same lock (the store wakes its long polls with it)."""
        if capacity <= 0:
            raise ValueError(f"event log capacity must be positive, got {capacity}")
        self.shard_id = shard_id
        self.epoch = epoch
        self._ring: deque[BlockEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._on_append = on_append

    @property
    def seq(self) -> int:
        return self._seq

    def append(self, kind: EventKind, key: bytes, tier: Tier) -> None:
        self._seq += 1
        self._ring.append(BlockEvent(self._seq, kind, bytes(key), tier))
        if self._on_append is not None:
            self._on_append()

    def since(self, after_seq: int, max_events: int = 4096) -> EventBatch:
        """Events after ``after_seq`` (at most ``max_events``). ``gap=True`` when they are no longer held or
        ``after_seq`` is ahead of this epoch (the reader saw another epoch)."""
        oldest = self._ring[0].seq if self._ring else self._seq + 1
        if after_seq > self._seq or after_seq < oldest - 1:
            return EventBatch(EVENTS_WIRE_VERSION, self.shard_id, self.epoch, after_seq, self._seq, [], gap=True)
        start = after_seq - oldest + 1  # index in the ring of the first event to send
        take = max(0, min(max_events, len(self._ring) - start))
        events = [self._ring[start + i] for i in range(take)]
        last = events[-1].seq if events else after_seq
        return EventBatch(EVENTS_WIRE_VERSION, self.shard_id, self.epoch, after_seq, last, events)
