"""deployments.stream_batching: a replica's stream re-chunked per interval, the first and last output never held.

The engine's stream is a neighbour here: an async generator of vLLM's own ``RequestOutput`` objects (delta mode) at
a chosen cadence; the merging is vLLM's ``RequestOutput.add``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from deployments.stream_batching import batched_outputs


def output(token: int, finished: bool = False) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    done = "length" if finished else None
    completion = CompletionOutput(index=0, text=f"t{token} ", token_ids=[token], cumulative_logprob=None,
                                  logprobs=None, finish_reason=done)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                         outputs=[completion], finished=finished)


class Engine:
    """``count`` delta outputs, one token each, ``step_s`` apart; optionally failing after ``fail_after``."""

    def __init__(self, count: int, step_s: float, fail_after: int | None = None) -> None:
        self.count, self.step_s, self.fail_after = count, step_s, fail_after
        self.closed = False
        self.started_at = 0.0
        self.finished_at = 0.0  # when the finished output was given

    async def stream(self) -> Any:
        try:
            for i in range(self.count):
                if i:
                    await asyncio.sleep(self.step_s)
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("engine failed")
                if i == self.count - 1:
                    self.finished_at = time.monotonic()
                yield output(i, finished=i == self.count - 1)
        finally:
            self.closed = True


async def chunks(engine: Engine, interval_s: float | None) -> list[tuple[float, list[int], str, bool]]:
    """(when it came, token ids, text, finished) per chunk the wrapper sent; ``engine.started_at`` is set."""
    got = []
    engine.started_at = time.monotonic()
    async for out in batched_outputs(engine.stream(), interval_s):
        got.append((time.monotonic(), list(out.outputs[0].token_ids), out.outputs[0].text, out.finished))
    return got


def test_interval_zero_passes_every_output_as_it_comes() -> None:
    got = asyncio.run(chunks(Engine(5, 0.001), 0.0))
    assert [c[1] for c in got] == [[0], [1], [2], [3], [4]]
    assert [c[3] for c in got] == [False, False, False, False, True]


def test_first_token_at_once_then_merged_per_interval_and_the_last_not_held() -> None:
    """40 tokens 5 ms apart with a 50 ms interval: the first alone and at once, the rest in a few merged chunks in
    order (text too), and the finished chunk sent when the engine finished, not an interval later."""
    engine = Engine(40, 0.005)
    got = asyncio.run(chunks(engine, 0.05))
    assert got[0][1] == [0] and got[0][0] - engine.started_at < 0.05
    assert [t for c in got for t in c[1]] == list(range(40))
    assert "".join(c[2] for c in got) == "".join(f"t{i} " for i in range(40))
    assert 3 <= len(got) <= 8, [len(c[1]) for c in got]
    assert [c[3] for c in got][-1] is True and not any(c[3] for c in got[:-1])
    assert got[-1][0] - engine.finished_at < 0.04  # not held for an interval after the finish
    gaps = [b[0] - a[0] for a, b in zip(got[1:-1], got[2:-1], strict=False)]
    assert all(g >= 0.04 for g in gaps), gaps  # between first and last: at most one chunk per interval


def test_final_only_sends_the_first_token_and_then_everything_at_the_end() -> None:
    got = asyncio.run(chunks(Engine(10, 0.002), None))
    assert [c[1] for c in got] == [[0], list(range(1, 10))]
    assert got[-1][3] is True


def test_a_slow_engine_is_not_slowed_further() -> None:
    """Tokens slower than the interval each go out as they come (no chunk waits for a second token)."""
    got = asyncio.run(chunks(Engine(5, 0.03), 0.01))
    assert [c[1] for c in got] == [[0], [1], [2], [3], [4]]


def test_an_engine_error_ends_the_stream_after_what_was_read() -> None:
    async def run() -> list[int]:
        seen = []
        with pytest.raises(RuntimeError, match="engine failed"):
            async for out in batched_outputs(Engine(10, 0.001, fail_after=4).stream(), 0.02):
                seen.extend(out.outputs[0].token_ids)
        return seen

    assert asyncio.run(run()) == [0, 1, 2, 3]


def test_closing_the_wrapper_stops_the_engines_stream() -> None:
    """A client that goes away closes the replica's generator: the engine's stream is cancelled (vLLM aborts the
    request on that), not left running to the end."""
    engine = Engine(1000, 0.002)

    async def run() -> None:
        gen = batched_outputs(engine.stream(), 0.01)
        first = await gen.__anext__()
        assert list(first.outputs[0].token_ids) == [0]
        await gen.aclose()
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert engine.closed


def test_cancelling_the_consumer_stops_the_engines_stream() -> None:
    engine = Engine(1000, 0.002)

    async def consume() -> None:
        async for _ in batched_outputs(engine.stream(), 0.01):
            pass

    async def run() -> None:
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert engine.closed
