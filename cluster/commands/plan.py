"""``kvstack plan``: the fetch-vs-recompute planner (break-even, HBM KV capacity, report).

Dispatched by ``cluster/cli.py`` (``configure(parser)`` adds the sub-commands, ``run(args)`` executes one).
Every number comes from ``router.cost`` — the same functions the live policy uses. Specs are parsed here, once,
from the shipped YAML or from ``--models-file/--gpus-file/--tiers-file``.

    kvstack plan breakeven --model M --gpu G [--gpus K] --tier T [--mfu X] [--bw-util Y] [--json]
    kvstack plan capacity  --model M --gpu G [--kv-budget-gib B] [--json]
    kvstack plan report    --out DIR [--gpu G] [--gpus K] [--mfu X] [--bw-util Y] [--models a,b] [--gpu-table a,b]

Exit codes: 0 ok; 2 unknown model/GPU/tier name (the message lists the known names), malformed spec file, or an
out-of-range input (MFU, BW util, GPU count, budget).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.cli_output import print_document
from configs import (
    ConfigError,
    GpuProfile,
    ModelSpec,
    TierSpec,
    UnknownNameError,
    load_gpus,
    load_models,
    load_tiers,
    pick,
)
from router import cost

DEFAULT_MFU = 0.4
DEFAULT_BW_UTIL = 0.7
CURVE_TOKENS = (1024, 8192, 32768, 131072, 1048576)
# The report's defaults: the design notes' models and GPU generations (when the spec files define them).
REPORT_MODELS = ("qwen3-14b", "qwen3.5-27b")
REPORT_GPUS = ("a100-sxm4-80gb", "h100-sxm5-80gb", "h200-sxm5-141gb", "b100-sxm-192gb", "b200-sxm-192gb")


class UsageError(ValueError):
    """A bad command-line value (exit 2)."""


def configure(parser: argparse.ArgumentParser) -> None:
    files = argparse.ArgumentParser(add_help=False)
    group = files.add_argument_group("spec files (default: the shipped configs/specs/*.yaml)")
    group.add_argument("--models-file", type=Path, default=None, help="model specs YAML")
    group.add_argument("--gpus-file", type=Path, default=None, help="GPU profiles YAML")
    group.add_argument("--tiers-file", type=Path, default=None, help="storage tiers YAML")

    perf = argparse.ArgumentParser(add_help=False)
    perf.add_argument("--mfu", type=float, default=DEFAULT_MFU, help=f"model FLOPs utilisation (default {DEFAULT_MFU})")
    perf.add_argument("--bw-util", type=float, default=DEFAULT_BW_UTIL,
                      help=f"fraction of the tier's bandwidth achieved (default {DEFAULT_BW_UTIL})")
    perf.add_argument("--gpus", type=int, default=1, help="GPUs per replica; multiplies the FLOPS (default 1)")

    sub = parser.add_subparsers(dest="plan_command", metavar="PLAN")
    be = sub.add_parser(
        "breakeven", parents=[files, perf], allow_abbrev=False,
        help="context length s* above which fetching KV from a tier beats recomputing it",
        description="Closed-form break-even s* (tokens) of fetch vs recompute; s* <= 0: fetch wins at every length.",
    )
    be.add_argument("--model", required=True)
    be.add_argument("--gpu", required=True)
    be.add_argument("--tier", required=True)
    be.add_argument("--json", action="store_true", help="print one JSON object")

    cap = sub.add_parser(
        "capacity", parents=[files], allow_abbrev=False,
        help="tokens of KV that fit in a GPU's HBM (or a budget)",
        description="hbm_kv_tokens = budget bytes (GiB x 2^30; all of HBM by default) / KV bytes per token.",
    )
    cap.add_argument("--model", required=True)
    cap.add_argument("--gpu", required=True)
    cap.add_argument("--kv-budget-gib", type=float, default=None,
                     help="KV budget in GiB (default: the GPU's whole HBM; model weights are not subtracted)")
    cap.add_argument("--json", action="store_true", help="print one JSON object")

    rep = sub.add_parser(
        "report", parents=[files, perf], allow_abbrev=False,
        help="the design notes' figures (PNG) and a markdown summary",
        description="Writes kv_growth, tier_breakeven, phase_diagram, storage_pyramid, gpu_sensitivity PNGs and "
                    "summary.md into --out.",
    )
    rep.add_argument("--out", type=Path, required=True, help="output directory (created)")
    rep.add_argument("--gpu", default="h100-sxm5-80gb", help="GPU of the curve, phase and pyramid figures")
    rep.add_argument("--models", default=None,
                     help=f"comma-separated models (default: {', '.join(REPORT_MODELS)} or all in the file)")
    rep.add_argument("--gpu-table", default=None,
                     help="comma-separated GPUs of the sensitivity table (default: the five reference GPUs)")


def run(args: argparse.Namespace) -> int:
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "breakeven": _breakeven,
        "capacity": _capacity,
        "report": _report,
    }
    handler = handlers.get(getattr(args, "plan_command", None) or "")
    if handler is None:
        print("kvstack plan: choose one of: breakeven, capacity, report (kvstack plan --help)", file=sys.stderr)
        return 2
    return handler(args)


def _fail(command: str, exc: Exception) -> int:
    print(f"kvstack plan {command}: error: {exc}", file=sys.stderr)
    return 2


def _check_perf(args: argparse.Namespace) -> None:
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")
    if not 0 < args.bw_util <= 1:
        raise UsageError(f"--bw-util must be in (0, 1], got {args.bw_util}")
    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}")


def _print_json(obj: dict[str, Any]) -> None:
    print_document(json.dumps(obj, indent=2, sort_keys=False))


# --------------------------------------------------------------------------------------------- breakeven


def breakeven_result(
    model: ModelSpec, gpu: GpuProfile, tier: TierSpec, *, mfu: float, bw_util: float, gpus: int
) -> dict[str, Any]:
    """The ``plan breakeven --json`` object."""
    from cluster.commands.plan_report import crossover_tokens

    s = cost.breakeven_tokens(model, gpu, tier, mfu=mfu, bw_util=bw_util, gpus=gpus)
    flops = cost.effective_flops(gpu, mfu, gpus)
    bw = cost.effective_bandwidth(tier, bw_util)
    compute_term = flops / bw * model.n_kv * model.bytes_per_elem / (2 * model.n_q)
    offset = model.params / (2 * model.n_q * model.head_dim * model.full_attention_layers)
    curve = []
    for tokens in CURVE_TOKENS:
        tp = cost.t_prefill(model, gpu, tokens, mfu=mfu, gpus=gpus)
        tf = cost.t_fetch(model, tier, tokens, bw_util=bw_util)
        curve.append({"tokens": tokens, "t_prefill_s": tp, "t_fetch_s": tf, "fetch_wins": tf < tp})
    return {
        "model": model.name,
        "gpu": gpu.name,
        "gpus": gpus,
        "tier": tier.name,
        "mfu": mfu,
        "bw_util": bw_util,
        "breakeven_tokens": s,
        "fetch_always_wins": s <= 0,
        "crossover_tokens": crossover_tokens(model, gpu, tier, mfu=mfu, bw_util=bw_util, gpus=gpus),
        "formula": "s* = (MFU*F)/(BW_util*BW) * (n_kv*bytes)/(2*n_q) - N/(2*n_q*d*L_attn)",
        "compute_bandwidth_term_tokens": compute_term,
        "linear_offset_tokens": offset,
        "effective_flops": flops,
        "effective_bandwidth_bytes_per_s": bw,
        "kv_bytes_per_token": cost.kv_bytes_per_token(model),
        "linear_state_bytes_per_seq": model.linear_state_bytes(),
        "tier_latency_s": tier.latency_s,
        "curve": curve,
        "specs": {"model": model.model_dump(), "gpu": gpu.model_dump(), "tier": tier.model_dump()},
    }


def _breakeven(args: argparse.Namespace) -> int:
    try:
        _check_perf(args)
        model = pick("model", load_models(args.models_file), args.model)
        gpu = pick("GPU", load_gpus(args.gpus_file), args.gpu)
        tier = pick("tier", load_tiers(args.tiers_file), args.tier)
        if model.full_attention_layers == 0:
            raise UsageError(f"model {model.name!r} has no full-attention layers: its KV does not grow with context")
    except (UnknownNameError, ConfigError, UsageError) as exc:
        return _fail("breakeven", exc)
    res = breakeven_result(model, gpu, tier, mfu=args.mfu, bw_util=args.bw_util, gpus=args.gpus)
    if args.json:
        _print_json(res)
        return 0
    s = res["breakeven_tokens"]
    print(f"{model.name} on {args.gpus}x {gpu.name} (MFU {args.mfu:g}) fetching KV from {tier.name} "
          f"({tier.bandwidth_gbps:g} GB/s, BW util {args.bw_util:g}, latency {tier.latency_s:g} s)")
    if s > 0:
        print(f"  break-even s* = {s:,.0f} tokens: fetch wins for contexts longer than that, recompute below")
    else:
        print(f"  break-even s* = {s:,.0f} tokens (<= 0): by the closed form, fetch wins at every context length")
    print(f"  s* = {res['compute_bandwidth_term_tokens']:,.0f} (FLOPS/bandwidth term) "
          f"- {res['linear_offset_tokens']:,.0f} (2N linear-term offset)")
    if res["linear_state_bytes_per_seq"] or tier.latency_s:
        print(f"  with latency and linear-state snapshot: fetch wins above {res['crossover_tokens']:,.0f} tokens")
    print(f"  {'context':>10}  {'t_prefill':>11}  {'t_fetch':>11}  winner")
    for row in res["curve"]:
        print(f"  {row['tokens']:>10,}  {row['t_prefill_s']:>10.4g}s  {row['t_fetch_s']:>10.4g}s  "
              f"{'fetch' if row['fetch_wins'] else 'recompute'}")
    return 0


# --------------------------------------------------------------------------------------------- capacity


def capacity_result(model: ModelSpec, gpu: GpuProfile, kv_budget_gib: float | None) -> dict[str, Any]:
    """The ``plan capacity --json`` object."""
    budget_gib = gpu.hbm_gib if kv_budget_gib is None else kv_budget_gib
    budget_bytes = budget_gib * cost.GIB
    fits = {str(s): math.floor(budget_bytes / cost.fetch_bytes(model, s)) for s in CURVE_TOKENS}
    return {
        "model": model.name,
        "gpu": gpu.name,
        "hbm_gib": gpu.hbm_gib,
        "kv_budget_gib": kv_budget_gib,
        "budget_bytes": budget_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token(model),
        "hbm_kv_tokens": cost.hbm_kv_capacity_tokens(model, gpu, kv_budget_gib),
        "kv_gib_per_10k_tokens": cost.kv_gib_per_tokens(model, 10_000),
        "linear_state_bytes_per_seq": model.linear_state_bytes(),
        "sequences_that_fit": fits,
        "note": "budget = all of HBM unless --kv-budget-gib; model weights and activations are not subtracted",
        "specs": {"model": model.model_dump(), "gpu": gpu.model_dump()},
    }


def _capacity(args: argparse.Namespace) -> int:
    try:
        model = pick("model", load_models(args.models_file), args.model)
        gpu = pick("GPU", load_gpus(args.gpus_file), args.gpu)
        if args.kv_budget_gib is not None and args.kv_budget_gib <= 0:
            raise UsageError(f"--kv-budget-gib must be positive, got {args.kv_budget_gib}")
        if model.full_attention_layers == 0:
            raise UsageError(f"model {model.name!r} has no full-attention layers: its KV does not grow with context")
    except (UnknownNameError, ConfigError, UsageError) as exc:
        return _fail("capacity", exc)
    res = capacity_result(model, gpu, args.kv_budget_gib)
    if args.json:
        _print_json(res)
        return 0
    budget = "all of HBM" if args.kv_budget_gib is None else "budget"
    print(f"{model.name} on {gpu.name}: {res['budget_bytes'] / cost.GIB:g} GiB ({budget}, weights not subtracted)")
    print(f"  KV per token        {res['kv_bytes_per_token']:,} bytes ({res['kv_gib_per_10k_tokens']:.4g} GiB per 10k)")
    print(f"  hbm_kv_tokens       {res['hbm_kv_tokens']:,.0f}")
    if res["linear_state_bytes_per_seq"]:
        print(f"  linear state        {res['linear_state_bytes_per_seq']:,} bytes per sequence")
    for tokens, n in res["sequences_that_fit"].items():
        print(f"  sequences of {int(tokens):>9,} tokens that fit: {n:,}")
    return 0


# --------------------------------------------------------------------------------------------- report


def _names(csv: str | None, default: tuple[str, ...], table: dict[str, Any]) -> list[str]:
    if csv:
        return [n.strip() for n in csv.split(",") if n.strip()]
    present = [n for n in default if n in table]
    return present or sorted(table)


def _report(args: argparse.Namespace) -> int:
    from cluster.commands.plan_report import ReportInputs, write_report

    try:
        _check_perf(args)
        models = load_models(args.models_file)
        gpus = load_gpus(args.gpus_file)
        tiers = load_tiers(args.tiers_file)
        chosen = [pick("model", models, n) for n in _names(args.models, REPORT_MODELS, models)]
        for m in chosen:
            if m.full_attention_layers == 0:
                raise UsageError(f"model {m.name!r} has no full-attention layers: nothing to plot")
        inp = ReportInputs(
            models=chosen,
            gpu=pick("GPU", gpus, args.gpu),
            gpu_table=[pick("GPU", gpus, n) for n in _names(args.gpu_table, REPORT_GPUS, gpus)],
            tiers=list(tiers.values()),
            mfu=args.mfu,
            bw_util=args.bw_util,
            gpus=args.gpus,
        )
    except (UnknownNameError, ConfigError, UsageError) as exc:
        return _fail("report", exc)
    for path in write_report(args.out, inp):
        print(path)
    return 0
