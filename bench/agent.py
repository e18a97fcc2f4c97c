"""Agent workloads: many multi-turn tool-using sessions, planned deterministically, run live or simulated.

A session is an agent loop: a system prompt (one of a few variants shared across sessions) with tool definitions,
then turns; each turn sends the whole previous context plus a new tool result or user message, and waits a think
time before the next. Sessions arrive as a Poisson process.

Who calls what:
- ``bench.agent_cli`` (``kvstack bench agent``) calls ``run_sessions`` against any OpenAI-compatible endpoint.
- ``bench.simulate_cli`` / ``bench.compare_cli`` call ``workload_trace`` to turn the same workload into
  Mooncake-format ``TraceRecord``s (hash ids per 512-token block, shared system-prompt blocks get shared ids), so
  the simulator and the live run see the same sharing structure.

Plans depend only on the ``AgentWorkload`` (seeded): session ``k`` has the same variant, turns and texts in every
run, whatever the endpoint's speed. Lengths are in words; one word is roughly one token.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from bench.loadgen import Budget, Progress, RequestRecord, measure_stream
from bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRecord

TurnKind = Literal["user", "tool"]
ToolsMode = Literal["tools", "user"]

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "de", "fa", "go", "hu", "ji", "pe", "zo", "bi")


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """Knobs of the agent workload (defaults: a small coding-agent-like mix)."""

    session_rate_per_s: float = 0.5
    system_prompt_variants: int = 3
    system_prompt_words: int = 1024
    tool_count: int = 4
    tool_description_words: int = 48
    turns_min: int = 2
    turns_max: int = 6
    user_words: int = 64
    tool_result_words: int = 256
    tool_result_fraction: float = 0.6
    think_time_mean_s: float = 1.0
    max_output_tokens: int = 64
    seed: int = 0
    max_sessions: int = 0  # start at most this many sessions (0: as many as arrive within the run's budget)

    def __post_init__(self) -> None:
        checks = [
            (self.session_rate_per_s > 0, "session_rate_per_s must be > 0"),
            (self.system_prompt_variants >= 1, "system_prompt_variants must be >= 1"),
            (self.system_prompt_words >= 1, "system_prompt_words must be >= 1"),
            (self.tool_count >= 0, "tool_count must be >= 0"),
            (1 <= self.turns_min <= self.turns_max, "need 1 <= turns_min <= turns_max"),
            (self.user_words >= 1 and self.tool_result_words >= 1, "message lengths must be >= 1 word"),
            (0.0 <= self.tool_result_fraction <= 1.0, "tool_result_fraction must be in [0, 1]"),
            (self.think_time_mean_s >= 0, "think_time_mean_s must be >= 0"),
            (self.max_output_tokens >= 1, "max_output_tokens must be >= 1"),
            (self.max_sessions >= 0, "max_sessions must be >= 0 (0: unbounded)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def system_tokens(self) -> int:
        """Approximate tokens of the shared prefix: system prompt plus tool definitions."""
        return self.system_prompt_words + self.tool_count * self.tool_description_words


@dataclass(frozen=True, slots=True)
class TurnPlan:
    kind: TurnKind
    words: int
    think_s: float


@dataclass(frozen=True, slots=True)
class SessionPlan:
    session_id: int
    arrival_s: float
    variant: int
    turns: tuple[TurnPlan, ...]


def _words(seed: tuple[int, ...], n: int) -> str:
    rng = np.random.default_rng(list(seed))
    idx = rng.integers(0, len(_SYLLABLES), size=(n, 2))
    return " ".join(_SYLLABLES[a] + _SYLLABLES[b] for a, b in idx.tolist())


def system_prompt(w: AgentWorkload, variant: int) -> str:
    return f"You are agent variant {variant}. " + _words((w.seed, 1, variant), w.system_prompt_words)


def tool_definitions(w: AgentWorkload) -> list[dict[str, Any]]:
    """OpenAI function tools, identical for every session (part of the shared prefix)."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": _words((w.seed, 2, i), w.tool_description_words),
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": "what to look up"}},
                    "required": ["query"],
                },
            },
        }
        for i in range(w.tool_count)
    ]


def turn_text(w: AgentWorkload, session_id: int, turn: int, words: int) -> str:
    return _words((w.seed, 3, session_id, turn), words)


def session_plan(w: AgentWorkload, session_id: int, arrival_s: float) -> SessionPlan:
    """Session ``session_id``'s variant and turns: a function of the workload seed and the id only."""
    rng = np.random.default_rng([w.seed, 4, session_id])
    variant = int(rng.integers(0, w.system_prompt_variants))
    n_turns = int(rng.integers(w.turns_min, w.turns_max + 1))
    turns = []
    for t in range(n_turns):
        kind: TurnKind = "user" if t == 0 or rng.random() >= w.tool_result_fraction else "tool"
        words = w.user_words if kind == "user" else w.tool_result_words
        think = float(rng.exponential(w.think_time_mean_s)) if w.think_time_mean_s > 0 else 0.0
        turns.append(TurnPlan(kind, words, think))
    return SessionPlan(session_id, arrival_s, variant, tuple(turns))


def arrivals(w: AgentWorkload) -> Iterator[float]:
    """Poisson session arrival times (seconds from the start), an endless seeded stream."""
    rng = np.random.default_rng([w.seed, 5])
    t = 0.0
    while True:
        yield t
        t += float(rng.exponential(1.0 / w.session_rate_per_s))


def plan_sessions(w: AgentWorkload, *, horizon_s: float | None = None, max_sessions: int | None = None) -> list[SessionPlan]:
    """Sessions arriving before ``horizon_s`` (and at most ``max_sessions``, and the workload's own
    ``max_sessions`` when set)."""
    if w.max_sessions:
        max_sessions = w.max_sessions if max_sessions is None else min(max_sessions, w.max_sessions)
    if horizon_s is None and max_sessions is None:
        raise ValueError("plan_sessions needs horizon_s or max_sessions")
    out: list[SessionPlan] = []
    for sid, t in enumerate(arrivals(w)):
        if (horizon_s is not None and t > horizon_s) or (max_sessions is not None and sid >= max_sessions):
            break
        out.append(session_plan(w, sid, t))
    return out


# ---------------------------------------------------------------------------------------------- simulated form
def workload_trace(
    w: AgentWorkload,
    sessions: list[SessionPlan],
    *,
    response_time_s: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRecord]:
    """The sessions as a Mooncake-format trace (one record per turn), for the simulator.

    Turn ``t`` of a session arrives ``sum(response_time_s + think)`` after the session's start; its prompt is the
    shared prefix (system prompt + tools of the variant), then every earlier turn's message and the assistant's
    ``max_output_tokens``, then this turn's message. A block entirely inside the shared prefix gets an id shared by
    every session of the variant; any other block gets a session-private id (the id also encodes the block's
    length, so a partial block never aliases the full block that later replaces it).
    """
    ids: dict[tuple[Any, ...], int] = {}

    def intern(key: tuple[Any, ...]) -> int:
        got = ids.get(key)
        if got is None:
            got = ids[key] = len(ids)
        return got

    shared = w.system_tokens
    rows: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    for s in sessions:
        t = s.arrival_s
        context = shared
        for turn_idx, turn in enumerate(s.turns):
            length = context + turn.words
            hash_ids = []
            for b in range(math.ceil(length / block_tokens)):
                end = min((b + 1) * block_tokens, length)
                size = end - b * block_tokens
                key = ("sys", s.variant, b, size) if end <= shared else ("sess", s.session_id, b, size)
                hash_ids.append(intern(key))
            rows.append((t * 1000.0, s.session_id, turn_idx, length, tuple(hash_ids)))
            context = length + w.max_output_tokens
            t += response_time_s + turn.think_s
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return [
        TraceRecord(i, ts, length, w.max_output_tokens, hids, block_tokens)
        for i, (ts, _sid, _turn, length, hids) in enumerate(rows)
    ]


# -------------------------------------------------------------------------------------------------- live form
@dataclass(frozen=True, slots=True)
class LiveOptions:
    model: str
    tools_mode: ToolsMode = "tools"
    tool_choice: str | None = None  # None: not sent (what agent frameworks do; vLLM's default is "auto")
    request_timeout_s: float = 120.0
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = None
    # At most this many sessions in flight (0: no bound, Poisson arrivals only). 1 is the sequential variant: a
    # session starts at its arrival time or when the one before it ended, whichever is later.
    max_concurrent_sessions: int = 0


def _tool_call_message(session_id: int, turn: int, tool_count: int, content: str) -> dict[str, Any]:
    call = {
        "id": f"call_{session_id}_{turn}",
        "type": "function",
        "function": {"name": f"tool_{turn % max(tool_count, 1)}", "arguments": json.dumps({"query": f"q{turn}"})},
    }
    return {"role": "assistant", "content": content, "tool_calls": [call]}


async def run_session(
    client: Any,
    w: AgentWorkload,
    plan: SessionPlan,
    opts: LiveOptions,
    budget: Budget,
    clock: Callable[[], float],
    t_start: float,
    on_done: Callable[[RequestRecord], None],
) -> list[RequestRecord]:
    """Run one session's turns while the budget allows; returns its measured requests."""
    use_tools = opts.tools_mode == "tools" and w.tool_count > 0
    tools = tool_definitions(w) if use_tools else None
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(w, plan.variant)}]
    if not use_tools and w.tool_count > 0:
        messages[0]["content"] += "\nTools:\n" + json.dumps(tool_definitions(w))
    out: list[RequestRecord] = []
    for t, turn in enumerate(plan.turns):
        text = turn_text(w, plan.session_id, t, turn.words)
        if turn.kind == "tool" and use_tools and t > 0:
            messages.append({"role": "tool", "tool_call_id": f"call_{plan.session_id}_{t - 1}", "content": text})
        elif turn.kind == "tool":
            messages.append({"role": "user", "content": "Tool result:\n" + text})
        else:
            messages.append({"role": "user", "content": text})
        if not budget.take():
            break
        record = RequestRecord(f"s{plan.session_id}-t{t}", clock() - t_start, session=plan.session_id, turn=t)
        kwargs: dict[str, Any] = {
            "model": opts.model,
            "messages": list(messages),
            "max_tokens": w.max_output_tokens,
            "temperature": opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "timeout": opts.request_timeout_s,  # the run's deadline cancels (run_sessions), never fails, a request
        }
        if tools is not None:
            kwargs["tools"] = tools
            if opts.tool_choice is not None:
                kwargs["tool_choice"] = opts.tool_choice
        if opts.extra_body:
            kwargs["extra_body"] = opts.extra_body
        try:
            await measure_stream(record, lambda: client.chat.completions.create(**kwargs), clock)
        finally:
            out.append(record)
            on_done(record)
        if not record.ok:
            break  # an agent whose model call failed stops its loop
        next_kind = plan.turns[t + 1].kind if t + 1 < len(plan.turns) else "user"
        if next_kind == "tool" and use_tools:
            messages.append(_tool_call_message(plan.session_id, t, w.tool_count, record.text))
        else:
            messages.append({"role": "assistant", "content": record.text})
        pause = min(turn.think_s, budget.remaining_s())
        if pause > 0:
            await asyncio.sleep(pause)
    return out


async def run_sessions(
    client: Any,
    w: AgentWorkload,
    opts: LiveOptions,
    budget: Budget,
    *,
    progress: Progress,
    clock: Callable[[], float],
) -> tuple[list[RequestRecord], dict[str, int]]:
    """Start sessions at their Poisson arrival times until the budget is spent (no more than
    ``opts.max_concurrent_sessions`` at once when it is set: a session waits for a free slot); cancel what runs at
    the deadline.

    Returns every request made and ``{"started": sessions started, "completed": sessions that ran all turns}``.
    """
    budget.start()
    t_start = clock()
    tasks: list[asyncio.Task[list[RequestRecord]]] = []
    plans: list[SessionPlan] = []
    slots = asyncio.Semaphore(opts.max_concurrent_sessions) if opts.max_concurrent_sessions > 0 else None

    async def session(plan: SessionPlan, done: Callable[[RequestRecord], None]) -> list[RequestRecord]:
        try:
            return await run_session(client, w, plan, opts, budget, clock, t_start, done)
        finally:
            if slots is not None:
                slots.release()

    async def spawn(done: Callable[[RequestRecord], None]) -> None:
        for sid, arrival in enumerate(arrivals(w)):
            if w.max_sessions and sid >= w.max_sessions:
                return
            delay = arrival - (clock() - t_start)
            if delay > budget.remaining_s() or budget.expired():
                return
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()  # bounded: the spawner itself runs under the budget's deadline
            if budget.expired():
                if slots is not None:
                    slots.release()
                return
            plan = session_plan(w, sid, arrival)
            plans.append(plan)
            tasks.append(asyncio.create_task(session(plan, done)))

    records: list[RequestRecord] = []

    def done(record: RequestRecord) -> None:
        records.append(record)
        progress.done(record)

    spawner = asyncio.create_task(spawn(done))
    deadline = budget.remaining_s()
    try:
        await asyncio.wait_for(spawner, timeout=None if math.isinf(deadline) else deadline)
    except TimeoutError:
        pass
    pending = [t for t in tasks if not t.done()]
    if pending:
        remaining = budget.remaining_s()
        _done, still = await asyncio.wait(pending, timeout=None if math.isinf(remaining) else remaining)
        for task in still:
            task.cancel()
        if still:
            await asyncio.wait(still, timeout=5.0)
    completed = 0
    for plan, task in zip(plans, tasks, strict=True):
        if task.done() and not task.cancelled() and task.exception() is None:
            got = task.result()
            completed += len(got) == len(plan.turns) and all(r.ok for r in got)
    records.sort(key=lambda r: r.sent_at_s)
    return records, {"started": len(plans), "completed": completed}
