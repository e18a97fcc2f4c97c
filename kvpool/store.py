"""The block store: one shard's DRAM and SSD tiers, without Ray. The mechanism; eviction order is a policy object.

Who calls what: the shard actor (``kvpool.shard.actor``) owns one ``BlockStore`` and calls it from its request
threads, its pull threads (``kvpool.shard.pull``) and its sweeper thread (``sweep``); it registers
``store.arena.buffer`` with its transfer endpoint. Tests drive it directly with an injected clock.

Life of a block:
1. ``reserve(n)`` hands out up to ``n`` DRAM slots (fewer when DRAM is full of leased/reserved blocks) that expire
   after ``reservation_ttl_s``. The writer fills them (a client's NIXL write into the arena, the shard's own read
   from a peer shard in a ``pull`` (``kvpool.shard.pull``), or a local copy).
2. ``commit(reservation_id, keys, checksums, fingerprint)`` recomputes each block's checksum over the arena bytes;
   matching blocks become visible (an event ``STORED``), mismatching ones are dropped and counted. Slots not
   committed go back to the free list (``slot_index`` commits keys from chosen slots, not the leading ones).
   ``abort`` or expiry returns every slot: nothing of it is ever visible. ``held(keys)`` says per key whether it is
   visible (no side effects).
3. ``lookup(keys, fingerprint)`` answers how many leading keys are held, and in which tier, with no side effects
   (no LRU touch, no sweep). An entry of another layout fingerprint is a miss.
4. ``lease(keys, fingerprint, ttl_s)`` pins the longest available prefix and returns where each block lies in the
   arena (offset, length, checksum). SSD blocks are promoted first: read into a DRAM slot, checksum verified,
   the SSD slot freed (event ``TIER_CHANGED``). DRAM blocks are verified too. A block that fails its checksum is
   removed (event ``REMOVED``), counted in ``kvstack_pool_checksum_failures_total`` and ends the prefix there:
   never data. Leased blocks are never demoted or evicted; ``release`` or expiry unpins them.
   ``touch(keys, fingerprint)`` refreshes held blocks in their tier's eviction order without leasing them (a prefix
   an engine serves from its own HBM is used without ever being leased).
5. DRAM full (a reserve or a promotion needs slots) → the DRAM policy's unpinned victims are demoted to SSD
   (``TIER_CHANGED``); SSD full → the SSD policy's victims are evicted (``REMOVED``). Without an SSD tier, DRAM
   victims are evicted.
6. Grants: every lease and reservation carries a ``grant``, 16 random bytes handed only to its caller. A transport
   that checks them (the shard's TCP server) serves a span of the arena only when ``granted(grants, spans, write)``
   says a grant the peer presented covers it: a lease's slots for reading, a reservation's for reading and writing.
   A grant dies with its lease or reservation (release, commit, abort, expiry).

Every block is ``slot_bytes`` long (one shard serves one block size, the layout's offloaded bytes per block) and
its checksum covers all of it (``kvpool.checksum.block_checksum``). Writes racing a reservation's expiry are the
writer's problem: readers get the checksum with the lease and can verify after the transfer.

Thread-safe. One lock (the store's own) guards all metadata; no disk I/O and no checksum of a leased or moving
block runs under it. A tier move is two-phase (``kvpool.tiering``): under the lock the store plans it (victims,
destination slot allocated, the entry marked in transit: never evicted, demoted, reused or freed meanwhile),
releases the lock for the copy (and the verification), re-takes it and finishes (switch tier, free the source) or
undoes it (free the destination; a failed promotion or SSD read counts a checksum failure and drops the entry).
Every slot a copy touches belongs to that one move, on no free list. While in transit an entry stays where it was
for lookups: a demoting block stays in DRAM and may be leased (the demotion is then abandoned at finish, the SSD
slot given back); a block being promoted (or read by ``read_block``) stays in SSD, and a lease or read reaching it
waits for that move to finish (the lock released meanwhile; at most ``move_wait_s``: then the lease ends before
that block, the read misses), then sees its new place. An entry removed while in
transit (a checksum failure) leaves the index at once; its move's finish frees its slots. Lease DRAM checksums
(``verify_dram_on_lease``) run outside the lock on pinned blocks (a pinned block's slot is never written).
``commit``'s checksums and ``read_block``'s DRAM copy still run under it (one block's hash: microseconds).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvpool.arena import DramArena
from kvpool.checksum import block_checksum
from kvpool.events import EVENTS_WIRE_VERSION, EventBatch, EventKind, EventLog, ShardSnapshot, Tier
from kvpool.eviction import EvictionPolicy, LruPolicy
from kvpool.keys import KEY_BYTES
from kvpool.metrics import PoolMetrics
from kvpool.ssd import SsdSlab
from kvpool.tiering import Move, MoveKind, Outcome, copy_in, copy_out, read_copy

log = logging.getLogger(__name__)
Clock = Callable[[], float]


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sizes and timeouts of one shard's store. ``ssd_slots=0`` (or no ``ssd_dir``) = DRAM only."""

    slot_bytes: int
    dram_slots: int
    ssd_dir: str = ""
    ssd_slots: int = 0
    reservation_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    verify_dram_on_lease: bool = True
    event_log_capacity: int = 65536
    shared_arena: bool = False  # the DRAM arena in a memfd same-host clients map (kvpool.transfer.shm)
    move_wait_s: float = 5.0  # a lease or read of a block another call is copying waits at most this, then misses it

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.dram_slots <= 0:
            raise ValueError(f"slot_bytes and dram_slots must be positive ({self.slot_bytes}, {self.dram_slots})")
        if self.ssd_slots < 0:
            raise ValueError(f"ssd_slots must be >= 0, got {self.ssd_slots}")
        if self.ssd_slots and not self.ssd_dir:
            raise ValueError("ssd_slots > 0 needs ssd_dir")
        if self.reservation_ttl_s <= 0 or self.max_lease_ttl_s <= 0:
            raise ValueError("ttls must be positive")


class Reservation(msgspec.Struct, frozen=True):
    """DRAM slots to write into: arena ``offsets[i]`` holds ``slot_bytes`` bytes of block i. May hold fewer slots
    than asked for (DRAM full of pinned blocks). ``grant``: presented with the transfer into them (module doc, 6)."""

    reservation_id: int
    slots: list[int]
    offsets: list[int]
    slot_bytes: int
    expires_at: float  # on the shard's clock
    ttl_s: float
    grant: bytes = b""


class CommitResult(msgspec.Struct, frozen=True):
    """Indices into the committed ``keys``: made visible / checksum mismatch (dropped) / already held (dropped)."""

    committed: list[int]
    rejected: list[int]
    duplicate: list[int]
    error: str = ""


class LookupResult(msgspec.Struct, frozen=True):
    """Leading keys held (``prefix``) and how many of those are in each tier."""

    prefix: int
    dram: int
    ssd: int


class LeasedBlock(msgspec.Struct, frozen=True, array_like=True):
    key: bytes
    offset: int  # in the arena (the shard's registered region)
    length: int
    checksum: int
    from_tier: Tier  # where it was found (SSD blocks were promoted to DRAM for the lease)


class Lease(msgspec.Struct, frozen=True):
    """Pinned blocks for keys[0:len(blocks)]; ``lease_id`` 0 = nothing leased (nothing to release). ``grant``:
    presented with the reads of its blocks (module doc, 6). ``held``: the leading keys the store held when asked
    (what ``lookup`` would have answered); fewer are pinned when a block fails its checksum, finds no DRAM slot to
    be promoted into, or is still moving after ``move_wait_s``. -1: not known (a reply without it)."""

    lease_id: int
    blocks: list[LeasedBlock]
    expires_at: float  # on the shard's clock
    ttl_s: float
    grant: bytes = b""
    held: int = -1


class TierStats(msgspec.Struct, frozen=True):
    """``capacity`` = ``blocks`` + ``free`` + ``in_transit`` (+ the reserved slots, for DRAM)."""

    capacity: int
    blocks: int
    free: int
    in_transit: int = 0  # slots held by tier moves in flight that are no visible block's own slot


class LayoutStats(msgspec.Struct, frozen=True):
    """Visible blocks of one layout fingerprint (one model: a layout names its model, ``kvpool.layout``)."""

    model: str  # the label its writers gave (the connector's model id; "" when none did)
    dram_blocks: int
    ssd_blocks: int


class StoreStats(msgspec.Struct, frozen=True):
    shard_id: str
    epoch: str
    slot_bytes: int
    dram: TierStats
    ssd: TierStats
    reserved_slots: int
    leases: int
    reservations: int
    event_seq: int
    counters: dict[str, int]
    layouts: dict[str, LayoutStats] = {}  # per layout fingerprint: each model's own accounting


class EntryInfo(msgspec.Struct, frozen=True):
    """Where a visible block lies (for tests, debugging and the SSD transfer path)."""

    tier: Tier
    slot: int
    offset: int
    path: str  # slab file for SSD, "" for DRAM
    checksum: int
    fingerprint: str
    pins: int


@dataclass(slots=True)
class _Entry:
    key: bytes
    tier: Tier
    slot: int
    checksum: int
    fingerprint: str
    pins: int = 0
    move: Move | None = None  # in transit (``kvpool.tiering``): being demoted, promoted or read from SSD

    @property
    def idle(self) -> bool:
        """Neither pinned nor in transit: it may be demoted, evicted, or give up its DRAM slot."""
        return self.pins == 0 and self.move is None


@dataclass(slots=True)
class _Reserved:
    slots: list[int]
    expires_at: float
    grant: bytes


@dataclass(slots=True)
class _Leased:
    keys: list[bytes]
    expires_at: float
    grant: bytes


GRANT_BYTES = 16  # a lease's or reservation's grant (module doc, 6): unguessable, handed only to its caller

COUNTER_NAMES = (
    "committed",
    "commit_rejected",
    "duplicates",
    "hits_dram",
    "hits_ssd",
    "misses",
    "evictions_dram",
    "evictions_ssd",
    "demotions",
    "promotions",
    "checksum_failures_dram",
    "checksum_failures_ssd",
    "leases_expired",
    "reservations_expired",
    "aborts",
    "touched",
)


class BlockStore:
    def __init__(
        self,
        config: StoreConfig,
        *,
        shard_id: str = "local",
        clock: Clock = time.monotonic,
        metrics: PoolMetrics | None = None,
        dram_policy: EvictionPolicy | None = None,
        ssd_policy: EvictionPolicy | None = None,
    ) -> None:
        self.config = config
        self.shard_id = shard_id
        self.epoch = uuid.uuid4().hex
        self._clock = clock
        self.metrics = metrics if metrics is not None else PoolMetrics(shard_id)
        self.arena = DramArena(config.slot_bytes, config.dram_slots, shared=config.shared_arena)
        self.ssd: SsdSlab | None = None
        if config.ssd_slots and config.ssd_dir:
            self.ssd = SsdSlab(Path(config.ssd_dir), config.slot_bytes, config.ssd_slots)
        self._policy = {Tier.DRAM: dram_policy or LruPolicy(), Tier.SSD: ssd_policy or LruPolicy()}
        self._entries: dict[bytes, _Entry] = {}
        self._held = {Tier.DRAM: 0, Tier.SSD: 0}  # visible blocks per tier
        self._by_layout: dict[str, dict[Tier, int]] = {}  # fingerprint -> visible blocks per tier
        self._layout_model: dict[str, str] = {}  # fingerprint -> the model label its writers gave
        self._reservations: dict[int, _Reserved] = {}
        self._leases: dict[int, _Leased] = {}
        self._grants: dict[bytes, int] = {}  # grant -> its lease or reservation id (one id counter serves both)
        self._ids = itertools.count(1)
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._lock = threading.Lock()  # all state here; released only around copies (see the module doc)
        self._settled = threading.Condition(self._lock)  # notified whenever a tier move finishes
        self._new_events = threading.Condition(self._lock)  # notified on every event (events_since's long polls)
        self._log = EventLog(shard_id, self.epoch, config.event_log_capacity, on_append=self._new_events.notify_all)
        self._moves: set[Move] = set()  # in flight
        self._publish_gauges()

    # ------------------------------------------------------------------ write path
    def reserve(self, n: int) -> Reservation:
        if n < 0:
            raise ValueError(f"reserve needs n >= 0, got {n}")
        with self._lock:
            now = self._clock()
            self._sweep(now)
            slots = self._alloc_dram(n)
            rid = next(self._ids)
            expires = now + self.config.reservation_ttl_s
            grant = b""
            if slots:
                grant = self._new_grant(rid)
                self._reservations[rid] = _Reserved(slots, expires, grant)
            self._publish_gauges()
        offsets = [self.arena.offset(s) for s in slots]
        return Reservation(rid, slots, offsets, self.config.slot_bytes, expires, self.config.reservation_ttl_s, grant)

    def _new_grant(self, owner_id: int) -> bytes:
        grant = secrets.token_bytes(GRANT_BYTES)
        self._grants[grant] = owner_id
        return grant

    def granted(self, grants: Sequence[bytes], spans: Sequence[tuple[int, int]], write: bool) -> bool:
        """Whether every arena span ``(offset, length)`` lies inside one slot that one of ``grants`` covers: a live
        reservation's slots (read or write), a live lease's blocks (read only). No side effects."""
        slot_bytes = self.config.slot_bytes
        with self._lock:
            allowed: set[int] = set()
            for grant in grants:
                owner = self._grants.get(bytes(grant))
                res = self._reservations.get(owner) if owner is not None else None
                if res is not None and hmac.compare_digest(res.grant, grant):
                    allowed.update(res.slots)
                    continue
                lease = self._leases.get(owner) if owner is not None and not write else None
                if lease is not None and hmac.compare_digest(lease.grant, grant):
                    for key in lease.keys:  # pinned: never moved while the lease lives
                        e = self._entries.get(key)
                        if e is not None and e.tier is Tier.DRAM:
                            allowed.add(e.slot)
            for offset, length in spans:
                slot, within = divmod(offset, slot_bytes)
                if length <= 0 or within + length > slot_bytes or slot not in allowed:  # arena slot i: i·slot_bytes
                    return False
        return True

    def commit(
        self,
        reservation_id: int,
        keys: Sequence[bytes],
        checksums: Sequence[int],
        fingerprint: str,
        slot_index: Sequence[int] | None = None,
        model: str = "",
    ) -> CommitResult:
        """Make ``keys[i]`` visible from reservation slot i if its arena bytes match ``checksums[i]``. ``model``
        labels the fingerprint's blocks in the stats and metrics (accounting only: the fingerprint keeps models
        apart).

        ``slot_index[i]`` (distinct indices into the reservation's slots) says which slot holds ``keys[i]`` when the
        keys are not the leading slots (a pull committing the blocks that arrived, around the ones that did not);
        every slot not named is freed."""
        if len(keys) != len(checksums):
            raise ValueError(f"commit: {len(keys)} keys but {len(checksums)} checksums")
        if slot_index is not None and len(slot_index) != len(keys):
            raise ValueError(f"commit: {len(keys)} keys but {len(slot_index)} slot indices")
        if slot_index is not None and len(set(slot_index)) != len(slot_index):
            raise ValueError("commit: slot indices must be distinct")
        for k in keys:
            if len(k) != KEY_BYTES:
                raise ValueError(f"commit: block keys are {KEY_BYTES} bytes, got {len(k)}")
        if not fingerprint:
            raise ValueError("commit: empty layout fingerprint")
        with self._lock:
            return self._commit(reservation_id, keys, checksums, fingerprint, slot_index, model)

    def _commit(self, reservation_id: int, keys: Sequence[bytes], checksums: Sequence[int], fingerprint: str,
                slot_index: Sequence[int] | None, model: str) -> CommitResult:
        self._sweep(self._clock())
        res = self._reservations.get(reservation_id)
        if res is None:
            err = f"unknown or expired reservation {reservation_id}"
            return CommitResult([], list(range(len(keys))), [], error=err)
        order = list(range(len(keys))) if slot_index is None else [int(j) for j in slot_index]
        if len(keys) > len(res.slots) or any(not 0 <= j < len(res.slots) for j in order):
            raise ValueError(f"commit: {len(keys)} keys (slot indices {order}) for a reservation of {len(res.slots)} "
                             "slots")
        self._end_reservation(reservation_id, free=False)  # its slots become entries or are freed below
        committed: list[int] = []
        rejected: list[int] = []
        duplicate: list[int] = []
        named = set(order)
        to_free: list[int] = [s for j, s in enumerate(res.slots) if j not in named]
        for i, (key, ck) in enumerate(zip(keys, checksums, strict=True)):
            key = bytes(key)
            slot = res.slots[order[i]]
            if key in self._entries:
                duplicate.append(i)
                to_free.append(slot)
                continue
            if block_checksum(self.arena.view(slot)) != ck:
                rejected.append(i)
                to_free.append(slot)
                self._count("checksum_failures_dram")
                self._count("commit_rejected")
                self.metrics.checksum_failure(Tier.DRAM.value, "commit")
                continue
            e = self._entries[key] = _Entry(key, Tier.DRAM, slot, int(ck), fingerprint)
            self._hold(e, Tier.DRAM, +1)
            self._policy[Tier.DRAM].insert(key, float(self.config.slot_bytes))
            self._log.append(EventKind.STORED, key, Tier.DRAM)
            committed.append(i)
        self.arena.free(to_free)
        if model and committed:
            self._layout_model[fingerprint] = model
        self._count("committed", len(committed))
        self._count("duplicates", len(duplicate))
        self.metrics.committed(len(committed))
        self._publish_gauges()
        return CommitResult(committed, rejected, duplicate)

    def abort(self, reservation_id: int) -> bool:
        """Return a reservation's slots; False if it was unknown (already committed, aborted or expired)."""
        with self._lock:
            if self._end_reservation(reservation_id) is None:
                return False
            self._count("aborts")
            self._publish_gauges()
            return True

    # ------------------------------------------------------------------ read path
    def held(self, keys: Sequence[bytes], fingerprint: str) -> list[bool]:
        """Per key (not a prefix): is it visible here under ``fingerprint``, in any tier. No side effects."""
        out: list[bool] = []
        with self._lock:
            for key in keys:
                e = self._entries.get(bytes(key))
                out.append(e is not None and e.fingerprint == fingerprint)
        return out

    def touch(self, keys: Sequence[bytes], fingerprint: str) -> int:
        """Mark the held ``keys`` (under ``fingerprint``, in whichever tier) as just used, for eviction: a prefix an
        engine keeps serving from its own HBM is never leased, and would otherwise age out of the pool while it is
        hot. Moves nothing between tiers; returns how many keys were held."""
        n = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(bytes(key))
                if e is None or e.fingerprint != fingerprint:
                    continue
                self._policy[e.tier].touch(e.key)
                n += 1
            self._count("touched", n)
        return n

    def lookup(self, keys: Sequence[bytes], fingerprint: str) -> LookupResult:
        """Leading keys held under ``fingerprint``; no side effects on the store. A block in transit counts in the
        tier it is leaving (see the module doc)."""
        dram = ssd = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(bytes(key))
                if e is None or e.fingerprint != fingerprint:
                    break
                if e.tier is Tier.DRAM:
                    dram += 1
                else:
                    ssd += 1
        self.metrics.lookup()
        return LookupResult(dram + ssd, dram, ssd)

    def lease(self, keys: Sequence[bytes], fingerprint: str, ttl_s: float) -> Lease:
        """Pin the longest held prefix of ``keys`` (promoting SSD blocks) for ``ttl_s`` seconds."""
        if ttl_s <= 0 or ttl_s > self.config.max_lease_ttl_s:
            raise ValueError(f"lease ttl must be in (0, {self.config.max_lease_ttl_s}], got {ttl_s}")
        keys = [bytes(k) for k in keys]
        with self._lock:
            now = self._clock()
            self._sweep(now)
            prefix = self._prefix(keys, fingerprint)
            held = len(prefix)
            deadline = time.monotonic() + self.config.move_wait_s
            while (cut := _first_moving_ssd(prefix)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:  # a disk that outlasts the wait: lease what lies before the block it still moves
                    prefix = prefix[:cut]
                    break
                self._settled.wait(left)  # another lease promotes (or a read reads) one of them: use its outcome
                prefix = self._prefix(keys, fingerprint)
            prefix = prefix[: self._servable(prefix)]
            # Pin the servable prefix first, so promoting its SSD blocks never demotes blocks of the same lease.
            for e in prefix:
                e.pins += 1
            blocks = self._lease_prefix(prefix)
            for e in prefix[len(blocks) :]:
                e.pins -= 1
            pinned = [e.key for e in prefix[: len(blocks)]]
            missed = len(keys) - len(blocks)
            self._count("misses", missed)
            self.metrics.miss(missed)
            lease_id = 0
            grant = b""
            if pinned:
                lease_id = next(self._ids)
                grant = self._new_grant(lease_id)
                self._leases[lease_id] = _Leased(pinned, now + ttl_s, grant)
            self._publish_gauges()
        return Lease(lease_id, blocks, now + ttl_s, ttl_s, grant, held)

    def _lease_prefix(self, prefix: list[_Entry]) -> list[LeasedBlock]:
        """The leased blocks of a pinned, servable prefix: its SSD blocks promoted, its DRAM blocks verified (both
        with the lock released); the first block that fails (or finds no DRAM slot) ends it."""
        promos = list({id(e): e for e in prefix if e.tier is Tier.SSD}.values())
        for e in promos:  # in transit from now on: other leases and reads of these blocks wait for the outcome
            e.move = Move(MoveKind.PROMOTE, -1, e.slot)
            self._moves.add(e.move)
        slots = self._alloc_dram(len(promos))  # may release the lock for demotions; the prefix stays pinned
        work: list[tuple[_Entry, Move]] = []
        for e, dslot in zip(promos, slots, strict=False):
            assert e.move is not None
            e.move.dram_slot = dslot
            work.append((e, e.move))
        for e in promos[len(slots) :]:  # no DRAM room after all (a victim was leased meanwhile): the prefix ends
            assert e.move is not None
            self._settle(e, e.move)
        cut = prefix.index(promos[len(slots)]) if len(slots) < len(promos) else len(prefix)
        verify = [e for e in prefix[:cut] if e.tier is Tier.DRAM] if self.config.verify_dram_on_lease else []
        bad: set[int] = set()
        outcomes: list[Outcome] = []
        with self._unlocked():
            try:
                outcomes = self._copy(work)
            finally:
                bad = {id(e) for e in verify if block_checksum(self.arena.view(e.slot)) != e.checksum}
        for (e, m), outcome in zip(work, outcomes, strict=True):
            if not self._finish_promote(e, m, outcome):
                bad.add(id(e))
        for e in {id(e): e for e in verify if id(e) in bad}.values():
            e.pins -= 1
            self._corrupted(e, "lease")
            e.pins += 1  # undone with the rest of the cut by the caller
        promoted = {id(e) for e in promos}
        blocks: list[LeasedBlock] = []
        for e in prefix[:cut]:
            if id(e) in bad:
                break
            found_in = Tier.SSD if id(e) in promoted else Tier.DRAM
            self._policy[Tier.DRAM].touch(e.key)
            blocks.append(LeasedBlock(e.key, self.arena.offset(e.slot), self.config.slot_bytes, e.checksum, found_in))
            self._count("hits_dram" if found_in is Tier.DRAM else "hits_ssd")
            self.metrics.hit(found_in.value)
        return blocks

    def release(self, lease_id: int) -> bool:
        """Unpin a lease's blocks; False if it was unknown (already released or expired)."""
        with self._lock:
            if not self._end_lease(lease_id):
                return False
            self._publish_gauges()
            return True

    def read_block(self, key: bytes, fingerprint: str) -> bytes | None:
        """Copy of one visible block's bytes, checksum-verified (SSD blocks read from the slab without promotion,
        with the lock released); None on a miss or a checksum failure. For local readers and tests; remote readers
        lease and transfer."""
        key = bytes(key)
        with self._lock:
            e = self._entries.get(key)
            deadline = time.monotonic() + self.config.move_wait_s
            while e is not None and e.tier is Tier.SSD and e.move is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None  # its copy outlasts the wait: a miss, never a wait without end
                self._settled.wait(left)  # its slot is being promoted (and freed): read wherever it lands
                e = self._entries.get(key)
            if e is None or e.fingerprint != fingerprint:
                return None
            if e.tier is Tier.DRAM:
                data = bytes(self.arena.view(e.slot))
                good = block_checksum(data) == e.checksum
            else:
                assert self.ssd is not None  # an SSD entry implies an SSD tier
                m = e.move = Move(MoveKind.READ, -1, e.slot)
                self._moves.add(m)
                outcome: Outcome = "io_error"
                data = b""
                with self._unlocked():
                    outcome, data = read_copy(self.ssd, m, e.checksum)
                if self._settle(e, m):
                    return None  # removed meanwhile
                good = outcome == "ok"
            if not good:
                self._corrupted(e, "read")
                self._publish_gauges()
                return None
            return data

    # ------------------------------------------------------------------ maintenance
    def sweep(self, now: float | None = None) -> tuple[int, int]:
        """Expire leases and reservations whose deadline passed; returns (leases, reservations) expired."""
        with self._lock:
            return self._sweep(self._clock() if now is None else now)

    def _end_lease(self, lease_id: int) -> bool:
        """(lock held) The one way a lease ends (release, expiry): its grant dies, its blocks are unpinned."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._grants.pop(lease.grant, None)
        self._unpin(lease.keys)
        return True

    def _end_reservation(self, reservation_id: int, *, free: bool = True) -> _Reserved | None:
        """(lock held) The one way a reservation ends (commit, abort, expiry): its grant dies; ``free``: its slots
        go back to the arena (a commit hands them on itself)."""
        res = self._reservations.pop(reservation_id, None)
        if res is not None:
            self._grants.pop(res.grant, None)
            if free:
                self.arena.free(res.slots)
        return res

    def _sweep(self, now: float) -> tuple[int, int]:
        dead_leases = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lid in dead_leases:
            self._end_lease(lid)
        dead_res = [rid for rid, res in self._reservations.items() if res.expires_at <= now]
        for rid in dead_res:
            self._end_reservation(rid)
        if dead_leases or dead_res:
            self._count("leases_expired", len(dead_leases))
            self._count("reservations_expired", len(dead_res))
            self.metrics.lease_expired(len(dead_leases))
            self.metrics.reservation_expired(len(dead_res))
            self._publish_gauges()
        return len(dead_leases), len(dead_res)

    def demote(self, keys: Sequence[bytes]) -> int:
        """Move these unpinned DRAM blocks to SSD now (draining, tests); returns how many moved. A block leased
        while its copy runs stays in DRAM (not counted)."""
        with self._lock:
            work: list[tuple[_Entry, Move]] = []
            for raw in keys:
                e = self._entries.get(bytes(raw))
                if e is not None and e.tier is Tier.DRAM and e.idle:
                    m = self._start_demote(e)
                    if m is not None:
                        work.append((e, m))
            moved = self._run_demotions(work, for_room=False)
            self._publish_gauges()
            return moved

    def entry_info(self, key: bytes) -> EntryInfo | None:
        with self._lock:
            e = self._entries.get(bytes(key))
            if e is None:
                return None
            if e.tier is Tier.DRAM:
                return EntryInfo(e.tier, e.slot, self.arena.offset(e.slot), "", e.checksum, e.fingerprint, e.pins)
            assert self.ssd is not None
            return EntryInfo(e.tier, e.slot, self.ssd.offset(e.slot), os.fspath(self.ssd.path), e.checksum,
                             e.fingerprint, e.pins)

    def events_since(self, after_seq: int, max_events: int = 4096, wait_s: float = 0.0) -> EventBatch:
        """The events after ``after_seq``. ``wait_s`` > 0 makes it a long poll: when there are none yet (and
        ``after_seq`` is this epoch's last), wait up to ``wait_s`` for the next one, then answer with what is there
        (possibly nothing). A cursor of another epoch or outside the ring answers at once (``gap``)."""
        with self._lock:
            if wait_s > 0 and after_seq == self._log.seq:
                self._new_events.wait_for(lambda: self._log.seq != after_seq, timeout=wait_s)
            return self._log.since(after_seq, max_events)

    def snapshot(self) -> ShardSnapshot:
        with self._lock:
            keys = list(self._entries)
            return ShardSnapshot(
                EVENTS_WIRE_VERSION, self.shard_id, self.epoch, self._log.seq, keys,
                [self._entries[k].tier for k in keys],
            )

    def stats(self) -> StoreStats:
        with self._lock:
            n_dram, n_ssd = self._held[Tier.DRAM], self._held[Tier.SSD]
            reserved = sum(len(r.slots) for r in self._reservations.values())
            ssd_cap = self.ssd.n_slots if self.ssd else 0
            ssd_free = self.ssd.free_count if self.ssd else 0
            moving_dram, moving_ssd = self._in_transit()
            return StoreStats(
                shard_id=self.shard_id,
                epoch=self.epoch,
                slot_bytes=self.config.slot_bytes,
                dram=TierStats(self.arena.n_slots, n_dram, self.arena.free_count, moving_dram),
                ssd=TierStats(ssd_cap, n_ssd, ssd_free, moving_ssd),
                reserved_slots=reserved,
                leases=len(self._leases),
                reservations=len(self._reservations),
                event_seq=self._log.seq,
                counters=dict(self.counters),
                layouts={fp: LayoutStats(self._layout_model.get(fp, ""), n[Tier.DRAM], n[Tier.SSD])
                         for fp, n in self._by_layout.items()},
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the tiers once no copy runs (waiting at most ``timeout_s`` for those in flight)."""
        with self._lock:
            if not self._settled.wait_for(lambda: not self._moves, timeout_s):
                log.warning("store %s: closing with %d tier move(s) still in flight", self.shard_id, len(self._moves))
            if self.ssd is not None:
                self.ssd.close()
            self.arena.close()

    # ------------------------------------------------------------------ internals (the lock held)
    @contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Release the store lock for a copy; re-taken however the copy ends."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def _hold(self, e: _Entry, tier: Tier, delta: int) -> None:
        """``delta`` visible blocks of ``e``'s layout in ``tier``: the shard's and the layout's counts."""
        self._held[tier] += delta
        per = self._by_layout.get(e.fingerprint)
        if per is None:
            per = self._by_layout[e.fingerprint] = {Tier.DRAM: 0, Tier.SSD: 0}
        per[tier] += delta
        if not per[Tier.DRAM] and not per[Tier.SSD]:
            del self._by_layout[e.fingerprint]

    def _prefix(self, keys: list[bytes], fingerprint: str) -> list[_Entry]:
        prefix: list[_Entry] = []
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.fingerprint != fingerprint:
                break
            prefix.append(e)
        return prefix

    def _unpin(self, keys: list[bytes]) -> None:
        for key in keys:
            e = self._entries.get(key)
            if e is not None and e.pins > 0:
                e.pins -= 1

    def _evictable(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return e is not None and e.idle

    def _servable(self, prefix: list[_Entry]) -> int:
        """Longest m such that the SSD blocks of prefix[:m] fit in DRAM: free slots plus unpinned DRAM blocks not in
        transit outside prefix[:m] (the need grows and the supply shrinks with m, so the first overflow decides)."""
        n_ssd = sum(1 for e in prefix if e.tier is Tier.SSD)
        free = self.arena.free_count
        if n_ssd <= free:
            return len(prefix)
        supply = free + sum(1 for e in self._entries.values()
                            if e.tier is Tier.DRAM and e.idle)
        need = 0
        for i, e in enumerate(prefix):
            if e.tier is Tier.SSD:
                need += 1
            elif e.idle:
                supply -= 1  # a block of this lease cannot make room for it
            if need > supply:
                return i
        return len(prefix)

    def _alloc_dram(self, n: int) -> list[int]:
        """Up to ``n`` DRAM slots, demoting (or evicting) unpinned LRU DRAM blocks to make room; the lock is released
        while the demotions' SSD writes run."""
        slots = self.arena.alloc(n)
        short = n - len(slots)
        if short <= 0:
            return slots
        work: list[tuple[_Entry, Move]] = []
        for key in self._policy[Tier.DRAM].victims(short, self._evictable):
            e = self._entries[key]
            m = self._start_demote(e)
            if m is None:
                self._drop(e, evicted=True)  # no SSD room (or no SSD tier): its slot is free now
            else:
                work.append((e, m))
        slots += self.arena.alloc(n - len(slots))
        if work:
            self._run_demotions(work, for_room=True)
            slots += self.arena.alloc(n - len(slots))
        return slots

    def _alloc_ssd(self) -> int | None:
        if self.ssd is None:
            return None
        got = self.ssd.alloc(1)
        if not got:
            for key in self._policy[Tier.SSD].victims(1, self._evictable):
                self._drop(self._entries[key], evicted=True)
            got = self.ssd.alloc(1)
        return got[0] if got else None

    def _copy(self, work: list[tuple[_Entry, Move]]) -> list[Outcome]:
        """Run the copies of ``work`` (call with the lock released); every move gets an outcome."""
        outcomes: list[Outcome] = []
        try:
            for e, m in work:
                assert self.ssd is not None  # a move implies an SSD tier
                if m.kind is MoveKind.DEMOTE:
                    outcomes.append(copy_out(self.arena, self.ssd, m))
                else:
                    outcomes.append(copy_in(self.arena, self.ssd, m, e.checksum))
        finally:
            outcomes += ["io_error"] * (len(work) - len(outcomes))
        return outcomes

    def _start_demote(self, e: _Entry) -> Move | None:
        """Plan DRAM → SSD: an SSD slot for ``e`` (evicting SSD victims), ``e`` in transit. None: no SSD room."""
        slot = self._alloc_ssd()
        if slot is None:
            return None
        m = e.move = Move(MoveKind.DEMOTE, e.slot, slot)
        self._moves.add(m)
        return m

    def _run_demotions(self, work: list[tuple[_Entry, Move]], *, for_room: bool) -> int:
        """Copy with the lock released, then finish each demotion; returns how many moved."""
        if not work:
            return 0
        outcomes: list[Outcome] = []
        with self._unlocked():
            outcomes = self._copy(work)
        return sum(self._finish_demote(e, m, o, for_room=for_room) for (e, m), o in zip(work, outcomes, strict=True))

    def _settle(self, e: _Entry, m: Move) -> bool:
        """End move ``m`` of ``e``; True if ``e`` was removed meanwhile (its slots, all ``m``'s, are freed here)."""
        self._moves.discard(m)
        if e.move is m:
            e.move = None
        self._settled.notify_all()
        if not m.dropped:
            return False
        if m.dram_slot >= 0:
            self.arena.free([m.dram_slot])
        if m.ssd_slot >= 0:
            assert self.ssd is not None
            self.ssd.free([m.ssd_slot])
        return True

    def _finish_demote(self, e: _Entry, m: Move, outcome: Outcome, *, for_room: bool) -> bool:
        """Switch ``e`` to SSD if its copy is good and nobody leased it meanwhile; else give the SSD slot back (and,
        when the slot was wanted for room, evict an unpinned block whose copy failed)."""
        if self._settle(e, m):
            return False
        assert self.ssd is not None
        if outcome != "ok" or e.pins:
            self.ssd.free([m.ssd_slot])
            if outcome != "ok" and for_room and not e.pins:
                self._drop(e, evicted=True)
            return False
        self.arena.free([e.slot])
        self._policy[Tier.DRAM].remove(e.key)
        e.tier, e.slot = Tier.SSD, m.ssd_slot
        self._hold(e, Tier.DRAM, -1)
        self._hold(e, Tier.SSD, +1)
        self._policy[Tier.SSD].insert(e.key, float(self.config.slot_bytes))
        self._log.append(EventKind.TIER_CHANGED, e.key, Tier.SSD)
        self._count("demotions")
        self.metrics.demoted()
        return True

    def _finish_promote(self, e: _Entry, m: Move, outcome: Outcome) -> bool:
        """Switch ``e`` to its verified DRAM copy; else give the DRAM slot back and treat ``e`` as corrupted (an
        unreadable block is never data either)."""
        if self._settle(e, m):
            return False
        assert self.ssd is not None and e.tier is Tier.SSD
        if outcome != "ok":
            self.arena.free([m.dram_slot])
            e.pins -= 1  # ours; SSD entries carry no other pins (leases of a block in transit wait for it)
            self._corrupted(e, "lease")
            e.pins += 1  # the caller undoes its own pin
            return False
        self.ssd.free([e.slot])
        self._policy[Tier.SSD].remove(e.key)
        e.tier, e.slot = Tier.DRAM, m.dram_slot
        self._hold(e, Tier.DRAM, +1)
        self._hold(e, Tier.SSD, -1)
        self._policy[Tier.DRAM].insert(e.key, float(self.config.slot_bytes))
        self._log.append(EventKind.TIER_CHANGED, e.key, Tier.DRAM)
        self._count("promotions")
        self.metrics.promoted()
        return True

    def _in_transit(self) -> tuple[int, int]:
        """(DRAM, SSD) slots held by moves in flight that are no visible entry's own slot."""
        dram = ssd = 0
        for m in self._moves:
            if m.kind is MoveKind.DEMOTE:
                ssd += 1
                dram += m.dropped
            elif m.kind is MoveKind.PROMOTE:
                dram += m.dram_slot >= 0
                ssd += m.dropped
            else:
                ssd += m.dropped
        return dram, ssd

    def _corrupted(self, e: _Entry, stage: str) -> None:
        """Count a checksum failure; drop the entry unless another lease still pins it (its holder has the
        checksum and verifies after transfer; the entry is dropped once unpinned and seen bad again)."""
        tier = e.tier
        self._count(f"checksum_failures_{tier.value}")
        self.metrics.checksum_failure(tier.value, stage)
        if e.pins == 0:
            self._drop(e, evicted=False)

    def _drop(self, e: _Entry, *, evicted: bool) -> None:
        """Remove an entry from its tier and the index (event ``REMOVED``). An entry in transit keeps its slot until
        its move finishes (the copy may be using it)."""
        if e.move is not None:
            e.move.dropped = True
        elif e.tier is Tier.DRAM:
            self.arena.free([e.slot])
        else:
            assert self.ssd is not None
            self.ssd.free([e.slot])
        self._policy[e.tier].remove(e.key)
        del self._entries[e.key]
        self._hold(e, e.tier, -1)
        self._log.append(EventKind.REMOVED, e.key, e.tier)
        if evicted:
            self._count(f"evictions_{e.tier.value}")
            self.metrics.evicted(e.tier.value)

    def _publish_gauges(self) -> None:
        n_dram, n_ssd = self._held[Tier.DRAM], self._held[Tier.SSD]
        sb = self.config.slot_bytes
        self.metrics.set_tier(Tier.DRAM.value, n_dram, n_dram * sb, self.arena.n_slots)
        self.metrics.set_tier(Tier.SSD.value, n_ssd, n_ssd * sb, self.ssd.n_slots if self.ssd else 0)
        self.metrics.set_active(len(self._leases), len(self._reservations))
        self.metrics.set_layouts({(self._layout_model.get(fp, ""), fp, tier.value): n
                                  for fp, per in self._by_layout.items() for tier, n in per.items()})


def _first_moving_ssd(prefix: list[_Entry]) -> int | None:
    """Index of the first SSD block of ``prefix`` another call is copying (promoting or reading), or None."""
    for i, e in enumerate(prefix):
        if e.tier is Tier.SSD and e.move is not None:
            return i
    return None
