"""Simulated prefix caches: LRU block caches sized in tokens, and one block -> holders map for longest-prefix queries.

``BlockHolders`` is the simulator's own (int block ids and cache ids, updated in place, no events or cursors); the
router's event-fed cluster view is ``router.index.PrefixIndex``.

Used only by ``bench.simulate`` (the simulated cluster). A *block* is a chained prefix id (an ``int`` the simulator
interns from ``(parent id, hash id)``), so holding block ``i`` means holding the KV of exactly that prefix's
``i``-th block, as with real block keys. Every cache (a replica's HBM, a shard's DRAM, a shard's SSD) registers in
one ``BlockHolders`` that maps block -> holders; ``BlockHolders.prefix_blocks`` walks a request's blocks once and
returns, per holder, how many leading blocks it holds, in time proportional to the matched length times the
number of holders still matching.

Eviction is LRU at block granularity. ``BlockCache.admit`` refreshes a request's blocks tail-first so the head of
a prefix is the most recent and tails are evicted first (a prefix stays usable as long as possible), like vLLM's
free-block queue. An evicted block may go to a spill cache (DRAM -> SSD).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

_EMPTY: frozenset[int] = frozenset()


class BlockHolders:
    """block id -> ids of the caches holding it; longest-prefix match per cache."""

    __slots__ = ("_holders",)

    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}

    def add(self, block: int, cache_id: int) -> None:
        holders = self._holders.get(block)
        if holders is None:
            self._holders[block] = {cache_id}
        else:
            holders.add(cache_id)

    def remove(self, block: int, cache_id: int) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(cache_id)
            if not holders:
                del self._holders[block]

    def holders(self, block: int) -> set[int] | frozenset[int]:
        return self._holders.get(block, _EMPTY)

    def prefix_blocks(self, blocks: Sequence[int]) -> dict[int, int]:
        """For every cache holding at least the first block: the number of leading blocks it holds."""
        if not blocks:
            return {}
        first = self._holders.get(blocks[0])
        if not first:
            return {}
        alive = set(first)
        out: dict[int, int] = {}
        get = self._holders.get
        for i in range(1, len(blocks)):
            here = get(blocks[i], _EMPTY)
            if len(here) >= len(alive) and alive <= here:
                continue
            for cache_id in alive - here:
                out[cache_id] = i
            alive &= here
            if not alive:
                return out
        n = len(blocks)
        for cache_id in alive:
            out[cache_id] = n
        return out


class BlockCache:
    """One tier of one holder: block -> tokens, LRU, capacity in tokens (``math.inf`` = unbounded, 0 = off)."""

    __slots__ = ("cache_id", "capacity_tokens", "used_tokens", "_blocks", "_index", "spill", "evicted_tokens")

    def __init__(
        self, cache_id: int, capacity_tokens: float, index: BlockHolders, spill: BlockCache | None = None
    ) -> None:
        if capacity_tokens < 0 or math.isnan(capacity_tokens):
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.cache_id = cache_id
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._index = index
        self.spill = spill
        self.evicted_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def admit(self, blocks: Sequence[int], tokens: Sequence[int]) -> None:
        """Insert or refresh ``blocks`` (a request's prefix, head first); evict LRU blocks to fit.

        Blocks are touched tail-first, so the head ends up most recent. Blocks that alone exceed the capacity
        are not admitted (the head is kept before the tail).
        """
        if self.capacity_tokens <= 0:
            return
        store = self._blocks
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            if b in store:
                store.move_to_end(b)
                continue
            n = tokens[i]
            if n > self.capacity_tokens:
                continue
            store[b] = n
            self.used_tokens += n
            self._index.add(b, self.cache_id)
        self._evict_to_fit()

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark held ``blocks`` as used (tail-first, like ``admit``); blocks not held are ignored."""
        store = self._blocks
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i] in store:
                store.move_to_end(blocks[i])

    def _evict_to_fit(self) -> None:
        store = self._blocks
        while self.used_tokens > self.capacity_tokens and store:
            # Never evict what was just admitted if that is all there is; the loop ends when used fits.
            block, n = store.popitem(last=False)
            self.used_tokens -= n
            self.evicted_tokens += n
            self._index.remove(block, self.cache_id)
            if self.spill is not None:
                self.spill.admit((block,), (n,))
