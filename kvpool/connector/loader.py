"""The connector's background loader: leased blocks reach the KV cache without vLLM's model runner waiting.

Who calls what: ``WorkerSide.start_load_kv`` (vLLM's model runner, every step) hands the step's ``LoadSpec``s to
``BlockLoader.submit`` and returns. The loader's one thread takes everything queued at once and runs
``run_batch(specs)`` (``WorkerSide._load_batch``: one transfer read per shard for all of the batch's blocks — loads of
several requests overlap in one transfer instead of running one after another — then the checksums), which posts
each request's outcome for ``get_transfer_results``. The requests wait in vLLM's ``WAITING_FOR_REMOTE_KVS`` meanwhile;
the engine steps the others. The thread owns the load endpoint while it runs (nothing else moves bytes with it).
Every read has the transfer deadline, so a frozen shard holds the thread at most that long. ``wait_idle`` (tests,
shutdown) waits, bounded, until every submitted spec has run.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class BlockLoader:
    def __init__(self, run_batch: Callable[[list[Any]], None], name: str = "kvpool-loader") -> None:
        self._run_batch = run_batch
        self._queue: queue.Queue[Any] = queue.Queue()
        self._idle = threading.Condition()
        self._unfinished = 0
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, specs: list[Any]) -> None:
        if not specs:
            return
        with self._idle:
            self._unfinished += len(specs)
        self._queue.put(list(specs))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loader's thread, in order with the loads (the worker fetches a shard's metadata there
        for its inline loads: never on the model runner's thread). Exceptions are logged."""
        with self._idle:
            self._unfinished += 1
        self._queue.put(fn)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a bug must not kill the thread
            log.exception("kvpool connector: loader call failed")
        finally:
            with self._idle:
                self._unfinished -= 1
                self._idle.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if callable(item):
                self._call(item)
                continue
            batch = list(item)
            stop = False
            while True:  # every load queued meanwhile joins this batch (a call queued meanwhile runs first)
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                if callable(more):
                    self._call(more)
                    continue
                batch.extend(more)
            try:
                self._run_batch(batch)
            except Exception:  # noqa: BLE001 - run_batch reports per spec; a bug must not kill the thread
                log.exception("kvpool connector: load batch of %d spec(s) failed", len(batch))
            finally:
                self.batches += 1
                with self._idle:
                    self._unfinished -= len(batch)
                    self._idle.notify_all()
            if stop:
                return

    def wait_idle(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout_s)

    def close(self, timeout_s: float) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
