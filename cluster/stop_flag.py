"""The stop flag of a long-running launcher: set by SIGINT/SIGTERM, polled by the threads that wait on it.

Who calls it: ``kvstack serve`` (``cluster.commands.serve``) and the Ray Serve LLM anchor (``bench.ray_serve_llm``).
``handle_signals`` must be called again after ``ray.init``, whose core worker replaces the handlers.
"""

from __future__ import annotations

import signal
import time


class StopFlag:
    """Set by SIGINT/SIGTERM, polled by the threads that wait on it. No lock: a signal handler runs on the main
    thread wherever it is, also inside a wait on this flag, so a ``threading.Event`` (whose ``set`` takes the lock
    its ``wait`` holds) deadlocked ``kvstack serve`` on a second Ctrl-C."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not self._set and time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        return self._set


def handle_signals(stop: StopFlag) -> None:
    """SIGINT/SIGTERM set ``stop``. Re-installed after ``ray.init``, whose core worker replaces the handlers."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
