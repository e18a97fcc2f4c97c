"""The connector scheduler role's pool-call threads: lookups, leases and releases run here, never on vLLM's
scheduler thread.

Who calls what: ``kvpool.connector.scheduler.SchedulerSide`` submits each pool round trip (``submit``) and reads the
``Future`` on a later scheduler step (``Future.done()`` — it never waits on one); releases are fire-and-forget.
Every call it runs has its own deadline (the shard client's), so a frozen shard holds one thread for at most that
long and the breaker (``kvpool.connector.breaker``) skips it afterwards. ``wait_idle`` (tests, benches, shutdown)
waits, bounded, until every submitted call has finished; ``close`` drops what has not started.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

POOL_CALL_THREADS = 4  # concurrent pool round trips per engine (each bounded by its deadline)


class PoolCalls:
    def __init__(self, threads: int = POOL_CALL_THREADS, name: str = "kvpool-io") -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._inflight: set[Future[Any]] = set()
        self.submitted = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut = self._executor.submit(fn, *args)
        with self._lock:
            self._inflight.add(fut)
            self.submitted += 1
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(fut)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def wait_idle(self, timeout_s: float) -> bool:
        """True once every call submitted so far has finished (at most ``timeout_s``)."""
        with self._lock:
            pending = list(self._inflight)
        if not pending:
            return True
        _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        return not not_done

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
