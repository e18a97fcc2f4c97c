"""Eviction policies: pure objects that rank what to evict. No I/O, no clocks, no knowledge of tiers or leases.

Who calls what: the block store (``kvpool.store``) keeps one policy per tier. It calls ``insert`` when a block
enters the tier, ``touch`` when a block is used (leased), ``remove`` when it leaves the tier (demoted, evicted,
promoted), and ``victims(n, is_evictable)`` when it needs room; the store then moves or drops the victims itself
and calls ``remove``. ``victims`` never mutates: a caller that does not act on the answer leaves no trace.

Pins (leases, blocks being staged) stay in the store; the policy only sees them through ``is_evictable``, so a
policy can never evict a leased block. ``insert`` takes a ``cost`` hint (e.g. bytes, or the recompute time the
block saves) that LRU ignores and a cost-aware policy (GreedyDual-Size, LFU with aging) can rank by; the interface
does not change when such a policy is added.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(abc.ABC, Generic[K]):
    """Ranks the blocks of one tier for eviction."""

    @abc.abstractmethod
    def insert(self, key: K, cost: float = 1.0) -> None:
        """``key`` entered the tier (re-inserting a present key counts as a touch)."""

    @abc.abstractmethod
    def touch(self, key: K) -> None:
        """``key`` was used; unknown keys are ignored."""

    @abc.abstractmethod
    def remove(self, key: K) -> None:
        """``key`` left the tier; unknown keys are ignored."""

    @abc.abstractmethod
    def victims(self, n: int, is_evictable: Callable[[K], bool]) -> list[K]:
        """Up to ``n`` keys to evict, best victim first, skipping keys for which ``is_evictable`` is False."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...


class LruPolicy(EvictionPolicy[K]):
    """Least recently inserted-or-touched first."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, cost: float = 1.0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, is_evictable: Callable[[K], bool]) -> list[K]:
        if n <= 0:
            return []
        out: list[K] = []
        for key in self._order:
            if is_evictable(key):
                out.append(key)
                if len(out) == n:
                    break
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        """Oldest first (for tests and debugging)."""
        return iter(list(self._order))


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Policy by config name; unknown names are refused."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return factory()
