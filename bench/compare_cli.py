"""``kvstack bench compare``: policies side by side on one workload — in the simulator, and live when endpoints are given.

    kvstack bench compare --trace FILE --nodes 16 --hbm-tokens 300k --pool-tokens 3M --out report/
    kvstack bench compare --live [live-compare flags]     # = kvstack bench live-compare (bench.live_compare)
    kvstack bench compare --agent-sessions 200 --endpoint round_robin=http://127.0.0.1:8001/v1 \\
        --endpoint cost_based=http://127.0.0.1:8002/v1 --live-max-requests 200 --out report/

Simulator: every ``--policies`` entry runs on the same workload and cluster (``bench.simulate``). Live: each
``NAME=URL`` endpoint (for example one deployment per policy) gets the same agent workload (``bench.agent``),
one after the other. Writes ``report.md`` (tables, ratios against ``--baseline``, plots), ``results.json`` and the
PNGs into ``--out``. Live endpoints are any OpenAI-compatible servers; the router columns fill in only where the
endpoint exports ``kvstack_router_*`` metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from bench.simulate_cli import add_sim_args, add_workload_source_args, run_policy_full, sim_setup

DEFAULT_POLICIES = "round_robin,least_loaded,prefix_affinity,cost_based,always_fetch"


def _endpoint(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--endpoint must be NAME=URL, got {text!r}")
    name, url = text.split("=", 1)
    if not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--endpoint must be NAME=http(s)://..., got {text!r}")
    return name, url


def configure(parser: argparse.ArgumentParser) -> None:
    add_workload_source_args(parser, required=False)
    add_sim_args(parser)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policies to simulate")
    parser.add_argument("--baseline", default="round_robin", help="ratios in the report are against this one")
    parser.add_argument("--no-sim", action="store_true", help="live comparison only")
    parser.add_argument("--live", action="store_true",
                        help="start one server per configuration and compare them live: this is `kvstack bench "
                             "live-compare` (see its --help), every other flag is its")
    g = parser.add_argument_group("live (optional)")
    g.add_argument("--endpoint", type=_endpoint, action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI base URL to drive with the agent workload; repeat for each policy/deployment")
    g.add_argument("--live-model", default=None, help="model name (default: the endpoint's first)")
    g.add_argument("--live-max-requests", type=int, default=200)
    g.add_argument("--live-duration-s", type=float, default=300.0)
    g.add_argument("--api-key", default=None)
    g.add_argument("--request-timeout-s", type=float, default=120.0)
    g.add_argument("--extra-body", default=None)
    g.add_argument("--tools-mode", choices=["tools", "user"], default="tools")
    g.add_argument("--tool-choice", default="none")
    g.add_argument("--max-concurrent-sessions", type=int, default=0,
                   help="at most this many sessions in flight per endpoint (0: no bound; 1: sequential)")
    parser.add_argument("--out", type=Path, required=True, help="report directory")
    parser.add_argument("--no-progress", action="store_true")


# ------------------------------------------------------------------------------------------------ formatting
def _f(v: Any, fmt: str = ".3f") -> str:
    return "–" if v is None else format(v, fmt)


def _tok(v: Any) -> str:
    return str(v) if isinstance(v, str) else f"{v:,.0f}"


def _ratio(a: Any, b: Any) -> str:
    return "–" if a is None or b in (None, 0) else f"{a / b:.2f}×"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def sim_section(results: dict[str, dict[str, Any]], baseline: str) -> str:
    any_r = next(iter(results.values()))
    cfg = any_r["config"]
    base = results.get(baseline)
    rows = []
    for name, r in results.items():
        hr = r["hit_rate_by_tier"]
        d = r["decisions"]
        rows.append([
            name, _f(r["token_hit_rate"]), _f(hr["hbm"]), _f(hr["dram"]), _f(hr["ssd"]),
            _f(r["ttft_p50_s"]), _f(r["ttft_p99_s"]), _f(r["prefill_gpu_s"], ".0f"),
            _ratio(r["ttft_p50_s"], base and base["ttft_p50_s"]), _ratio(r["ttft_p99_s"], base and base["ttft_p99_s"]),
            ", ".join(f"{k} {v}" for k, v in sorted(d.items())),
        ])
    lines = [
        "## Simulator",
        "",
        f"Workload: {any_r['workload']} — {any_r['requests']} requests, {any_r['prompt_tokens']:,} prompt tokens, "
        f"reuse bound {any_r['workload_reuse_bound']:.3f} (one infinite cache that saw every earlier request).",
        f"Cluster: {cfg['nodes']} nodes × {cfg['replicas_per_node']} replica(s), {cfg['model']} on {cfg['gpu']} "
        f"(MFU {cfg['mfu']}, BW util {cfg['bw_util']}); HBM {_tok(cfg['hbm_tokens'])} tokens/replica, pool DRAM "
        f"{_tok(cfg['pool_dram_tokens'])} + SSD {_tok(cfg['pool_ssd_tokens'])} tokens/node.",
        "",
        _table(
            ["policy", "hit rate", "HBM", "DRAM", "SSD", "TTFT p50 s", "TTFT p99 s", "prefill GPU-s",
             f"p50 vs {baseline}", f"p99 vs {baseline}", "decisions"],
            rows,
        ),
        "",
        "![simulated TTFT CDF](sim_ttft_cdf.png)",
        "![simulated hit rate by tier](sim_hit_rate_by_tier.png)",
        "![simulated prefill GPU-seconds](sim_prefill_gpu_s.png)",
        "",
    ]
    return "\n".join(lines)


def live_section(results: dict[str, dict[str, Any]], baseline: str) -> str:
    base = results.get(baseline)
    rows = []
    for name, r in results.items():
        rq, tt, tp = r["requests"], r["ttft_s"], r["tpot_s"]
        router = r["router"]
        hits = router.get("hit_tokens_by_tier") or {}
        dec = router.get("decisions_by_action") or {}
        rows.append([
            name, f"{rq['ok']}/{rq['sent']}", str(rq["errors"]), _f(tt["p50"]), _f(tt["p90"]), _f(tt["p99"]),
            _f(tp["p50"], ".4f"), _f(r["throughput"]["output_tokens_per_s"], ".1f"),
            _ratio(tt["p50"], base and base["ttft_s"]["p50"]), _ratio(tt["p99"], base and base["ttft_s"]["p99"]),
            ", ".join(f"{k} {v:.0f}" for k, v in sorted(hits.items())) or "–",
            ", ".join(f"{k} {v:.0f}" for k, v in sorted(dec.items())) or "–",
        ])
    lines = [
        "## Live",
        "",
        _table(
            ["endpoint", "ok/sent", "errors", "TTFT p50 s", "p90", "p99", "TPOT p50 s", "out tok/s",
             f"p50 vs {baseline}", f"p99 vs {baseline}", "hit tokens by tier", "decisions"],
            rows,
        ),
        "",
        "![live TTFT CDF](live_ttft_cdf.png)",
        "![live TTFT by turn](live_ttft_by_turn.png)",
    ]
    if any((r["router"].get("hit_tokens_by_tier") or {}) for r in results.values()):
        lines.append("![live hit tokens by tier](live_hit_tokens_by_tier.png)")
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ run
def _live_args(args: argparse.Namespace, name: str, url: str) -> argparse.Namespace:
    ns = argparse.Namespace(**vars(args))
    ns.endpoint, ns.label, ns.model = url, name, args.live_model
    ns.max_requests, ns.duration_s = args.live_max_requests, args.live_duration_s
    ns.out, ns.json, ns.save_requests = None, False, False
    return ns


def run(args: argparse.Namespace) -> int:
    from bench import plots

    if args.live:  # only reachable when called past the dispatcher (cluster.cli.resolve_aliases)
        print("kvstack bench compare: --live is `kvstack bench live-compare`; run it through `kvstack`",
              file=sys.stderr)
        return 2

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report = ["# kvstack policy comparison", ""]
    payload: dict[str, Any] = {"schema": "kvstack.bench.compare/v1"}
    if not args.no_sim:
        try:
            setup = sim_setup(args)
            sim: dict[str, dict[str, Any]] = {}
            ttfts: dict[str, list[float]] = {}
            for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
                sim[policy], ttfts[policy] = run_policy_full(setup, args, policy)
                print(f"simulated {policy}: hit rate {sim[policy]['token_hit_rate']:.3f}, "
                      f"TTFT p50 {sim[policy]['ttft_p50_s']:.3f}s", file=sys.stderr)
        except (ValueError, TypeError, KeyError) as exc:
            print(f"kvstack bench compare: {exc}", file=sys.stderr)
            return 2
        plots.ttft_cdf(ttfts, out / "sim_ttft_cdf.png", title="simulated TTFT CDF")
        plots.grouped_bars({p: r["hit_rate_by_tier"] for p, r in sim.items()}, out / "sim_hit_rate_by_tier.png",
                           title="simulated prefix hit rate by tier", ylabel="fraction of prompt tokens")
        plots.grouped_bars({p: {"prefill GPU-s": r["prefill_gpu_s"]} for p, r in sim.items()},
                           out / "sim_prefill_gpu_s.png", title="simulated prefill work", ylabel="GPU-seconds")
        report.append(sim_section(sim, args.baseline))
        payload["simulator"] = sim
    if args.endpoint:
        from bench.agent_cli import run_agent_bench

        live: dict[str, dict[str, Any]] = {}
        samples: dict[str, list[float]] = {}
        for name, url in args.endpoint:
            live[name], records = asyncio.run(run_agent_bench(_live_args(args, name, url)))
            samples[name] = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
        plots.ttft_cdf(samples, out / "live_ttft_cdf.png", title="live TTFT CDF")
        plots.ttft_by_turn({n: r["per_turn"] for n, r in live.items()}, out / "live_ttft_by_turn.png")
        hits = {n: r["router"].get("hit_tokens_by_tier") or {} for n, r in live.items()}
        if any(hits.values()):
            plots.hit_tokens_by_tier(hits, out / "live_hit_tokens_by_tier.png")
        report.append(live_section(live, args.baseline))
        payload["live"] = live
    if "simulator" not in payload and "live" not in payload:
        print("kvstack bench compare: nothing to do (--no-sim and no --endpoint)", file=sys.stderr)
        return 2
    (out / "report.md").write_text("\n".join(report))
    (out / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True))
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0
