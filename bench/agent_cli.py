"""``kvstack bench agent``: drive an OpenAI-compatible endpoint with concurrent multi-turn agent sessions.

Sessions arrive as a Poisson process; each runs ``bench.agent.run_session`` (shared system-prompt variants, tool
definitions, tool results / user messages, think times). The run is bounded by ``--max-requests`` and
``--duration-s``. Writes ``result.json`` (schema ``kvstack.bench.agent/v1``: TTFT/TPOT/e2e p50/p90/p99,
throughput, errors, per-turn TTFT, sessions, and the endpoint's router counters from ``/metrics`` when it has
them) and PNG plots into ``--out``. Exit code 0 when at least one request succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict
from typing import Any

from bench.agent import AgentWorkload, LiveOptions, run_sessions
from bench.live import (
    LiveRun,
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
from bench.loadgen import Budget, Progress, RequestRecord


def add_workload_args(p: argparse.ArgumentParser) -> None:
    d = AgentWorkload()
    g = p.add_argument_group("agent workload")
    g.add_argument("--sessions-per-s", type=float, default=d.session_rate_per_s, help="Poisson session arrival rate")
    g.add_argument("--system-prompt-variants", type=int, default=d.system_prompt_variants)
    g.add_argument("--system-prompt-words", type=int, default=d.system_prompt_words)
    g.add_argument("--tools", type=int, default=d.tool_count, help="tool definitions per request")
    g.add_argument("--tool-description-words", type=int, default=d.tool_description_words)
    g.add_argument("--turns-min", type=int, default=d.turns_min)
    g.add_argument("--turns-max", type=int, default=d.turns_max)
    g.add_argument("--user-words", type=int, default=d.user_words)
    g.add_argument("--tool-result-words", type=int, default=d.tool_result_words)
    g.add_argument("--tool-result-fraction", type=float, default=d.tool_result_fraction)
    g.add_argument("--think-time-s", type=float, default=d.think_time_mean_s, help="mean (exponential)")
    g.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--max-sessions", type=int, default=d.max_sessions,
                   help="start at most this many sessions (default 0: as many as arrive within the budget)")


def workload_from_args(args: argparse.Namespace) -> AgentWorkload:
    return AgentWorkload(
        session_rate_per_s=args.sessions_per_s,
        system_prompt_variants=args.system_prompt_variants,
        system_prompt_words=args.system_prompt_words,
        tool_count=args.tools,
        tool_description_words=args.tool_description_words,
        turns_min=args.turns_min,
        turns_max=args.turns_max,
        user_words=args.user_words,
        tool_result_words=args.tool_result_words,
        tool_result_fraction=args.tool_result_fraction,
        think_time_mean_s=args.think_time_s,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed,
        max_sessions=args.max_sessions,
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_endpoint_args(parser)
    add_workload_args(parser)
    g = parser.add_argument_group("tools")
    g.add_argument(
        "--tools-mode",
        choices=["tools", "user"],
        default="tools",
        help="tools: send OpenAI `tools` and tool-role results; user: tools in the system prompt, results as user messages",
    )
    g.add_argument("--tool-choice", default=None,
                   help="OpenAI tool_choice sent with tools (default: none sent, as agent frameworks do, so the "
                        "server's default applies: auto with a tool parser)")
    parser.add_argument("--max-concurrent-sessions", type=int, default=0,
                        help="at most this many sessions in flight (0: no bound); 1: sessions one after another "
                             "(the sequential variant)")
    add_budget_args(parser, default_requests=200, default_duration=120.0)
    add_output_args(parser)


async def run_agent_bench(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestRecord]]:
    """The whole live run; returns the result dict and the measured requests (also used by ``bench compare``)."""
    workload = workload_from_args(args)
    client = make_client(args)
    try:
        model = await resolve_model(client, args.model)
        opts = LiveOptions(
            model=model,
            tools_mode=args.tools_mode,
            tool_choice=args.tool_choice,
            request_timeout_s=args.request_timeout_s,
            extra_body=parse_extra_body(args.extra_body),
            max_concurrent_sessions=args.max_concurrent_sessions,
        )
        budget = Budget(max_requests=args.max_requests, duration_s=args.duration_s)
        label = args.label or args.endpoint
        with Progress(enabled=not args.no_progress, total=args.max_requests, description=f"agent {label}") as bar:

            async def body() -> tuple[list[RequestRecord], dict[str, Any]]:
                records, sessions = await run_sessions(client, workload, opts, budget, progress=bar, clock=time.monotonic)
                return records, {"sessions": sessions}

            run: LiveRun = await run_with_metrics(args.endpoint, body)
    finally:
        await client.close()
    config = {
        "workload": asdict(workload),
        "tools_mode": args.tools_mode,
        "max_concurrent_sessions": args.max_concurrent_sessions,
        "max_requests": args.max_requests,
        "duration_s": args.duration_s,
    }
    result = build_result("agent", label, args.endpoint, model, config, run, save_requests=args.save_requests)
    write_outputs(result, run.records, args.out, print_json=args.json)
    return result, run.records


def run(args: argparse.Namespace) -> int:
    try:
        result, _records = asyncio.run(run_agent_bench(args))
    except ValueError as exc:
        import sys

        print(f"kvstack bench agent: {exc}", file=sys.stderr)
        return 2
    return 0 if result["requests"]["ok"] > 0 else 1
