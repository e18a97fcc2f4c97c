"""The cluster prefix view: which replica holds which prefix in HBM, which pool shard holds it in DRAM / SSD.

Who calls what: each router (``router.live_view.LiveView``) owns one ``PrefixIndex`` and feeds it the messages that
really flow: ``apply_replica_report`` with every ``router.hub.ReplicaReport`` it polls from the hub (a replica's HBM
deltas, or its whole key set when ``full``), and ``apply_shard_batch`` / ``apply_shard_snapshot`` with the pool
shards' ``kvpool.events`` streams (pulled by ``router.shard_sync.ShardSync``). The index holds every source's cursor
(epoch, last applied seq, stale; ``cursor``), there is no other copy: live_view reads
``take_resync_requests("replica")`` and answers with the hub's snapshot, ShardSync asks a shard for its snapshot
whenever ``cursor`` says there is none usable. The ingress calls
``snapshot(request, replicas)`` per request to get the ``ClusterSnapshot`` a policy ranks.

Data: key → bitmask of holders; a holder is a (source, tier): a replica's HBM, or a shard's DRAM or SSD. A query
walks the request's keys in order and ANDs the masks; a holder's prefix ends where its bit drops out, and the walk
stops when no holder remains, so a query costs O(matched length) dictionary lookups (done in C in chunks).

Learned chains (why a repeated prefix costs O(log length)): block keys are chained (``kvpool.keys``: a key fixes
every key before it and its position), so the AND of the masks from block 0 to a key — its *prefix mask*, the
holders of the whole prefix ending there — is a function of that key alone, and it only shrinks along a chain. A
walk remembers the prefix masks of the keys it matched (runs of them as segments: one dict entry per key, the masks
in lists), and a later query of the same prefix reads them at O(log length) positions (exponential search for where
the remembered part ends, bisection for where the mask changes) instead of walking; only the part beyond is walked
(and remembered). Exact at all times: every change to a mask updates the remembered masks of the key and of its
remembered descendants (a holder that drops a middle block leaves the prefix masks below it; one that fills the hole
rejoins them), and keys whose prefix mask empties are forgotten with their descendants, so the remembered keys are
a subset of the indexed ones. This relies on the contract that a query's keys are a chain from block 0: a probed key
remembered at another position or after another key makes the index forget all it learned and walk.

Ordering per source: sequence numbers without holes per epoch (a shard's epoch changes when it restarts; a
replica's reports carry no epoch: a restarted replica has a new replica id, so its id is its epoch, and one report is
one seq). A batch that starts after the last applied seq (or says ``gap``), or a source first seen mid-epoch (a delta
report of an unknown replica), marks the source stale and queues a resync request; its events are still applied
(a slightly wrong view beats none) and buffered, and when the snapshot arrives the holder's keys are replaced by it
and the buffered events newer than it are replayed. A source not heard from (no batch, snapshot or heartbeat — an
empty batch or report) within ``ttl_s`` is dropped with all its blocks. Clock injected; no I/O.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import reduce
from itertools import compress, repeat
from operator import and_, itemgetter
from typing import Literal

from msgspec.structs import replace as replace_struct

from kvpool.events import EventBatch as ShardEventBatch
from kvpool.events import EVENTS_WIRE_VERSION, EventKind, ShardSnapshot
from kvpool.events import Tier as ShardTier
from router.hub import HUB_WIRE_VERSION, ReplicaReport
from router.policies.base import ClusterSnapshot, PoolHit, ReplicaColumns, ReplicaState, RouteRequest

SourceKind = Literal["replica", "shard"]
HolderTier = Literal["hbm", "dram", "ssd"]
_MAX_STALE_BUFFER = 1 << 16  # buffered ops while waiting for a snapshot; beyond this, resync again


def _with_hbm(r: ReplicaState, blocks: int) -> ReplicaState:
    return replace_struct(r, hbm_prefix_blocks=blocks)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest prefixes of one request: per replica in HBM, per (shard, tier) in the pool (in blocks, > 0)."""

    hbm: dict[str, int]
    pool: tuple[PoolHit, ...]


_EMPTY_MATCH = PrefixMatch({}, ())


@dataclasses.dataclass(frozen=True, slots=True)
class ResyncRequest:
    """The index needs a snapshot of ``source_id`` (in-process: read by whoever feeds that kind of source)."""

    source_kind: SourceKind
    source_id: str
    reason: str


class _ChainMismatch(Exception):
    """A query's keys contradict a learned chain (internal)."""


_OFF_BITS = 20  # a learned key's entry: segment id << _OFF_BITS | offset in the segment
_OFF_MASK = (1 << _OFF_BITS) - 1


class _Seg:
    """A run of learned keys: chain positions [start, start + len(keys)); ``masks[i]`` is the prefix mask of
    ``keys[i]`` (non-zero, non-increasing). ``parent``: the segment and offset of the key before ``keys[0]`` (None
    at block 0); ``kids``: offset -> the segments that continue after the key at that offset (branches)."""

    __slots__ = ("id", "keys", "kids", "masks", "parent", "start")

    def __init__(self, seg_id: int, start: int, parent: _Loc | None) -> None:
        self.id = seg_id
        self.start = start
        self.parent = parent
        self.keys: list[bytes] = []
        self.masks: list[int] = []
        self.kids: dict[int, list[_Seg]] = {}


_Loc = tuple[_Seg, int]  # (segment, offset) of a learned key


def _no_learning(loc: _Loc | None, pos: int, chunk: list[bytes], masks: list[int]) -> None:
    return None


class _Chains:
    """The learned chains of one ``PrefixIndex`` (module docstring, "Learned chains"). ``mask`` is the index's own
    key -> holders dict (read here); the index calls ``added`` / ``removed`` after changing a learned key's mask."""

    __slots__ = ("at", "mask", "next_id", "segs")

    def __init__(self, mask: dict[bytes, int]) -> None:
        self.mask = mask
        self.at: dict[bytes, int] = {}  # learned key -> segment id << _OFF_BITS | offset
        self.segs: dict[int, _Seg] = {}
        self.next_id = 0

    def clear(self) -> None:
        self.at.clear()
        self.segs.clear()

    # ---- queries ---------------------------------------------------------------------------------------------

    def recall(self, keys: Sequence[bytes], n: int, ends: list[tuple[int, int]]) -> tuple[int, int, _Loc | None]:
        """The learned part of ``keys``: appends its ends; returns (prefix mask at its last block, its length, where
        that block is learned), or (0, 0, None) when block 0 is not learned (or the keys contradict what was)."""
        at, segs = self.at, self.segs

        def loc(j: int) -> _Loc | None:  # where position j is learned (None: not learned); checks the chain
            v = at.get(keys[j])
            if v is None:
                return None
            seg, off = segs[v >> _OFF_BITS], v & _OFF_MASK
            if seg.start + off != j:
                raise _ChainMismatch
            if j:
                if off:
                    before = seg.keys[off - 1]
                else:
                    parent = seg.parent
                    if parent is None:
                        raise _ChainMismatch
                    before = parent[0].keys[parent[1]]
                if before != keys[j - 1]:
                    raise _ChainMismatch
            return seg, off

        try:
            first = loc(0)
            if first is None:
                return 0, 0, None
            last = loc(n - 1) if n > 1 else first
            if last is None:  # exponential search for the first position not learned, then bisection
                lo, hi, last = 0, 1, first
                while hi < n - 1:
                    here = loc(hi)
                    if here is None:
                        break
                    lo, last = hi, here
                    hi = 2 * hi + 1
                else:
                    hi = n - 1
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    here = loc(mid)
                    if here is None:
                        hi = mid
                    else:
                        lo, last = mid, here
                f = lo + 1
            else:
                f = n
        except _ChainMismatch:
            self.clear()
            return 0, 0, None
        # The learned part is the path of segments from block 0 to ``last`` (parent links); where its prefix mask
        # changes is found by bisection in their mask lists (it only shrinks: equal ends mean no change between).
        path: list[_Loc] = []
        seg, off = last
        while True:
            path.append((seg, off))
            if seg.parent is None:
                break
            seg, off = seg.parent
        if seg is not first[0]:
            self.clear()
            return 0, 0, None
        before: int | None = None  # the prefix mask at the end of the previous segment on the path
        for seg, hi in reversed(path):
            masks, start = seg.masks, seg.start
            m_lo, m_hi = masks[0], masks[hi]
            if before is not None and m_lo != before:
                ends.append((before & ~m_lo, start))
            if m_lo != m_hi:
                stack = [(0, m_lo, hi, m_hi)]
                while stack:
                    lo, vl, up, vh = stack.pop()
                    if vl == vh:
                        continue
                    if up - lo == 1:
                        ends.append((vl & ~vh, start + up))
                        continue
                    mid = (lo + up) >> 1
                    vm = masks[mid]
                    stack.append((mid, vm, up, vh))
                    stack.append((lo, vl, mid, vm))
            before = m_hi
        return m_hi, f, last

    def learn(self, loc: _Loc | None, pos: int, chunk: list[bytes], masks: list[int]) -> _Loc | None:
        """Remember ``chunk`` (chain positions ``pos``.., following the key learned at ``loc``, or block 0 if None;
        none learned yet) with its prefix masks (non-zero); returns where its last key is learned (None: the keys
        contradict what was learned, which is all forgotten, and the walk learns no more)."""
        parent: _Loc | None = None
        seg: _Seg | None = None
        if loc is not None:  # extend loc's segment if loc is its last key and nothing branches there yet
            seg, off = loc
            if off != len(seg.keys) - 1 or off in seg.kids or off + len(chunk) >= _OFF_MASK:
                parent, seg = loc, None
        if seg is None:  # a new segment (a new chain, or a branch off the middle of one)
            seg = _Seg(self.next_id, pos, parent)
            self.next_id += 1
            self.segs[seg.id] = seg
            if parent is not None:
                parent[0].kids.setdefault(parent[1], []).append(seg)
        at = self.at
        size = len(at)
        base = seg.id << _OFF_BITS | len(seg.keys)
        at.update(zip(chunk, range(base, base + len(chunk))))
        seg.keys += chunk
        seg.masks += masks
        if len(at) != size + len(chunk):  # a key learned twice: these keys are not a chain; forget, stop learning
            self.clear()
            return None
        return seg, len(seg.keys) - 1

    # ---- events (the index changed the mask of a learned key) -------------------------------------------------

    def added(self, key: bytes, bit: int) -> None:
        """A holder (``bit``) now holds learned ``key``: it joins the prefix masks of the key and of the learned
        keys after it that it also holds, if it holds the whole prefix before ``key``."""
        v = self.at[key]
        seg, off = self.segs[v >> _OFF_BITS], v & _OFF_MASK
        if off:
            if not seg.masks[off - 1] & bit:
                return
        elif seg.parent is not None and not seg.parent[0].masks[seg.parent[1]] & bit:
            return
        get = self.mask.get
        stack = [(seg, off)]
        while stack:
            seg, off = stack.pop()
            keys, masks, kids = seg.keys, seg.masks, seg.kids
            while off < len(keys) and not masks[off] & bit and get(keys[off], 0) & bit:
                masks[off] |= bit
                if kids and off in kids:
                    stack.extend((k, 0) for k in kids[off])
                off += 1

    def removed(self, key: bytes, bit: int) -> None:
        """A holder (``bit``) dropped learned ``key``: it leaves the prefix masks of the key and of every learned
        key after it; keys whose prefix mask empties are forgotten with everything after them."""
        v = self.at[key]
        stack = [(self.segs[v >> _OFF_BITS], v & _OFF_MASK)]
        while stack:
            seg, off = stack.pop()
            masks, kids = seg.masks, seg.kids
            while off < len(masks) and masks[off] & bit:
                m = masks[off] & ~bit
                if not m:
                    self._truncate(seg, off)  # the rest of the segment had only this holder too
                    break
                masks[off] = m
                if kids and off in kids:
                    stack.extend((k, 0) for k in kids[off] if k.masks[0] & bit)
                off += 1

    def _truncate(self, seg: _Seg, off: int) -> None:
        """Forget ``seg``'s keys from ``off`` on and every segment that continues after them."""
        at, segs = self.at, self.segs
        for k in seg.keys[off:]:
            del at[k]
        del seg.keys[off:], seg.masks[off:]
        doomed = [seg.kids.pop(o) for o in [o for o in seg.kids if o >= off]]
        if off == 0:
            del segs[seg.id]
            if seg.parent is not None:
                parent, poff = seg.parent
                siblings = parent.kids.get(poff)
                if siblings is not None and seg in siblings:
                    siblings.remove(seg)
                    if not siblings:
                        del parent.kids[poff]
        stack = [k for kids in doomed for k in kids]
        while stack:
            k = stack.pop()
            for key in k.keys:
                del at[key]
            del segs[k.id]
            for kids in k.kids.values():
                stack.extend(kids)


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


# An op: (seq, kind, tier, keys). kind: "stored" | "removed" | "moved" (to tier). Several ops may share a seq (the
# removed and stored keys of one replica report).
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
        self._chains = _Chains(self._mask)

    # ---- introspection ---------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct block keys held anywhere."""
        return len(self._mask)

    def sources(self) -> list[tuple[SourceKind, str]]:
        return list(self._sources)

    def is_stale(self, kind: SourceKind, source_id: str) -> bool:
        src = self._sources.get((kind, source_id))
        return src is not None and src.stale

    def cursor(self, kind: SourceKind, source_id: str) -> tuple[str, int] | None:
        """(epoch, last applied seq) of a source, or None when unknown or stale (it needs a snapshot first)."""
        src = self._sources.get((kind, source_id))
        return None if src is None or src.stale else (src.epoch, src.seq)

    def held_blocks(self, kind: SourceKind, source_id: str, tier: HolderTier) -> int:
        src = self._sources.get((kind, source_id))
        holder = src.holders.get(tier) if src else None
        return len(holder.keys) if holder else 0

    def learned_blocks(self) -> int:
        """Keys whose prefix mask the index remembers (see "Learned chains")."""
        return len(self._chains.at)

    def forget_chains(self) -> None:
        """Forget every learned chain (queries walk again; for benchmarks of the cold path)."""
        self._chains.clear()

    # ---- replica reports (router.hub) ------------------------------------------------------------------------

    def apply_replica_report(self, report: ReplicaReport) -> None:
        """Apply one replica report: ``full`` = its whole HBM key set at ``seq``; else the delta after ``seq - 1``
        (its removed keys, then its stored keys). An empty delta is a heartbeat. ``gone`` reports are the caller's
        (``remove_source``)."""
        if report.version != HUB_WIRE_VERSION:
            raise ValueError(f"replica report version {report.version} not supported (expected {HUB_WIRE_VERSION})")
        rid, seq = report.replica_id, report.seq
        if report.full:
            self._apply_snapshot("replica", rid, report.node_id, rid, seq, {"hbm": report.stored})
            return
        ops: list[_Op] = []
        if report.removed:
            ops.append((seq, "removed", "hbm", report.removed))
        if report.stored:
            ops.append((seq, "stored", "hbm", report.stored))
        self._apply_batch("replica", rid, report.node_id, rid, seq - 1, seq, False, ops)

    # ---- pool shard events (kvpool.events) -----------------------------------------------------------------------

    def apply_shard_batch(self, batch: ShardEventBatch, node_id: str) -> None:
        """Apply a shard's events; ``node_id`` is the node the shard runs on (from the shard registry)."""
        if batch.version != EVENTS_WIRE_VERSION:
            raise ValueError(f"shard event version {batch.version} not supported")
        ops: list[_Op] = []
        for ev in batch.events:
            tier: HolderTier = "dram" if ev.tier is ShardTier.DRAM else "ssd"
            kind = {EventKind.STORED: "stored", EventKind.REMOVED: "removed", EventKind.TIER_CHANGED: "moved"}[ev.kind]
            ops.append((ev.seq, kind, tier, (ev.key,)))
        self._apply_batch("shard", batch.shard_id, node_id, batch.epoch, batch.after_seq, batch.last_seq, batch.gap,
                          ops)

    def apply_shard_snapshot(self, snap: ShardSnapshot, node_id: str) -> None:
        if snap.version != EVENTS_WIRE_VERSION:
            raise ValueError(f"shard snapshot version {snap.version} not supported")
        if len(snap.keys) != len(snap.tiers):
            raise ValueError(f"shard snapshot {snap.shard_id}: {len(snap.keys)} keys but {len(snap.tiers)} tiers")
        by_tier: dict[HolderTier, list[bytes]] = {"dram": [], "ssd": []}
        for key, tier in zip(snap.keys, snap.tiers, strict=True):
            by_tier["dram" if tier is ShardTier.DRAM else "ssd"].append(key)
        self._apply_snapshot("shard", snap.shard_id, node_id, snap.epoch, snap.seq, by_tier)

    # ---- resync and liveness ---------------------------------------------------------------------------------------

    def take_resync_requests(self, kind: SourceKind) -> list[ResyncRequest]:
        """Snapshots the index needs of ``kind``'s sources (each asked once until it arrives or the source is seen
        stale again)."""
        out = [ResyncRequest(k, sid, reason) for (k, sid), reason in self._resync.items() if k == kind]
        for r in out:
            del self._resync[(kind, r.source_id)]
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
        chains = self._chains
        alive, i, loc = chains.recall(keys, n, ends) if chains.at else (0, 0, None)
        if i < n:
            alive = self._walk(keys, n, i, loc, alive, ends)
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

    def _walk(
        self, keys: Sequence[bytes], n: int, i: int, loc: _Loc | None, alive: int, ends: list[tuple[int, int]]
    ) -> int:
        """Walk ``keys[i:]`` ANDing masks (``alive``: the prefix mask at ``i - 1``, learned at ``loc``), appending
        ends and learning the prefix masks of the matched keys; returns the mask alive at the end."""
        mask = self._mask
        get = mask.get
        learn = self._chains.learn
        if i == 0:
            alive = get(keys[0], 0)
            if not alive:
                return 0
            loc = learn(None, 0, [keys[0]], [alive])
            if loc is None:
                learn = _no_learning
            i = 1
        step = 16
        while i < n:
            j = i + step if i + step < n else n
            chunk = keys[i:j]
            if j - i > 1:
                try:
                    masks: Sequence[int] = itemgetter(*chunk)(mask)  # all in C; a missing key ends the walk here
                except KeyError:
                    masks = list(map(get, chunk, repeat(0, j - i)))
            else:
                masks = (get(chunk[0], 0),)
            m0 = masks[0]
            if m0 & alive == alive and (masks.count(m0) == j - i or reduce(and_, masks, alive) == alive):
                loc = learn(loc, i, chunk, [alive] * (j - i))  # nobody dropped out in this chunk (the common case)
                if loc is None:
                    learn = _no_learning
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
                loc = learn(loc, i, chunk[: len(vals)], vals)
                if loc is None:
                    learn = _no_learning
            i += len(vals)
            if not alive:
                break
        return alive

    def snapshot(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaState],
        shard_queue_delay_s: Mapping[str, float] | None = None,
        *,
        columns: ReplicaColumns | None = None,
    ) -> ClusterSnapshot:
        """The ``ClusterSnapshot`` for ``request``: ``replicas`` (live ones with their load, from the load reports)
        with ``hbm_prefix_blocks`` set from this index, and the pool hits (with each shard's queue delay).
        ``columns``: the same replicas as columns (``ReplicaBook.view``), passed on with their ``hbm`` column set
        the same way (None: the snapshot carries none)."""
        match = self.query(request.block_keys)
        hbm = match.hbm
        out: Sequence[ReplicaState] = replicas
        if columns is not None:
            if len(columns.ids) != len(replicas):
                raise ValueError(f"columns of {len(columns.ids)} replicas for a list of {len(replicas)}")
            held = columns.hbm
        else:
            held = [r.hbm_prefix_blocks for r in replicas]
        stale_hbm = any(held)
        if hbm or stale_hbm:
            fixed = list(replicas)
            blocks_of = held[:] if columns is not None else None
            if stale_hbm:  # values the caller left in: this index is the truth
                for i in compress(range(len(fixed)), held):
                    if fixed[i].replica_id not in hbm:
                        fixed[i] = _with_hbm(fixed[i], 0)
                        if blocks_of is not None:
                            blocks_of[i] = 0
            if hbm:
                ids = columns.ids if columns is not None else [r.replica_id for r in replicas]
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
                        if blocks_of is not None:
                            blocks_of[i] = blocks
            out = fixed
            if columns is not None:
                columns = columns.with_changes(hbm=blocks_of)
        pool = match.pool
        if shard_queue_delay_s and pool:
            pool = tuple(
                replace_struct(h, queue_delay_s=shard_queue_delay_s[h.shard_id])
                if h.shard_id in shard_queue_delay_s
                else h
                for h in pool
            )
        return ClusterSnapshot(out, pool, columns)

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
        applied = src.seq
        for op in ops:
            if op[0] <= applied:
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
        else:  # moved
            for other_tier, other in src.holders.items():
                if other_tier != tier:
                    self._remove(other, keys)
            self._add(self._holder(src, tier), keys)

    def _add(self, holder: _Holder, keys: Iterable[bytes]) -> None:
        bit = 1 << holder.bit
        mask = self._mask
        held = holder.keys
        at = self._chains.at
        for k in keys:
            if k not in held:
                held.add(k)
                mask[k] = mask.get(k, 0) | bit
                if at and k in at:
                    self._chains.added(k, bit)
            # else: already held (duplicate event), nothing to do

    def _remove(self, holder: _Holder, keys: Iterable[bytes]) -> None:
        bit = 1 << holder.bit
        mask = self._mask
        held = holder.keys
        at = self._chains.at
        for k in keys:
            if k in held:
                held.discard(k)
                m = mask[k] & ~bit
                if m:
                    mask[k] = m
                else:
                    del mask[k]
                if at and k in at:
                    self._chains.removed(k, bit)

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
