"""The cluster prefix view: which replica holds which prefix in HBM, which pool shard holds it in DRAM / SSD.

Who calls what: each router owns one ``PrefixIndex``. The event plumbing (``deployments/``, lead) feeds it
``apply_replica_batch`` / ``apply_replica_snapshot`` (``router.events``, from the replicas' KV events) and
``apply_shard_batch`` / ``apply_shard_snapshot`` (``kvpool.events``, from the pool shards or the directory),
sends the ``ResyncRequest``s from ``take_resync_requests()`` and calls ``expire()`` now and then. The ingress
calls ``snapshot(request, replicas)`` per request to get the ``ClusterSnapshot`` a policy ranks.

Data: key → bitmask of holders; a holder is a (source, tier): a replica's HBM, or a shard's DRAM or SSD. A query
walks the request's keys in order and ANDs the masks; a holder's prefix ends where its bit drops out, and the walk
stops when no holder remains, so a query costs O(matched length) dictionary lookups (done in C in chunks).

Ordering per source: sequence numbers without holes per epoch. A batch that starts after the last applied seq (or
says ``gap``), or a source first seen mid-epoch, marks the source stale and queues a resync request; its events are
still applied (a slightly wrong view beats none) and buffered, and when the snapshot arrives the holder's keys are
replaced by it and the buffered events newer than it are replayed. A source not heard from (no batch, snapshot or
heartbeat — an empty batch) within ``ttl_s`` is dropped with all its blocks. Clock injected; no I/O.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import reduce
from itertools import compress, repeat
from operator import and_, attrgetter
from typing import Literal

from kvpool.events import EventBatch as ShardEventBatch
from kvpool.events import EventKind, ShardSnapshot
from kvpool.events import Tier as ShardTier
from router.events import (
    REPLICA_EVENTS_VERSION,
    ReplicaEventBatch,
    ReplicaEventKind,
    ReplicaSnapshot,
    ResyncRequest,
)
from router.policies.base import ClusterSnapshot, PoolHit, ReplicaState, RouteRequest

SourceKind = Literal["replica", "shard"]
HolderTier = Literal["hbm", "dram", "ssd"]
SUPPORTED_SHARD_EVENTS_VERSION = 1
_MAX_STALE_BUFFER = 1 << 16  # buffered ops while waiting for a snapshot; beyond this, resync again
_get_hb = attrgetter("hbm_prefix_blocks")
_get_id = attrgetter("replica_id")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest prefixes of one request: per replica in HBM, per (shard, tier) in the pool (in blocks, > 0)."""

    hbm: dict[str, int]
    pool: tuple[PoolHit, ...]


_EMPTY_MATCH = PrefixMatch({}, ())


class _Holder:
    __slots__ = ("bit", "keys", "kind", "node_id", "source_id", "tier")

    def __init__(self, bit: int, kind: SourceKind, source_id: str, node_id: str, tier: HolderTier) -> None:
        self.bit = bit
        self.kind = kind
        self.source_id = source_id
        self.node_id = node_id
        self.tier = tier
        self.keys: set[bytes] = set()


# An op: (seq, kind, tier, keys). kind: "stored" | "removed" | "moved" (to tier) | "cleared".
_Op = tuple[int, str, HolderTier, Sequence[bytes]]


class _Source:
    __slots__ = ("buffer", "epoch", "holders", "kind", "last_seen", "node_id", "seq", "source_id", "stale")

    def __init__(self, kind: SourceKind, source_id: str, node_id: str, epoch: str, now: float) -> None:
        self.kind = kind
        self.source_id = source_id
        self.node_id = node_id
        self.epoch = epoch
        self.seq = 0
        self.stale = False
        self.last_seen = now
        self.holders: dict[HolderTier, _Holder] = {}
        self.buffer: list[_Op] | None = None  # ops applied while stale (None = overflowed)


class PrefixIndex:
    """One router's copy of the cluster's prefix holdings. Not thread-safe (one event loop)."""

    def __init__(self, *, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._mask: dict[bytes, int] = {}
        self._by_bit: list[_Holder | None] = []
        self._free_bits: list[int] = []
        self._sources: dict[tuple[SourceKind, str], _Source] = {}
        self._resync: dict[tuple[SourceKind, str], str] = {}
        self._last_sweep = clock()

    # ---- introspection ---------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct block keys held anywhere."""
        return len(self._mask)

    def sources(self) -> list[tuple[SourceKind, str]]:
        return list(self._sources)

    def is_stale(self, kind: SourceKind, source_id: str) -> bool:
        src = self._sources.get((kind, source_id))
        return src is not None and src.stale

    def held_blocks(self, kind: SourceKind, source_id: str, tier: HolderTier) -> int:
        src = self._sources.get((kind, source_id))
        holder = src.holders.get(tier) if src else None
        return len(holder.keys) if holder else 0

    # ---- replica events ----------------------------------------------------------------------------------------

    def apply_replica_batch(self, batch: ReplicaEventBatch) -> None:
        if batch.version != REPLICA_EVENTS_VERSION:
            raise ValueError(f"replica event version {batch.version} not supported (expected {REPLICA_EVENTS_VERSION})")
        ops: list[_Op] = []
        for ev in batch.events:
            if ev.kind is ReplicaEventKind.STORED:
                ops.append((ev.seq, "stored", "hbm", ev.keys))
            elif ev.kind is ReplicaEventKind.REMOVED:
                ops.append((ev.seq, "removed", "hbm", ev.keys))
            else:
                ops.append((ev.seq, "cleared", "hbm", ()))
        self._apply_batch("replica", batch.replica_id, batch.node_id, batch.epoch, batch.after_seq, batch.last_seq,
                          batch.gap, ops)

    def apply_replica_snapshot(self, snap: ReplicaSnapshot) -> None:
        if snap.version != REPLICA_EVENTS_VERSION:
            raise ValueError(f"replica snapshot version {snap.version} not supported")
        self._apply_snapshot("replica", snap.replica_id, snap.node_id, snap.epoch, snap.seq, {"hbm": snap.keys})

    # ---- pool shard events (kvpool.events) -----------------------------------------------------------------------

    def apply_shard_batch(self, batch: ShardEventBatch, node_id: str) -> None:
        """Apply a shard's events; ``node_id`` is the node the shard runs on (from the directory's registry)."""
        if batch.version != SUPPORTED_SHARD_EVENTS_VERSION:
            raise ValueError(f"shard event version {batch.version} not supported")
        ops: list[_Op] = []
        for ev in batch.events:
            tier: HolderTier = "dram" if ev.tier is ShardTier.DRAM else "ssd"
            kind = {EventKind.STORED: "stored", EventKind.REMOVED: "removed", EventKind.TIER_CHANGED: "moved"}[ev.kind]
            ops.append((ev.seq, kind, tier, (ev.key,)))
        self._apply_batch("shard", batch.shard_id, node_id, batch.epoch, batch.after_seq, batch.last_seq, batch.gap,
                          ops)

    def apply_shard_snapshot(self, snap: ShardSnapshot, node_id: str) -> None:
        if snap.version != SUPPORTED_SHARD_EVENTS_VERSION:
            raise ValueError(f"shard snapshot version {snap.version} not supported")
        if len(snap.keys) != len(snap.tiers):
            raise ValueError(f"shard snapshot {snap.shard_id}: {len(snap.keys)} keys but {len(snap.tiers)} tiers")
        by_tier: dict[HolderTier, list[bytes]] = {"dram": [], "ssd": []}
        for key, tier in zip(snap.keys, snap.tiers, strict=True):
            by_tier["dram" if tier is ShardTier.DRAM else "ssd"].append(key)
        self._apply_snapshot("shard", snap.shard_id, node_id, snap.epoch, snap.seq, by_tier)

    # ---- resync and liveness ---------------------------------------------------------------------------------------

    def take_resync_requests(self) -> list[ResyncRequest]:
        """Snapshots the index needs (each asked once until it arrives or the source is seen stale again)."""
        out = [ResyncRequest(REPLICA_EVENTS_VERSION, kind, sid, reason) for (kind, sid), reason in self._resync.items()]
        self._resync.clear()
        return out

    def expire(self) -> list[tuple[SourceKind, str]]:
        """Drop every source not heard from within ``ttl_s``; returns the dropped ones."""
        now = self._clock()
        self._last_sweep = now
        dead = [k for k, s in self._sources.items() if now - s.last_seen > self.ttl_s]
        for k in dead:
            self.remove_source(*k)
        return dead

    def remove_source(self, kind: SourceKind, source_id: str) -> None:
        """Forget a replica or shard and all its blocks (it is gone)."""
        src = self._sources.pop((kind, source_id), None)
        self._resync.pop((kind, source_id), None)
        if src is None:
            return
        for holder in src.holders.values():
            self._drop_holder(holder)

    # ---- queries ---------------------------------------------------------------------------------------------

    def query(self, keys: Sequence[bytes]) -> PrefixMatch:
        """Longest prefix of ``keys`` per holder. O(matched length): stops when no holder matches any more."""
        n = len(keys)
        if n == 0 or not self._mask:
            return _EMPTY_MATCH
        get = self._mask.get
        alive = get(keys[0], 0)
        if not alive:
            return _EMPTY_MATCH
        ends: list[tuple[int, int]] = []  # (bits that dropped out, prefix length in blocks)
        i, step = 1, 16
        while i < n:
            j = i + step if i + step < n else n
            masks = list(map(get, keys[i:j], repeat(0, j - i)))
            if reduce(and_, masks, alive) == alive:  # nobody dropped out in this chunk (the common case)
                i = j
                if step < 1024:
                    step <<= 1
                continue
            for m in masks:
                nm = alive & m
                if nm != alive:
                    ends.append((alive ^ nm, i))
                    alive = nm
                    if not alive:
                        break
                i += 1
            if not alive:
                break
        if alive:
            ends.append((alive, n))
        hbm: dict[str, int] = {}
        pool: list[PoolHit] = []
        by_bit = self._by_bit
        for bits, length in ends:
            while bits:
                low = bits & -bits
                holder = by_bit[low.bit_length() - 1]
                bits ^= low
                if holder is None:
                    continue
                if holder.kind == "replica":
                    hbm[holder.source_id] = length
                else:
                    pool.append(PoolHit(holder.source_id, holder.node_id, holder.tier, length))  # type: ignore[arg-type]
        return PrefixMatch(hbm, tuple(pool))

    def snapshot(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaState],
        shard_queue_delay_s: Mapping[str, float] | None = None,
    ) -> ClusterSnapshot:
        """The ``ClusterSnapshot`` for ``request``: ``replicas`` (live ones with their load, from the load reports)
        with ``hbm_prefix_blocks`` set from this index, and the pool hits (with each shard's queue delay)."""
        match = self.query(request.block_keys)
        hbm = match.hbm
        out: Sequence[ReplicaState] = replicas
        stale_hbm = any(map(_get_hb, replicas))  # C loops: this runs on every request
        if hbm or stale_hbm:
            ids = list(map(_get_id, replicas))
            fixed = list(replicas)
            pos = dict(zip(ids, range(len(ids)), strict=True))
            if stale_hbm:  # values the caller left in: this index is the truth
                for i in compress(range(len(fixed)), map(_get_hb, replicas)):
                    if ids[i] not in hbm:
                        fixed[i] = dataclasses.replace(fixed[i], hbm_prefix_blocks=0)
            for rid, blocks in hbm.items():
                i = pos.get(rid)
                if i is not None and fixed[i].hbm_prefix_blocks != blocks:
                    fixed[i] = dataclasses.replace(fixed[i], hbm_prefix_blocks=blocks)
            out = fixed
        pool = match.pool
        if shard_queue_delay_s and pool:
            pool = tuple(
                dataclasses.replace(h, queue_delay_s=shard_queue_delay_s[h.shard_id])
                if h.shard_id in shard_queue_delay_s
                else h
                for h in pool
            )
        return ClusterSnapshot(out, pool)

    # ---- internals -------------------------------------------------------------------------------------------

    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep >= self.ttl_s / 4:
            self.expire()

    def _source(self, kind: SourceKind, source_id: str, node_id: str, epoch: str, now: float) -> tuple[_Source, bool]:
        """The source's state, reset if ``epoch`` is new; ``True`` if it was (re)created."""
        key = (kind, source_id)
        src = self._sources.get(key)
        if src is not None and src.epoch == epoch:
            if src.node_id != node_id:
                src.node_id = node_id
                for h in src.holders.values():
                    h.node_id = node_id
            return src, False
        if src is not None:
            self.remove_source(kind, source_id)
        src = _Source(kind, source_id, node_id, epoch, now)
        self._sources[key] = src
        return src, True

    def _mark_stale(self, src: _Source, reason: str) -> None:
        if not src.stale:
            src.stale = True
            src.buffer = []
        self._resync[(src.kind, src.source_id)] = reason

    def _apply_batch(
        self,
        kind: SourceKind,
        source_id: str,
        node_id: str,
        epoch: str,
        after_seq: int,
        last_seq: int,
        gap: bool,
        ops: list[_Op],
    ) -> None:
        now = self._clock()
        self._maybe_sweep(now)
        src, fresh = self._source(kind, source_id, node_id, epoch, now)
        src.last_seen = now
        if gap:
            self._mark_stale(src, f"publisher reported a gap after seq {after_seq}")
        elif after_seq > src.seq:
            why = "first seen mid-epoch" if fresh else f"gap: have seq {src.seq}, batch starts after {after_seq}"
            self._mark_stale(src, why)
        for op in ops:
            if op[0] <= src.seq:
                continue  # already applied (overlapping batch)
            self._apply_op(src, op)
            src.seq = op[0]
            if src.stale and src.buffer is not None:
                if len(src.buffer) < _MAX_STALE_BUFFER:
                    src.buffer.append(op)
                else:
                    src.buffer = None
        src.seq = max(src.seq, last_seq)

    def _apply_snapshot(
        self,
        kind: SourceKind,
        source_id: str,
        node_id: str,
        epoch: str,
        seq: int,
        keys_by_tier: Mapping[HolderTier, Iterable[bytes]],
    ) -> None:
        now = self._clock()
        self._maybe_sweep(now)
        src, _ = self._source(kind, source_id, node_id, epoch, now)
        src.last_seen = now
        for tier, keys in keys_by_tier.items():
            self._replace_holder_keys(src, tier, set(keys))
        replay = [op for op in (src.buffer or ()) if op[0] > seq]
        overflowed = src.stale and src.buffer is None
        src.seq = seq
        src.stale = False
        src.buffer = None
        self._resync.pop((kind, source_id), None)
        for op in replay:
            self._apply_op(src, op)
            src.seq = op[0]
        if overflowed:
            self._mark_stale(src, "events overflowed the buffer while waiting for the snapshot")

    def _holder(self, src: _Source, tier: HolderTier) -> _Holder:
        holder = src.holders.get(tier)
        if holder is None:
            bit = heapq.heappop(self._free_bits) if self._free_bits else len(self._by_bit)
            holder = _Holder(bit, src.kind, src.source_id, src.node_id, tier)
            if bit == len(self._by_bit):
                self._by_bit.append(holder)
            else:
                self._by_bit[bit] = holder
            src.holders[tier] = holder
        return holder

    def _apply_op(self, src: _Source, op: _Op) -> None:
        _, kind, tier, keys = op
        if kind == "stored":
            self._add(self._holder(src, tier), keys)
        elif kind == "removed":
            holder = src.holders.get(tier)
            if holder is not None:
                self._remove(holder, keys)
        elif kind == "moved":
            for other_tier, other in src.holders.items():
                if other_tier != tier:
                    self._remove(other, keys)
            self._add(self._holder(src, tier), keys)
        else:  # cleared
            for holder in src.holders.values():
                self._remove(holder, list(holder.keys))

    def _add(self, holder: _Holder, keys: Iterable[bytes]) -> None:
        bit = 1 << holder.bit
        mask = self._mask
        held = holder.keys
        for k in keys:
            if k not in held:
                held.add(k)
                mask[k] = mask.get(k, 0) | bit
            # else: already held (duplicate event), nothing to do

    def _remove(self, holder: _Holder, keys: Iterable[bytes]) -> None:
        bit = 1 << holder.bit
        mask = self._mask
        held = holder.keys
        for k in keys:
            if k in held:
                held.discard(k)
                m = mask[k] & ~bit
                if m:
                    mask[k] = m
                else:
                    del mask[k]

    def _replace_holder_keys(self, src: _Source, tier: HolderTier, keys: set[bytes]) -> None:
        holder = src.holders.get(tier)
        if holder is None:
            if keys:
                self._add(self._holder(src, tier), keys)
            return
        self._remove(holder, holder.keys - keys)
        self._add(holder, keys - holder.keys)

    def _drop_holder(self, holder: _Holder) -> None:
        self._remove(holder, list(holder.keys))
        self._by_bit[holder.bit] = None
        heapq.heappush(self._free_bits, holder.bit)
