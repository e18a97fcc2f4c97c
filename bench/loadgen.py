"""Live load-generation mechanism shared by ``kvstack bench agent`` and ``kvstack bench trace``.

What lives here: one streamed OpenAI request measured (TTFT, TPOT, end-to-end, tokens, error), the run's budget
(at most N requests, at most T seconds; every wait has a deadline), the progress bar, and the JSON summary of a
list of measured requests. What does not: what to send and when (``bench.agent``, ``bench.trace_cli``).

Works against any OpenAI-compatible endpoint through the ``openai`` async SDK (imported by the caller and passed
in as a client, so importing this module stays cheap).

Measurement: TTFT = first streamed chunk that carries output (text, or a tool-call delta) minus send time;
TPOT = (last output chunk − first output chunk) / (output tokens − 1), output tokens from the stream's ``usage``
when the endpoint sends it, else the number of output chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.stats import summarize


@dataclass(slots=True)
class RequestRecord:
    """One request as measured by the client. Times are seconds; ``sent_at_s`` is relative to the run start."""

    request_id: str
    sent_at_s: float
    session: int | None = None
    turn: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    cancelled: bool = False
    response_id: str | None = None  # the server's id of the completion (the router's decision record has it too)
    text: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.ttft_s is not None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        return d


class Budget:
    """At most ``max_requests`` requests and ``duration_s`` seconds from ``start()``; both optional, not both."""

    def __init__(self, *, max_requests: int | None, duration_s: float | None, clock: Callable[[], float] = time.monotonic):
        if max_requests is None and duration_s is None:
            raise ValueError("a run needs a bound: give max_requests, duration_s, or both")
        if max_requests is not None and max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests}")
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {duration_s}")
        self.max_requests = max_requests
        self.duration_s = duration_s
        self._clock = clock
        self._t0 = clock()
        self.taken = 0

    def start(self) -> None:
        self._t0 = self._clock()
        self.taken = 0

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def remaining_s(self) -> float:
        return float("inf") if self.duration_s is None else max(0.0, self.duration_s - self.elapsed())

    def expired(self) -> bool:
        return self.remaining_s() <= 0.0 or (self.max_requests is not None and self.taken >= self.max_requests)

    def take(self) -> bool:
        """Claim one request slot; False once the count or the time is used up."""
        if self.remaining_s() <= 0.0:
            return False
        if self.max_requests is not None and self.taken >= self.max_requests:
            return False
        self.taken += 1
        return True


def _chunk_output(chunk: Any) -> tuple[str, bool]:
    """(text, carries output) of one streamed chunk of either the chat or the completions API."""
    choices = getattr(chunk, "choices", None) or []
    text = ""
    produced = False
    for choice in choices:
        delta = getattr(choice, "delta", None)
        if delta is not None:  # chat
            content = getattr(delta, "content", None)
            if content:
                text += content
                produced = True
            if getattr(delta, "tool_calls", None):
                produced = True
            if getattr(delta, "reasoning_content", None):
                produced = True
        else:  # completions
            t = getattr(choice, "text", None)
            if t:
                text += t
                produced = True
    return text, produced


async def measure_stream(record: RequestRecord, open_stream: Callable[[], Any], clock: Callable[[], float]) -> RequestRecord:
    """Send one streamed request (``open_stream`` returns the SDK's awaitable stream) and fill ``record``."""
    t0 = clock()
    first = last = None
    chunks = 0
    parts: list[str] = []
    usage_out: int | None = None
    try:
        stream: AsyncIterator[Any] = await open_stream()
        async for chunk in stream:
            if record.response_id is None:
                record.response_id = getattr(chunk, "id", None)
            text, produced = _chunk_output(chunk)
            if produced:
                now = clock()
                if first is None:
                    first = now
                last = now
                chunks += 1
                parts.append(text)
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                usage_out = getattr(usage, "completion_tokens", None)
                record.prompt_tokens = getattr(usage, "prompt_tokens", None)
    except asyncio.CancelledError:
        record.cancelled = True
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of one request is data, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        end = clock()
        record.e2e_s = end - t0
        record.text = "".join(parts)
        record.output_tokens = usage_out if usage_out is not None else chunks
        if first is not None:
            record.ttft_s = first - t0
            if last is not None and record.output_tokens > 1:
                record.tpot_s = (last - first) / (record.output_tokens - 1)
        elif record.error is None and not record.cancelled:
            record.error = "EmptyResponse: the stream ended without output"
    return record


def _turn_row(turn: int, samples: list[float]) -> dict[str, Any]:
    s = summarize(samples)
    return {"turn": turn, "n": s["n"], "ttft_p50_s": s["p50"], "ttft_p90_s": s["p90"], "ttft_p99_s": s["p99"]}


def summarize_records(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The JSON block every live bench writes: counts, TTFT/TPOT/e2e percentiles, throughput, errors, per turn."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if r.error is not None]
    by_type: dict[str, int] = defaultdict(int)
    for r in errors:
        by_type[(r.error or "").split(":", 1)[0]] += 1
    per_turn: dict[int, list[float]] = defaultdict(list)
    for r in ok:
        if r.turn is not None and r.ttft_s is not None:
            per_turn[r.turn].append(r.ttft_s)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    wall = max(wall_s, 1e-9)
    return {
        "requests": {
            "sent": len(records),
            "ok": len(ok),
            "errors": len(errors),
            "cancelled": sum(r.cancelled for r in records),
        },
        "errors": {"by_type": dict(by_type), "samples": [r.error for r in errors[:5]]},
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "throughput": {
            "requests_per_s": len(ok) / wall,
            "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens_per_s": in_tokens / wall,
        },
        "per_turn": [_turn_row(turn, samples) for turn, samples in sorted(per_turn.items())],
    }


class Progress:
    """A live progress bar (rich) over the request budget; a no-op when disabled."""

    def __init__(self, *, enabled: bool, total: int | None, description: str) -> None:
        self._bar: Any = None
        self._task: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("ok {task.fields[ok]} err {task.fields[err]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task(description, total=total, ok=0, err=0)
        self._ok = self._err = 0

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def done(self, record: RequestRecord) -> None:
        if self._bar is None:
            return
        if record.ok:
            self._ok += 1
        elif record.error is not None:
            self._err += 1
        self._bar.update(self._task, advance=1, ok=self._ok, err=self._err)
