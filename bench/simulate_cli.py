"""``kvstack simulate``: run a Mooncake trace (or the agent workload) through the simulated cluster with one policy.

    kvstack simulate --trace FILE --nodes 16 --policy cost_based --hbm-tokens 300k --pool-tokens 3M --json

Prints (``--json``) or writes (``--out``) the ``SimResult`` JSON: ``token_hit_rate``, ``hit_rate_by_tier``,
``ttft_p50_s``, ``ttft_p99_s``, ``prefill_gpu_s``, ``decisions``, ``wall_s`` and more, plus the trace's own reuse
bound. Hardware comes from ``configs`` (``--model``, ``--gpu``); token capacities accept ``300k``, ``3M``, ``inf``
and, for HBM, ``auto`` (what the GPU holds after the weights). Also used by ``bench.compare_cli`` through
``add_sim_args`` / ``sim_setup``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.traces import TraceRecord, load_trace, prefix_reuse_bound, scale_trace
from cluster.cli_output import print_document

_SUFFIX = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9}


def parse_tokens(text: str) -> float:
    """``300k`` -> 3e5, ``3M`` -> 3e6, ``inf`` -> math.inf, plain numbers as they are; ``auto`` -> NaN marker."""
    t = text.strip()
    if t.lower() in ("inf", "unbounded"):
        return math.inf
    if t.lower() == "auto":
        return math.nan
    mult = 1.0
    if t and t[-1] in _SUFFIX:
        mult, t = _SUFFIX[t[-1]], t[:-1]
    try:
        v = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 300k, 3M, inf)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"token count must be >= 0, got {text!r}")
    return v


def parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"policy option must be key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def add_workload_source_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    g = p.add_argument_group("workload")
    src = g.add_mutually_exclusive_group(required=required)
    src.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace")
    src.add_argument("--agent-sessions", type=int, help="simulate this many sessions of the agent workload instead")
    g.add_argument("--max-requests", type=int, default=None, help="only the first N requests of the trace")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (>1 = slower)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt/output lengths")
    g.add_argument("--agent-response-s", type=float, default=1.0, help="assumed response time between agent turns")
    from bench.agent_cli import add_workload_args

    add_workload_args(p)


def add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=16)
    g.add_argument("--replicas-per-node", type=int, default=1)
    g.add_argument("--model", default="qwen3-14b", help="model spec name (configs/specs/models.yaml)")
    g.add_argument("--gpu", default="h100-sxm5-80gb", help="GPU profile name (configs/specs/gpus.yaml)")
    g.add_argument("--gpus-per-replica", type=int, default=1)
    g.add_argument("--mfu", type=float, default=0.5)
    g.add_argument("--bw-util", type=float, default=0.8)
    g.add_argument("--hbm-tokens", type=parse_tokens, default=math.nan, help="per replica (default auto)")
    g.add_argument("--pool-tokens", type=parse_tokens, default=0.0, help="pool DRAM per node (0 = no pool)")
    g.add_argument("--ssd-tokens", type=parse_tokens, default=0.0, help="pool SSD per node (0 = none)")
    g.add_argument("--pool-write", choices=["computed", "all", "none"], default="computed")
    g.add_argument("--no-pool-touch", dest="pool_touch", action="store_false",
                   help="HBM hits do not refresh the node shard's copies (the replicas do by default)")
    g.add_argument("--policy-option", type=parse_option, action="append", default=[], metavar="KEY=VALUE")
    g.add_argument("--anti-herding", action="store_true", help="let the runner add its in-flight assignments")
    g.add_argument("--engine-sharing", choices=["fifo", "batch"], default="fifo",
                   help="fifo: one prefill at a time per replica; batch: the prefills in flight share the engine "
                        "(vLLM's continuous batching)")
    g.add_argument("--kv-admission", action="store_true",
                   help="an engine admits a request only when its prompt fits in the KV cache (--hbm-tokens), and "
                        "the replicas report their KV occupancy to the router (needs --engine-sharing batch)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_workload_source_args(parser)
    add_sim_args(parser)
    parser.add_argument("--policy", default="cost_based", help="round_robin, least_loaded, prefix_affinity, cost_based, always_fetch")
    parser.add_argument("--json", action="store_true", help="print the result JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the result JSON here")


@dataclass(frozen=True, slots=True)
class SimSetup:
    records: list[TraceRecord]
    source: str
    hw: Any
    tier_map: Any
    hbm_tokens: float


def load_workload(args: argparse.Namespace) -> tuple[list[TraceRecord], str]:
    if args.trace is not None:
        records = load_trace(args.trace, max_requests=args.max_requests)
        source = str(args.trace)
    elif args.agent_sessions is None:
        raise ValueError("give a workload: --trace FILE or --agent-sessions N")
    else:
        from bench.agent import plan_sessions, workload_trace
        from bench.agent_cli import workload_from_args

        w = workload_from_args(args)
        records = workload_trace(w, plan_sessions(w, max_sessions=args.agent_sessions), response_time_s=args.agent_response_s)
        if args.max_requests is not None:
            records = records[: args.max_requests]
        source = f"agent workload ({args.agent_sessions} sessions, seed {args.seed})"
    if args.time_scale != 1.0 or args.length_scale != 1.0:
        records = scale_trace(records, time_scale=args.time_scale, length_scale=args.length_scale)
    return records, source


def sim_setup(args: argparse.Namespace) -> SimSetup:
    from configs.loader import load_gpus, load_models, load_tiers, pick
    from router.cost import Hardware
    from router.policies.pricing import TierMap

    from bench.simulate import default_hbm_tokens

    hw = Hardware(
        model=pick("model", load_models(), args.model),
        gpu=pick("GPU", load_gpus(), args.gpu),
        mfu=args.mfu,
        bw_util=args.bw_util,
        gpus=args.gpus_per_replica,
    )
    hbm = default_hbm_tokens(hw) if math.isnan(args.hbm_tokens) else args.hbm_tokens
    for name in ("pool_tokens", "ssd_tokens"):
        if math.isnan(getattr(args, name)):
            raise SystemExit(f"--{name.replace('_', '-')} does not take 'auto'")
    records, source = load_workload(args)
    return SimSetup(records, source, hw, TierMap.from_tiers(load_tiers()), hbm)


def run_policy(setup: SimSetup, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """One policy on the setup's workload: the result JSON (``run_policy_full`` also returns the TTFT samples)."""
    return run_policy_full(setup, args, policy)[0]


def run_policy_full(setup: SimSetup, args: argparse.Namespace, policy: str) -> tuple[dict[str, Any], list[float]]:
    from bench.simulate import SimConfig, simulate

    config = SimConfig(
        nodes=args.nodes,
        replicas_per_node=args.replicas_per_node,
        policy=policy,
        hw=setup.hw,
        tier_map=setup.tier_map,
        hbm_tokens=setup.hbm_tokens,
        pool_dram_tokens=args.pool_tokens,
        pool_ssd_tokens=args.ssd_tokens,
        pool_write=args.pool_write,
        pool_touch=args.pool_touch,
        seed=args.seed,
        policy_options=dict(args.policy_option),
        anti_herding=args.anti_herding,
        engine_sharing=args.engine_sharing,
        kv_admission=args.kv_admission,
    )
    result = simulate(setup.records, config)
    out = result.to_json()
    out["workload"] = setup.source
    out["workload_reuse_bound"] = prefix_reuse_bound(setup.records)
    return out, result.ttft_s.tolist()


def run(args: argparse.Namespace) -> int:
    try:
        setup = sim_setup(args)
        result = run_policy(setup, args, args.policy)
    except (ValueError, TypeError, KeyError) as exc:
        print(f"kvstack simulate: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        print_document(text)
    else:
        hr = result["hit_rate_by_tier"]
        print(
            f"{result['policy']} on {result['replicas']} replicas, {result['requests']} requests ({result['workload']}):\n"
            f"  token hit rate {result['token_hit_rate']:.3f} (hbm {hr['hbm']:.3f}, dram {hr['dram']:.3f}, "
            f"ssd {hr['ssd']:.3f}; workload bound {result['workload_reuse_bound']:.3f})\n"
            f"  TTFT p50 {result['ttft_p50_s']:.3f}s p99 {result['ttft_p99_s']:.3f}s, prefill {result['prefill_gpu_s']:.0f} GPU-s\n"
            f"  decisions {result['decisions']}, simulated in {result['wall_s']:.2f}s"
        )
    return 0
