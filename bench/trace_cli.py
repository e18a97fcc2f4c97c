"""``kvstack bench trace --trace FILE --endpoint URL``: replay a Mooncake trace against an OpenAI-compatible endpoint.

Each record is sent at its (scaled) timestamp as one streamed request; its prompt comes from
``bench.traces.TokenMapper`` so equal hash ids give equal token blocks and the trace's prefix sharing reaches the
engine. Prompt modes: ``tokens`` (``/v1/completions`` with a token-id prompt: exact blocks, the default), ``text``
(``/v1/completions`` with pseudo-word text) and ``chat`` (``/v1/chat/completions``, the text as the user message).
``--time-scale`` stretches arrivals, ``--length-scale`` shrinks prompts/outputs (blocks per request unchanged) so a
CPU cluster can replay a GPU trace. Bounded by ``--max-requests`` and ``--duration-s``; requests still running at
the deadline are cancelled. Writes ``result.json`` (schema ``kvstack.bench.trace/v1``) and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path
from typing import Any

from bench.live import (
    add_budget_args,
    add_endpoint_args,
    add_output_args,
    build_result,
    make_client,
    parse_extra_body,
    resolve_model,
    run_with_metrics,
    write_outputs,
)
from bench.loadgen import Budget, Progress, RequestRecord, measure_stream
from bench.traces import TokenMapper, TraceRecord, load_trace, prefix_reuse_bound, scale_trace


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    add_endpoint_args(parser)
    g = parser.add_argument_group("replay")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (>1 = slower)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt/output lengths (<1 = shorter)")
    g.add_argument("--prompt-mode", choices=["tokens", "text", "chat"], default="tokens")
    g.add_argument("--vocab-size", type=int, default=4096, help="token ids are drawn from [16, vocab-size)")
    g.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output length")
    g.add_argument("--seed", type=int, default=0, help="seed of the hash-id -> token mapping")
    g.add_argument("--skip-to", type=int, default=0, help="start at this record (and re-base its time to 0)")
    add_budget_args(parser, default_requests=100, default_duration=300.0)
    add_output_args(parser)


def prepare(args: argparse.Namespace) -> list[TraceRecord]:
    limit = None if args.max_requests is None else args.skip_to + args.max_requests
    records = load_trace(args.trace, max_requests=limit)[args.skip_to :]
    if not records:
        raise ValueError(f"{args.trace}: no records to replay (skip-to {args.skip_to})")
    t0 = records[0].timestamp_ms
    records = [
        TraceRecord(r.index, r.timestamp_ms - t0, r.input_length, r.output_length, r.hash_ids, r.block_tokens)
        for r in records
    ]
    return scale_trace(records, time_scale=args.time_scale, length_scale=args.length_scale)


async def _one(
    client: Any, model: str, rec: TraceRecord, args: argparse.Namespace, mapper: TokenMapper,
    extra_body: dict[str, Any] | None, budget: Budget, t_start: float,
) -> RequestRecord:
    record = RequestRecord(f"trace-{rec.index}", time.monotonic() - t_start, session=None, turn=None)
    max_tokens = max(1, rec.output_length)
    if args.max_output_tokens is not None:
        max_tokens = min(max_tokens, args.max_output_tokens)
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timeout": args.request_timeout_s,  # the run's deadline cancels (replay), never fails, a request
    }
    if extra_body:
        common["extra_body"] = extra_body
    if args.prompt_mode == "chat":
        msgs = [{"role": "user", "content": mapper.prompt_text(rec)}]
        await measure_stream(record, lambda: client.chat.completions.create(messages=msgs, **common), time.monotonic)
    else:
        prompt: Any = mapper.prompt_tokens(rec) if args.prompt_mode == "tokens" else mapper.prompt_text(rec)
        await measure_stream(record, lambda: client.completions.create(prompt=prompt, **common), time.monotonic)
    return record


async def replay(client: Any, model: str, records: list[TraceRecord], args: argparse.Namespace, budget: Budget,
                 progress: Progress) -> list[RequestRecord]:
    """Send every record at its scaled time while the budget lasts; cancel what still runs at the deadline."""
    mapper = TokenMapper(vocab_size=args.vocab_size, seed=args.seed)
    extra_body = parse_extra_body(args.extra_body)
    done: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord]] = []
    budget.start()
    t_start = time.monotonic()

    async def guarded(rec: TraceRecord) -> RequestRecord:
        try:
            r = await _one(client, model, rec, args, mapper, extra_body, budget, t_start)
        except asyncio.CancelledError:
            r = RequestRecord(f"trace-{rec.index}", rec.timestamp_s, cancelled=True)
            done.append(r)
            progress.done(r)
            raise
        done.append(r)
        progress.done(r)
        return r

    for rec in records:
        delay = rec.timestamp_s - (time.monotonic() - t_start)
        if delay >= budget.remaining_s():
            break
        if delay > 0:
            await asyncio.sleep(delay)
        if not budget.take():
            break
        tasks.append(asyncio.create_task(guarded(rec)))
    if tasks:
        remaining = budget.remaining_s()
        _ok, still = await asyncio.wait(tasks, timeout=None if math.isinf(remaining) else remaining)
        for t in still:
            t.cancel()
        if still:
            await asyncio.wait(still, timeout=5.0)
    done.sort(key=lambda r: r.sent_at_s)
    return done


async def run_trace_bench(args: argparse.Namespace) -> dict[str, Any]:
    records = prepare(args)
    client = make_client(args)
    try:
        model = await resolve_model(client, args.model)
        budget = Budget(max_requests=args.max_requests, duration_s=args.duration_s)
        label = args.label or args.endpoint
        total = len(records) if args.max_requests is None else min(len(records), args.max_requests)
        with Progress(enabled=not args.no_progress, total=total, description=f"trace {label}") as bar:

            async def body() -> tuple[list[RequestRecord], dict[str, Any]]:
                return await replay(client, model, records, args, budget, bar), {}

            run = await run_with_metrics(args.endpoint, body)
    finally:
        await client.close()
    config = {
        "trace": str(args.trace),
        "time_scale": args.time_scale,
        "length_scale": args.length_scale,
        "prompt_mode": args.prompt_mode,
        "records_available": len(records),
        "trace_reuse_bound": prefix_reuse_bound(records),
        "max_requests": args.max_requests,
        "duration_s": args.duration_s,
    }
    result = build_result("trace", label, args.endpoint, model, config, run, save_requests=args.save_requests)
    write_outputs(result, run.records, args.out, print_json=args.json)
    return result


def run(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_trace_bench(args))
    except ValueError as exc:
        import sys

        print(f"kvstack bench trace: {exc}", file=sys.stderr)
        return 2
    return 0 if result["requests"]["ok"] > 0 else 1
