"""The stop flag of a long-running launcher: set by SIGINT/SIGTERM, polled by the threads that wait on it, and
``run_app`` — ``serve.run`` bounded by a deadline and by the flag.

Who calls it: ``kvstack serve`` (``cluster.commands.serve``) and the Ray Serve LLM anchor (``bench.ray_serve_llm``).
``handle_signals`` must be called again after ``ray.init``, whose core worker replaces the handlers.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any


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


def run_app(app: Any, name: str, stop: StopFlag, deadline_s: float) -> bool:
    """``serve.run(app, name=name, route_prefix="/")``, which waits for the app without a deadline and cannot be
    interrupted, on a thread of its own while this one waits, bounded, honouring ``stop``. True once the app is
    ready, False if ``stop`` was set first; ``TimeoutError`` past ``deadline_s``; the deploy's own exception if it
    failed."""
    from ray import serve

    failure: list[BaseException] = []

    def deploy() -> None:
        try:
            serve.run(app, name=name, route_prefix="/")
        except BaseException as exc:  # noqa: BLE001 - raised again by the waiting thread
            failure.append(exc)

    worker = threading.Thread(target=deploy, name="serve-deploy", daemon=True)
    worker.start()
    deadline = time.monotonic() + deadline_s
    while worker.is_alive():
        if stop.wait(0.5):
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app was not ready within {deadline_s:.0f} s (see the replica logs)")
    if failure:
        raise failure[0]
    return True
