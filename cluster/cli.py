"""The ``kvstack`` command line: a thin dispatcher over command modules.

Each command lives in its own module exposing ``configure(parser: argparse.ArgumentParser) -> None`` and
``run(args: argparse.Namespace) -> int``. Modules keep heavy imports (ray, vllm, torch, matplotlib) inside
``run`` so that ``kvstack --help`` and ``kvstack plan`` start fast. Add a command by adding a row to ``COMMANDS``
(or ``BENCH_COMMANDS`` for ``kvstack bench <name>``). A row whose module does not exist yet is skipped.

Exit codes: 0 ok, 1 runtime failure, 2 bad usage / unknown names (argparse convention).

Output: a command run with ``--json`` prints exactly one JSON document on stdout (``cluster.cli_output``): while
it runs, everything else the process and its children write to stdout (vLLM's and Ray's logs, prints) goes to
stderr, and the command writes its document with ``cli_output.print_document``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

# (command, module, help)
COMMANDS: list[tuple[str, str, str]] = [
    ("plan", "cluster.commands.plan", "fetch-vs-recompute planner: break-even, capacity, report"),
    ("models", "cluster.commands.models", "generate tiny local models (no hub access)"),
    ("serve", "cluster.commands.serve", "start the local multi-node cluster and the OpenAI endpoint"),
    ("serve-config", "cluster.commands.serve_config_cmd", "the Ray Serve config file (serve run / serve deploy)"),
    ("status", "cluster.commands.status", "show nodes, replicas, shards and recent decisions"),
    ("simulate", "bench.simulate_cli", "discrete-event cluster simulation running the real policies"),
]
BENCH_COMMANDS: list[tuple[str, str, str]] = [
    ("transfer", "bench.transfer_bench", "KV pool transfer throughput (NIXL, TCP, SSD) vs machine limits"),
    ("reuse", "bench.reuse_bench", "TTFT: recompute vs HBM hit vs fetch from DRAM / SSD"),
    ("frozen-shard", "bench.frozen_shard", "engine step time and outputs with one pool shard frozen (SIGSTOP)"),
    ("soak", "bench.soak", "agent sessions with tools for minutes: errors, wrong outputs, RSS, leases, step time"),
    ("oracle", "bench.oracle", "kvstack's greedy outputs against plain vLLM's (same engine, same placement)"),
    ("router", "bench.router_bench", "decision latency of the cost_based policy"),
    ("burst", "bench.burst_spread", "bursts of fresh prompts through several routers: their spread over replicas"),
    ("agent", "bench.agent_cli", "agent-session load generator against an OpenAI endpoint"),
    ("trace", "bench.trace_cli", "replay a Mooncake trace against an OpenAI endpoint"),
    ("compare", "bench.compare_cli", "policies side by side (simulator and live)"),
    ("live-compare", "bench.live_compare", "one kvstack serve per policy + bench agent, markdown report"),
    ("sim-live", "bench.sim_live", "simulate a live-compare run's configurations on what it saw; sim vs live"),
    ("vllm-compare", "bench.vllm_bench_compare", "vllm bench serve against each configuration, markdown report"),
]
# (command path, flag) -> the command path it stands for: ``kvstack bench compare --live ...`` is
# ``kvstack bench live-compare ...`` (the flag dropped, every other argument that command's).
FLAG_ALIASES: dict[tuple[tuple[str, ...], str], tuple[str, ...]] = {
    (("bench", "compare"), "--live"): ("bench", "live-compare"),
}


def resolve_aliases(argv: list[str]) -> list[str]:
    """``argv`` with a flag alias (``FLAG_ALIASES``) replaced by the command it names."""
    for (path, flag), target in FLAG_ALIASES.items():
        if tuple(argv[: len(path)]) == path and flag in argv[len(path):]:
            rest = argv[len(path):]
            rest.remove(flag)
            return [*target, *rest]
    return argv


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None  # command not built yet
        raise


def _add(subparsers: argparse._SubParsersAction, rows: list[tuple[str, str, str]]) -> None:
    for name, module_name, help_text in rows:
        module = _load(module_name)
        if module is None:
            continue
        parser = subparsers.add_parser(name, help=help_text, description=help_text)
        module.configure(parser)
        parser.set_defaults(_run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstack", description="KV-cache-aware LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add(sub, COMMANDS)
    bench = sub.add_parser("bench", help="benchmarks (JSON results)", description="benchmarks (JSON results)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    _add(bench_sub, BENCH_COMMANDS)
    bench.set_defaults(_run=lambda _args: (bench.print_help(), 2)[1])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(resolve_aliases(list(sys.argv[1:] if argv is None else argv)))
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    if getattr(args, "json", False):
        from cluster.cli_output import redirect_output

        with redirect_output(stdout_to=2):
            return int(run(args) or 0)
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
