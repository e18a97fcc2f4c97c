"""Which block keys one engine has saved to the pool, is saving, and failed to save — so no save is lost silently.

Who calls what: the connector's scheduler role (``kvpool.connector.scheduler.SchedulerSide``) asks ``wanted(key)``
while it plans a step's saves and records the planned keys with ``planned``; the worker role reports what became of
them (``kvpool.connector.meta.SaveReport``, through vLLM's worker → scheduler metadata channel:
``build_connector_worker_meta`` → ``update_connector_output``), which the scheduler hands to ``outcome``.

A key counts as saved only once its shard committed it (or already held it: a duplicate, e.g. another replica of
the node saved it first — the shard commits a key once). A key that was dropped (no staging slot), found no room,
failed its job (shard down, deadline, transfer) or was rejected by the shard's checksum check is counted and may be
planned again — when a later step computes it, or holds it in the engine's own cache at a request's first step —
up to ``max_attempts`` times. A key whose job never reached the shard (unreachable: its breaker open while it
restarts, no actor of its name) spends no attempt: it is wanted again (``skipped``). A planned key whose outcome
never arrives is wanted again after ``in_flight_s``.
A saved key the shard no longer holds (evicted, or the shard restarted empty: the scheduler role sees it in a lookup
or a short lease on that shard) is ``forget``-ten: wanted again, so the next computation of it saves it again
(without that, an engine never re-saved a block it had saved once, and a restarted shard never served its prefixes).
Bounded: ``capacity`` keys per set, oldest dropped first. Used from the scheduler's thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SAVE_BOOK_KEYS = 65536
MAX_SAVE_ATTEMPTS = 3
SAVE_IN_FLIGHT_S = 120.0  # a planned save without an outcome after this long is planned again


@dataclass
class SaveBookStats:
    planned: int = 0
    committed: int = 0  # committed or already held by the shard
    failed: int = 0  # dropped, no room, failed job, checksum rejected
    retried: int = 0  # planned again after a failure
    given_up: int = 0  # failed max_attempts times: not planned again
    expired: int = 0  # no outcome within in_flight_s
    skipped: int = 0  # never attempted (the shard was unreachable): wanted again, no attempt counted
    lost: int = 0  # saved, then no longer held by the shard (evicted, shard restarted): wanted again


def _bounded_put(d: OrderedDict[bytes, object], key: bytes, value: object, capacity: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > capacity:
        d.popitem(last=False)


class SaveBook:
    def __init__(self, *, capacity: int = SAVE_BOOK_KEYS, max_attempts: int = MAX_SAVE_ATTEMPTS,
                 in_flight_s: float = SAVE_IN_FLIGHT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.max_attempts, self.in_flight_s, self._clock = capacity, max_attempts, in_flight_s, clock
        self._saved: OrderedDict[bytes, object] = OrderedDict()
        self._in_flight: OrderedDict[bytes, object] = OrderedDict()  # key -> planned at
        self._failures: OrderedDict[bytes, object] = OrderedDict()  # key -> failed attempts
        self.stats = SaveBookStats()

    def wanted(self, key: bytes) -> bool:
        """Should this key be saved now? Not when saved, in flight, or given up."""
        if key in self._saved:
            return False
        at = self._in_flight.get(key)
        if at is not None:
            if self._clock() - float(at) < self.in_flight_s:  # type: ignore[arg-type]
                return False
            del self._in_flight[key]
            self.stats.expired += 1
        return int(self._failures.get(key, 0)) < self.max_attempts  # type: ignore[call-overload]

    def failed_before(self, key: bytes) -> bool:
        """A key whose save failed and may be retried (a held copy of it is worth saving)."""
        return key in self._failures and self.wanted(key)

    def planned(self, keys: Iterable[bytes]) -> None:
        now = self._clock()
        for key in keys:
            if key in self._failures:
                self.stats.retried += 1
            _bounded_put(self._in_flight, key, now, self.capacity)
            self.stats.planned += 1

    def outcome(self, saved: Iterable[bytes], failed: Iterable[bytes], skipped: Iterable[bytes] = ()) -> None:
        for key in saved:
            self._in_flight.pop(key, None)
            self._failures.pop(key, None)
            _bounded_put(self._saved, key, None, self.capacity)
            self.stats.committed += 1
        for key in failed:
            self._in_flight.pop(key, None)
            attempts = int(self._failures.get(key, 0)) + 1  # type: ignore[call-overload]
            _bounded_put(self._failures, key, attempts, self.capacity)
            self.stats.failed += 1
            if attempts == self.max_attempts:
                self.stats.given_up += 1
        for key in skipped:  # the shard was unreachable (e.g. restarting): no attempt spent, wanted again
            self._in_flight.pop(key, None)
            self.stats.skipped += 1

    def forget(self, keys: Iterable[bytes]) -> int:
        """These saved keys are no longer held by the shard: wanted again (with a fresh attempt count). Returns how
        many were saved."""
        n = 0
        for key in keys:
            if key in self._saved:
                del self._saved[key]
                n += 1
        self.stats.lost += n
        return n

    def is_saved(self, key: bytes) -> bool:
        return key in self._saved

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
