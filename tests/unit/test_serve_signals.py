"""``kvstack serve``'s stop flag (cluster/stop_flag.py): set by real signals while the main thread waits on it,
twice in a row — a ``threading.Event`` deadlocked there (its ``set`` takes the lock its ``wait`` holds)."""

from __future__ import annotations

import os
import signal
import threading
import time

from cluster.stop_flag import StopFlag


def test_signals_during_the_wait_stop_it_without_deadlock() -> None:
    flag = StopFlag()
    previous = signal.signal(signal.SIGUSR1, lambda *_: flag.set())
    try:
        def send_twice() -> None:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)

        threading.Thread(target=send_twice, daemon=True).start()
        t0 = time.monotonic()
        assert flag.wait(10.0) is True
        assert time.monotonic() - t0 < 5.0
        assert flag.is_set() and flag.wait(0.0)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_wait_times_out_unset() -> None:
    flag = StopFlag()
    t0 = time.monotonic()
    assert flag.wait(0.3) is False
    assert 0.25 < time.monotonic() - t0 < 3.0
