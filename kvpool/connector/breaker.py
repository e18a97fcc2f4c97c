"""Per-shard circuit breaker: a shard that failed or did not answer is skipped for a backoff period, then probed.

Who calls what: ``kvpool.connector.pool.PoolShards`` (one breaker per ``PoolShards``: the connector's scheduler role,
its worker role, the saver) asks ``allow(shard_id)`` before every call to a shard and reports the outcome with
``success`` / ``failure``. A closed breaker allows everything. The first failure opens it for ``base_s``; while open,
``allow`` is False (the caller treats the shard as a miss at once instead of waiting out another deadline). When the
backoff has passed, one caller is let through as a probe (half-open): its success closes the breaker, its failure
opens it again for twice as long (capped at ``max_s``). A probe that never reports back is given up after ``base_s``
and another caller probes. No thread, no timer: the state moves on the callers' clock (``clock``, injectable).
Thread-safe: the scheduler role's pool calls run on several threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _State:
    failures: int = 0  # consecutive failures (0: closed)
    open_until: float = 0.0
    probing_since: float | None = None  # a half-open probe is in flight since then


@dataclass
class BreakerStats:
    trips: int = 0  # closed → open
    reopens: int = 0  # a failed probe (open again, longer)
    recoveries: int = 0  # a probe succeeded: closed again
    skipped: int = 0  # calls refused while open


class ShardBreaker:
    def __init__(self, *, base_s: float = 2.0, max_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if base_s <= 0 or max_s < base_s:
            raise ValueError(f"breaker backoff must satisfy 0 < base_s <= max_s, got {base_s}, {max_s}")
        self.base_s, self.max_s, self._clock = base_s, max_s, clock
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()
        self.stats = BreakerStats()

    def backoff_s(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, failures - 1))

    def allow(self, shard_id: str) -> bool:
        """May the caller talk to this shard now? True when closed, or as the one probe of a half-open shard."""
        with self._lock:
            st = self._states.get(shard_id)
            if st is None or st.failures == 0:
                return True
            now = self._clock()
            if now < st.open_until:
                self.stats.skipped += 1
                return False
            if st.probing_since is not None and now - st.probing_since < self.base_s:
                self.stats.skipped += 1
                return False
            st.probing_since = now
            return True

    def success(self, shard_id: str) -> None:
        with self._lock:
            st = self._states.get(shard_id)
            if st is not None and st.failures:
                self.stats.recoveries += 1
                self._states.pop(shard_id)

    def failure(self, shard_id: str) -> None:
        with self._lock:
            st = self._states.setdefault(shard_id, _State())
            if st.failures == 0:
                self.stats.trips += 1
            elif st.probing_since is not None:
                self.stats.reopens += 1
            elif self._clock() < st.open_until:
                return  # another call that was already in flight when the breaker opened: no longer backoff
            st.failures += 1
            st.probing_since = None
            st.open_until = self._clock() + self.backoff_s(st.failures)

    def is_open(self, shard_id: str) -> bool:
        """Open or half-open (tests, status)."""
        with self._lock:
            st = self._states.get(shard_id)
            return st is not None and st.failures > 0

    def open_shards(self) -> list[str]:
        with self._lock:
            return sorted(s for s, st in self._states.items() if st.failures)
