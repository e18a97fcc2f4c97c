"""The shard circuit breaker (``kvpool.connector.breaker``), the GCS deadline (``kvpool.deadline``) and the
background loader's batching (``kvpool.connector.loader``)."""

from __future__ import annotations

import threading
import time

import pytest

from kvpool.connector.breaker import ShardBreaker
from kvpool.connector.loader import BlockLoader
from kvpool.deadline import call_with_deadline
from kvpool.shard.wire import ShardUnavailableError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_backs_off_probes_once_and_closes_on_success() -> None:
    clock = Clock()
    b = ShardBreaker(base_s=2.0, max_s=8.0, clock=clock)
    assert b.allow("s") and not b.is_open("s")
    b.failure("s")
    assert not b.allow("s") and b.is_open("s") and b.stats.trips == 1
    b.failure("s")  # a call already in flight when it opened: not a longer backoff
    clock.t += 2.0
    assert b.allow("s")  # the probe
    assert not b.allow("s")  # only one probe at a time
    b.failure("s")  # the probe failed: open twice as long
    assert b.stats.reopens == 1
    clock.t += 3.9
    assert not b.allow("s")
    clock.t += 0.1
    assert b.allow("s")
    b.success("s")
    assert not b.is_open("s") and b.allow("s") and b.allow("s") and b.stats.recoveries == 1


def test_breaker_backoff_is_capped_and_a_lost_probe_is_retried() -> None:
    clock = Clock()
    b = ShardBreaker(base_s=1.0, max_s=4.0, clock=clock)
    assert [b.backoff_s(n) for n in (1, 2, 3, 4, 10)] == [1.0, 2.0, 4.0, 4.0, 4.0]
    b.failure("s")
    clock.t += 1.0
    assert b.allow("s")  # a probe that never reports back ...
    clock.t += 1.0
    assert b.allow("s")  # ... is given up after base_s
    assert b.allow("other")  # shards are independent
    with pytest.raises(ValueError):
        ShardBreaker(base_s=0.0)


def test_call_with_deadline_returns_raises_or_times_out() -> None:
    assert call_with_deadline(lambda: 42, 1.0, "ok") == 42
    with pytest.raises(KeyError):
        call_with_deadline(lambda: {}["x"], 1.0, "raises")
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(ShardUnavailableError, match="no answer within"):
        call_with_deadline(gate.wait, 0.1, "frozen GCS")
    assert time.monotonic() - t0 < 2.0
    gate.set()


def test_loader_batches_what_queued_meanwhile_and_survives_a_failing_batch() -> None:
    gate = threading.Event()
    batches: list[list[int]] = []

    def run(batch: list[int]) -> None:
        gate.wait(5.0)
        batches.append(list(batch))
        if 99 in batch:
            raise RuntimeError("a bug in one batch")

    loader = BlockLoader(run, name="test-loader")
    loader.submit([1])
    time.sleep(0.05)  # the thread holds [1] at the gate
    loader.submit([2, 3])
    loader.submit([4])
    assert not loader.wait_idle(0.05)
    gate.set()
    assert loader.wait_idle(5.0)
    assert batches == [[1], [2, 3, 4]]  # the specs queued while one batch ran go in one batch
    loader.submit([99])
    assert loader.wait_idle(5.0)
    loader.submit([5])
    assert loader.wait_idle(5.0) and batches[-1] == [5]  # the thread lives on
    loader.close(5.0)
