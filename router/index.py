"""The cluster prefix view: which replica holds which prefix in HBM, which pool shard holds it in DRAM / SSD.

Who calls what: each router owns one ``PrefixIndex``. The event plumbing (``deployments/``, lead) feeds it
``apply_replica_batch`` / ``apply_replica_snapshot`` (``router.events``, from the replicas' KV events) and
``apply_shard_batch`` / ``apply_shard_snapshot`` (``kvpool.events``, from the pool shards or the directory),
sends the ``ResyncRequest``s from ``take_resync_requests()`` and calls ``expire()`` now and then. The ingress
calls ``snapshot(request, replicas)`` per request to get the ``ClusterSnapshot`` a policy ranks.

Data: key → bitmask of holders; a holder is a (source, tier): a replica's HBM, or a shard's DRAM or SSD. A query
walks the request's keys in order and ANDs the masks; a holder's prefix ends where its bit drops out, and the walk
stops when no holder remains, so a query costs O(matched length) dictionary lookups (done in C in chunks).

Learned chains (why a repeated prefix costs O(log length)): block keys are chained (``kvpool.keys``: a key fixes
every key before it), so the AND of the masks from block 0 to a key — its *prefix mask*, the holders of the whole
prefix ending there — is a function of that key alone, and it only shrinks along a chain. A walk remembers the
prefix mask of every key it matched (with its parent and children), and a later query of the same prefix reads
it at O(log length) positions (exponential search for where the remembered part ends, bisection for where the
mask changes) instead of walking it; only the part beyond is walked (and remembered). Exact at all times: every
change to a mask updates the remembered masks of the key and its remembered descendants (a holder that drops a
middle block leaves the prefix masks below it; one that fills the hole rejoins them), and a key whose prefix mask
becomes empty is forgotten with its subtree. Remembered keys are a subset of the indexed keys (memory: ~3 dict
entries per remembered key). This relies on the contract that a query's keys are a chain from block 0; a probed
key whose remembered parent is not its predecessor in the query makes the index forget everything it learned and
walk.

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
_RS_FIELDS = tuple(f.name for f in dataclasses.fields(ReplicaState))
_RS_HB = _RS_FIELDS.index("hbm_prefix_blocks")
_rs_values = attrgetter(*_RS_FIELDS)


def _with_hbm(r: ReplicaState, blocks: int) -> ReplicaState:
    """``dataclasses.replace(r, hbm_prefix_blocks=blocks)``, several times faster (every field is an init field)."""
    values = list(_rs_values(r))
    values[_RS_HB] = blocks
    return ReplicaState(*values)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest prefixes of one request: per replica in HBM, per (shard, tier) in the pool (in blocks, > 0)."""

    hbm: dict[str, int]
    pool: tuple[PoolHit, ...]


_EMPTY_MATCH = PrefixMatch({}, ())


class _ChainMismatch(Exception):
    """A query's keys contradict a learned chain (internal)."""


class _Holder:
    __slots__ = ("bit", "hit", "keys", "kind", "node_id", "source_id", "tier")

    def __init__(self, bit: int, kind: SourceKind, source_id: str, node_id: str, tier: HolderTier) -> None:
        self.bit = bit
        self.kind = kind
        self.source_id = source_id
        self.node_id = node_id
        self.tier = tier
        self.keys: set[bytes] = set()
        self.hit: PoolHit | None = None  # the last PoolHit a query returned for this holder (immutable: reused)


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
        # Learned chains: key -> prefix mask (never 0), parent (None at block 0), children (one key, or a list).
        self._pm: dict[bytes, int] = {}
        self._up: dict[bytes, bytes | None] = {}
        self._down: dict[bytes, bytes | list[bytes]] = {}

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

    def learned_blocks(self) -> int:
        """Keys whose prefix mask the index remembers (see "Learned chains")."""
        return len(self._pm)

    def forget_chains(self) -> None:
        """Forget every learned chain (queries walk again; for benchmarks of the cold path and for recovery)."""
        self._pm.clear()
        self._up.clear()
        self._down.clear()

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
        """Longest prefix of ``keys`` per holder. O(matched length) at most: stops when no holder matches any more,
        and reads the part of the chain an earlier query learned at O(log) positions."""
        n = len(keys)
        if n == 0 or not self._mask:
            return _EMPTY_MATCH
        ends: list[tuple[int, int]] = []  # (bits that dropped out, prefix length in blocks), by length
        alive, i, prev = self._recall(keys, n, ends) if self._pm else (0, 0, None)
        if i < n:
            alive = self._walk(keys, n, i, prev, alive, ends)
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
                    hit = holder.hit
                    if hit is None or hit.prefix_blocks != length or hit.node_id != holder.node_id:
                        hit = holder.hit = PoolHit(holder.source_id, holder.node_id, holder.tier, length)  # type: ignore[arg-type]
                    pool.append(hit)
        return PrefixMatch(hbm, tuple(pool))

    def _recall(self, keys: Sequence[bytes], n: int, ends: list[tuple[int, int]]) -> tuple[int, int, bytes | None]:
        """The learned part of ``keys``: appends its ends; returns (prefix mask at its last block, its length, its
        last key), or (0, 0, None) when block 0 is not learned."""
        pm, up = self._pm, self._up
        k0 = keys[0]
        v0 = pm.get(k0)
        if v0 is None:
            return 0, 0, None
        if up[k0] is not None:
            return self._inconsistent()

        def at(j: int) -> int | None:  # prefix mask at position j (None: not learned); checks the chain link
            key = keys[j]
            v = pm.get(key)
            if v is not None and up[key] != keys[j - 1]:
                raise _ChainMismatch
            return v

        try:
            last = at(n - 1) if n > 1 else v0
            if last is not None:
                f, v_last = n, last
            else:  # exponential search for the first position not learned, then bisection
                lo, hi = 0, 1
                v_lo = v0
                while hi < n - 1:
                    v = at(hi)
                    if v is None:
                        break
                    lo, v_lo = hi, v
                    hi = 2 * hi + 1
                else:
                    hi = n - 1
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    v = at(mid)
                    if v is None:
                        hi = mid
                    else:
                        lo, v_lo = mid, v
                f, v_last = lo + 1, v_lo
            # Where the prefix mask changes inside [0, f): it only shrinks, so equal ends mean no change between.
            if v0 != v_last:
                stack = [(0, v0, f - 1, v_last)]
                while stack:
                    lo, vl, hi, vh = stack.pop()
                    if vl == vh:
                        continue
                    if hi - lo == 1:
                        ends.append((vl & ~vh, hi))
                        continue
                    mid = (lo + hi) >> 1
                    vm = at(mid)
                    if vm is None:
                        raise _ChainMismatch  # a hole in the learned part: not a chain
                    stack.append((mid, vm, hi, vh))
                    stack.append((lo, vl, mid, vm))
        except _ChainMismatch:
            ends.clear()
            return self._inconsistent()
        return v_last, f, keys[f - 1]

    def _inconsistent(self) -> tuple[int, int, None]:
        """The query's keys contradict a learned chain (not a chain from block 0): forget all, walk from 0."""
        self.forget_chains()
        return 0, 0, None

    def _walk(
        self, keys: Sequence[bytes], n: int, i: int, prev: bytes | None, alive: int, ends: list[tuple[int, int]]
    ) -> int:
        """Walk ``keys[i:]`` ANDing masks (``alive``: the prefix mask at ``i - 1``; ``prev``: ``keys[i - 1]``),
        appending ends and learning the prefix masks of the matched keys; returns the mask alive at the end."""
        get = self._mask.get
        if i == 0:
            prev = keys[0]
            alive = get(prev, 0)
            if not alive:
                return 0
            self._learn(None, [prev], (alive,))
            i = 1
        step = 16
        while i < n:
            j = i + step if i + step < n else n
            chunk = keys[i:j]
            masks = list(map(get, chunk, repeat(0, j - i)))
            if reduce(and_, masks, alive) == alive:  # nobody dropped out in this chunk (the common case)
                self._learn(prev, chunk, repeat(alive, j - i))
                prev = chunk[-1]
                i = j
                if step < 1024:
                    step <<= 1
                continue
            vals: list[int] = []
            for m in masks:
                nm = alive & m
                if nm != alive:
                    ends.append((alive ^ nm, i + len(vals)))
                    alive = nm
                    if not alive:
                        break
                vals.append(alive)
            if vals:
                self._learn(prev, chunk[: len(vals)], vals)
                prev = chunk[len(vals) - 1]
            i += len(vals)
            if not alive:
                break
        return alive

    def _learn(self, parent: bytes | None, chain: list[bytes], masks: Iterable[int]) -> None:
        """Remember ``chain`` (keys not learned yet, following ``parent``) with its prefix masks (all non-zero)."""
        self._pm.update(zip(chain, masks))
        up, down = self._up, self._down
        up[chain[0]] = parent
        if len(chain) > 1:
            up.update(zip(chain[1:], chain))
            down.update(zip(chain, chain[1:]))
        if parent is not None:
            self._link(parent, chain[0])

    def _link(self, parent: bytes, child: bytes) -> None:
        kids = self._down.get(parent)
        if kids is None:
            self._down[parent] = child
        elif type(kids) is list:
            if child not in kids:
                kids.append(child)
        elif kids != child:
            self._down[parent] = [kids, child]  # type: ignore[list-item]

    def _kids(self, key: bytes) -> Sequence[bytes]:
        kids = self._down.get(key)
        if kids is None:
            return ()
        return kids if type(kids) is list else (kids,)  # type: ignore[return-value]

    def _learned_add(self, key: bytes, bit: int) -> None:
        """A holder (``bit``) now holds learned ``key``: it joins the prefix masks of the key and of the learned
        descendants it also holds, if it holds the whole prefix above ``key``."""
        pm = self._pm
        parent = self._up[key]
        if parent is not None and not pm[parent] & bit:
            return
        mask = self._mask
        stack = [key]
        while stack:
            k = stack.pop()
            pm[k] |= bit
            for c in self._kids(k):
                if not pm[c] & bit and mask.get(c, 0) & bit:
                    stack.append(c)

    def _learned_remove(self, key: bytes, bit: int) -> None:
        """A holder (``bit``) dropped learned ``key``: it leaves the prefix masks of the key and its descendants;
        keys whose prefix mask empties are forgotten with their subtrees."""
        pm = self._pm
        stack = [key]
        while stack:
            k = stack.pop()
            v = pm.get(k)
            if v is None or not v & bit:
                continue
            v &= ~bit
            if v:
                pm[k] = v
                stack.extend(c for c in self._kids(k) if pm[c] & bit)
            else:
                self._forget(k)

    def _forget(self, root: bytes) -> None:
        """Forget learned ``root`` and its learned subtree."""
        pm, up, down = self._pm, self._up, self._down
        parent = up.get(root)
        if parent is not None:
            kids = down.get(parent)
            if type(kids) is list:
                if root in kids:
                    kids.remove(root)
                if len(kids) == 1:
                    down[parent] = kids[0]
            elif kids == root:
                del down[parent]
        stack = [root]
        while stack:
            k = stack.pop()
            if pm.pop(k, None) is None:
                continue
            del up[k]
            kids = down.pop(k, None)
            if kids is not None:
                if type(kids) is list:
                    stack.extend(kids)
                else:
                    stack.append(kids)

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
        held = [r.hbm_prefix_blocks for r in replicas]
        stale_hbm = any(held)
        if hbm or stale_hbm:
            fixed = list(replicas)
            if stale_hbm:  # values the caller left in: this index is the truth
                for i in compress(range(len(fixed)), held):
                    if fixed[i].replica_id not in hbm:
                        fixed[i] = _with_hbm(fixed[i], 0)
            if hbm:
                ids = [r.replica_id for r in replicas]
                if len(hbm) <= 8:  # the last replica with that id, as a dict of positions would give
                    last = len(ids) - 1
                    rev = ids[::-1]
                    places = []
                    for rid, blocks in hbm.items():
                        if rid in ids:
                            places.append((last - rev.index(rid), blocks))
                else:
                    pos = dict(zip(ids, range(len(ids)), strict=True))
                    places = [(pos[rid], blocks) for rid, blocks in hbm.items() if rid in pos]
                for i, blocks in places:
                    if fixed[i].hbm_prefix_blocks != blocks:
                        fixed[i] = _with_hbm(fixed[i], blocks)
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
        pm = self._pm
        for k in keys:
            if k not in held:
                held.add(k)
                mask[k] = mask.get(k, 0) | bit
                if k in pm:
                    self._learned_add(k, bit)
            # else: already held (duplicate event), nothing to do

    def _remove(self, holder: _Holder, keys: Iterable[bytes]) -> None:
        bit = 1 << holder.bit
        mask = self._mask
        held = holder.keys
        pm = self._pm
        for k in keys:
            if k in held:
                held.discard(k)
                m = mask[k] & ~bit
                if m:
                    mask[k] = m
                else:
                    del mask[k]
                v = pm.get(k)
                if v is not None and v & bit:
                    self._learned_remove(k, bit)

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
