"""``kvstack bench sim-live``: does the simulator tell the truth about a live run? (issue 13, item 6)

    kvstack bench sim-live --work-dir .kvstack/live_compare/<time> [--out DIR] [--json]

Takes a finished ``bench.live_compare`` run (its work dir: ``meta.json``, ``entries.json``, every run's request
log and decision records) and simulates every configuration on what that run saw:
- **the workload**: each run's own requests (``bench agent --save-requests``: session, turn, send time, prompt and
  output tokens), replayed at their live send times — also those that never got their usage back (cancelled at the
  run's deadline, mostly in an overloaded run), with the lengths another run measured for the same turn: their
  load was on the live engines; the simulated TTFTs are summarized over the requests the live summary has. Block
  ids follow the agent workload's structure at the engine's block size: a session's turn k+1 prompt extends its
  turn k prompt, the first ``shared_prefix_tokens`` (the system prompt and tools of the session's variant, sized
  with the model's tokenizer by ``live_compare``) are shared by the sessions of that variant; a partial last block
  gets an id of its own.
- **the cluster**: the local one (2 nodes, one replica each; ``--nodes`` / ``--replicas-per-node``), each replica
  running its prefills in flight together (``engine_sharing="batch"``: vLLM's continuous batching), its KV cache as
  configured (``kv_cache_memory_bytes`` / the model's KV bytes per token) both as its prefix cache and as what
  admits a request (``kv_admission``: a prompt waits until its blocks fit, as in vLLM), the pool on or off as the
  configuration ran, the policy it ran (the Ray Serve LLM anchor as ``prefix_affinity`` without a pool: its
  ``PrefixCacheAffinityRouter`` routes on the longest prefix match).
- **the costs the live timeline shows** (``DecisionRecord.timeline`` of the configuration's own records): the
  router's model of the engine, fitted to the prefills it timed alone (scheduled → first token against the tokens
  it computed, no other prefill of that replica in flight; ``router.calibration.MfuEstimator``: MFU, attention
  scale and the fixed cost per prefill), which the simulated policies price with as the live router did; the
  engine itself, fitted to its busy periods in every run (``bench.engine_fit``: seconds per computed token and per
  token² of attention, least squares over the time the engines were busy, the fixed cost per prefill from the fit
  before), which times the simulated prefills (``--no-engine-fit``: the router's fit times them too, as before);
  the pool's calls for the scheduler (lookup + lease; a load's whole wait on the pool from the engine's first ask,
  ``PoolRequestTiming.wait_s``, where recorded) as a per-prefill cost, and as a per-request cost the ingress +
  transport time (median) plus the time outside the router's view (the client's TTFT less the router's: HTTP
  proxy, client, a starved machine; ``bench.decision_audit.outside_router_gaps``), drawn per simulated request from
  the run's own gaps (seeded): that time has a heavy tail (on a 2-core box, means 2-9× the median), it queues
  nothing the simulator models, and a median alone misses it. Both engine fits are made once, on every
  configuration's prefills (the same engine arguments and placement everywhere). The anchor has no
  timeline: it is priced with the pool-less kvstack configuration's figures (same engine arguments).
Then it compares the simulated TTFT p50 / mean of each configuration with the live run's (the goal: within 25%) and
the order of the configurations by p50 (all of it, and the pairs whose live p50s differ by more than
``ORDER_BAND``).

Output: a JSON document (``--json``: on stdout) and, with ``--out``, ``sim_live.json`` + ``sim_live.md``.
Pure apart from reading the work dir; the simulator is ``bench.simulate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_configs import parse_config
from bench.engine_fit import EngineCost, busy_periods, engine_intervals, fit_engine_cost
from bench.traces import TraceRecord
from cluster.cli_output import print_document

#: What "within" means for the simulator against the live run (issue 13, item 6).
TOLERANCE = 0.25
#: Two configurations whose live p50s are within this fraction of each other are not ordered by the live run: its
#: repeats differ by more (bootstrap intervals of ±10% on a p50 ratio, ``bench.live_compare``). ``same_order``
#: compares the whole order; ``same_order_beyond_band`` only the pairs the live run separates by more than this.
#: (The committed overloaded run: round_robin 3.279 s and cost_based 3.352 s live, 2% apart; simulated 2.931 s and
#: 2.950 s with the runner's random tie-break, 2.931 s and 2.917 s with its least-recently-chosen one.)
ORDER_BAND = 0.05


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--work-dir", type=Path, required=True, help="a bench.live_compare work dir")
    parser.add_argument("--out", type=Path, default=None, help="write sim_live.json and sim_live.md here")
    parser.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    parser.add_argument("--nodes", type=int, default=2, help="nodes with replicas (local cluster: 2)")
    parser.add_argument("--replicas-per-node", type=int, default=1)
    parser.add_argument("--pool-tokens", type=float, default=None,
                        help="pool DRAM tokens per node (default: the configured dram_bytes / KV bytes per token)")
    parser.add_argument("--no-kv-admission", dest="kv_admission", action="store_false",
                        help="engines admit every prompt at once (the simulator before it modelled KV admission)")
    parser.add_argument("--no-engine-fit", dest="engine_fit", action="store_false",
                        help="time the simulated prefills with the router's fit of the prefills that ran alone "
                             "(the simulator before it fitted the engines' busy periods)")


# ------------------------------------------------------------------------------------------- the workload
def live_trace(requests: Iterable[Mapping[str, Any]], variant_of: Mapping[int, int], shared_tokens: int,
               block_tokens: int) -> list[TraceRecord]:
    """The requests of one live run that got a prompt length, as a trace at their send times (module docstring)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    rows = sorted((float(r["sent_at_s"]), int(r["session"]), int(r["turn"]), int(r["prompt_tokens"]),
                   int(r.get("output_tokens") or 1)) for r in requests if r.get("prompt_tokens"))
    ids: dict[tuple[Any, ...], int] = {}
    out: list[TraceRecord] = []
    for i, (t, session, _turn, length, output) in enumerate(rows):
        hash_ids = []
        for b in range(math.ceil(length / block_tokens)):
            end = min((b + 1) * block_tokens, length)
            size = end - b * block_tokens
            key = (("sys", variant_of.get(session, -1), b, size) if end <= shared_tokens
                   else ("sess", session, b, size))
            hash_ids.append(ids.setdefault(key, len(ids)))
        out.append(TraceRecord(i, t * 1000.0, length, max(1, output), tuple(hash_ids), block_tokens))
    return out


def known_lengths(logs: Iterable[Iterable[Mapping[str, Any]]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(session, turn) -> (prompt tokens, output tokens), from every run of a work dir that measured them. The runs
    replay the same sessions (one workload seed) with greedy outputs that every configuration shares, so a turn has
    one length in all of them."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for log in logs:
        for r in log:
            if r.get("prompt_tokens") and r.get("session") is not None:
                out.setdefault((int(r["session"]), int(r["turn"])), (int(r["prompt_tokens"]),
                                                                     int(r.get("output_tokens") or 1)))
    return out


def replayed_requests(log: Iterable[Mapping[str, Any]],
                      lengths: Mapping[tuple[int, int], tuple[int, int]]) -> list[dict[str, Any]]:
    """The requests of one run the simulator replays, in send order: those that measured their prompt, and those
    that did not (cancelled at the run's deadline, or failed, before the usage came back) with the lengths another
    run measured for the same turn (``known_lengths``): their load was on the live engines too. Each row says
    whether the live run has its TTFT in its summary (``live_timed``: ``bench.live_compare.is_timed``); the
    simulated summary counts only those, so both summarize the same requests. A filled-in request runs to its end
    in the simulator (the live one was cut at the deadline, when the run was ending anyway)."""
    from bench.live_compare import is_timed

    rows = []
    for r in log:
        if r.get("session") is None:
            continue
        row = dict(r)
        if not row.get("prompt_tokens"):
            known = lengths.get((int(r["session"]), int(r["turn"])))
            if known is None:
                continue
            row["prompt_tokens"], row["output_tokens"] = known
        row["live_timed"] = is_timed(r)
        rows.append(row)
    return sorted(rows, key=lambda r: (float(r["sent_at_s"]), int(r["session"]), int(r["turn"])))


# ------------------------------------------------------------------------------------------- the costs
@dataclasses.dataclass(frozen=True, slots=True)
class LiveCosts:
    """What one configuration's decision records say the live path cost."""

    mfu: float
    prefill_overhead_s: float  # the fitted fixed cost of a prefill (intercept), plus the pool's scheduler calls
    request_overhead_s: float  # ingress + transport, median
    prefills: int  # prefills the fit saw
    pool_calls_s: float  # lookup + lease (a load's whole wait on the pool) per request, median (0 without the pool)
    outside_router_s: float = 0.0  # client TTFT − router TTFT, median (HTTP proxy, client): no timeline sees it
    outside_router_gaps: tuple[float, ...] = ()  # every matched request's gap (≥ 0): the simulator draws from them
    peak_tflops: float = 0.0  # the profile's peak as the fit raised it (0: the profile's own), as the router does
    attn_scale: float = 1.0  # the attention's cost per FLOP relative to the matrix products' (``Hardware``)


Prefill = tuple[int, int, float]  # (prompt tokens, cached tokens, seconds from scheduled to the first token)


def engine_prefills(records: Sequence[Mapping[str, Any]]) -> list[Prefill]:
    """The prefills one run's records timed on the engine's own clock, to fit the router's model of the engine on
    (MFU and fixed cost: what the policy inside the simulator prices with, as the live router did): those no other
    prefill of the same replica overlapped (the engine shares its compute among those in flight; the simulator
    models that sharing itself), all of them when fewer than 5 ran alone."""
    timed = engine_intervals(records)
    solo = [p for p in timed if not any(q is not p and q[0] == p[0] and q[1] < p[2] and p[1] < q[2] for q in timed)]
    return [(prompt, cached, t1 - t0) for _rid, t0, t1, prompt, cached in (solo if len(solo) >= 5 else timed)]


def live_costs(records: Sequence[Mapping[str, Any]], hw: Any,
               requests: Sequence[Mapping[str, Any]] | None = None, *,
               prefills: Sequence[Prefill] | None = None) -> LiveCosts | None:
    """Fit the engine's prefill (MFU + fixed cost) and the per-request costs from a run's decision records (and,
    with the client's ``requests``, the time outside the router's view: ``bench.decision_audit.outside_router``);
    None when the records carry no timeline. ``prefills`` (``engine_prefills`` of several runs pooled) replaces
    the run's own prefills in the engine fit: every configuration runs the same engine with the same placement,
    and a pool-on run alone times mostly short suffixes after a fetch, so its own fit sees few full prompts."""
    from router.calibration import MfuEstimator

    est = MfuEstimator(hw, halflife=1e9, min_obs=5)
    outside: list[float] = []
    pool: list[float] = []
    for r in records:
        tl = r.get("timeline") or {}
        if tl.get("ingress_s") is not None and tl.get("transport_s") is not None:
            outside.append(float(tl["ingress_s"]) + float(tl["transport_s"]))
        p = tl.get("pool")
        if p:
            # Its pool calls; a load's whole wait on the pool from the engine's first ask when it was recorded.
            calls = float(p.get("lookup_s") or 0.0) + float(p.get("lease_s") or 0.0)
            pool.append(max(calls, float(p.get("wait_s") or 0.0)))
    own = engine_prefills(records)
    if not outside and not own:
        return None  # the records carry no timeline
    fit = list(prefills) if prefills is not None else own
    for prompt, cached, seconds in fit:
        est.observe(prompt, cached, seconds)
    n = len(fit)
    pool_s = statistics.median(pool) if pool else 0.0
    gaps: list[float] = []
    if requests:
        from bench.decision_audit import outside_router_gaps

        ordered = sorted(records, key=lambda r: float(r.get("decided_at") or 0.0))
        gaps = [max(0.0, g) for g in outside_router_gaps(ordered, requests)[0]]
    fitted = est.hardware()  # MFU on the router's grid; a profile slower than the engine gets its peak raised
    return LiveCosts(mfu=fitted.mfu, peak_tflops=fitted.gpu.bf16_tflops, attn_scale=fitted.attn_scale,
                     prefill_overhead_s=max(0.0, est.overhead_s) + pool_s,
                     request_overhead_s=statistics.median(outside) if outside else 0.0, prefills=n,
                     pool_calls_s=pool_s, outside_router_s=statistics.median(gaps) if gaps else 0.0,
                     outside_router_gaps=tuple(gaps))


def with_outside_router(ttft_s: np.ndarray, costs: LiveCosts | None, rng: np.random.Generator) -> np.ndarray:
    """Simulated TTFTs plus, per request, a time outside the router's view drawn from the run's own gaps (module
    docstring); unchanged without gaps."""
    if costs is None or not costs.outside_router_gaps:
        return ttft_s
    return ttft_s + rng.choice(np.asarray(costs.outside_router_gaps), size=len(ttft_s))


def _costs_row(c: LiveCosts | None) -> dict[str, Any] | None:
    """A configuration's costs for the report: its outside-the-router gaps as their count, not every value."""
    if c is None:
        return None
    row = dataclasses.asdict(c)
    row["outside_router_gaps"] = len(c.outside_router_gaps)
    return row


# ------------------------------------------------------------------------------------------- the run
def _serve_settings(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The engine / pool / router settings the live run served with: the embedded config plus its --set overrides."""
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides

    cfg = load_serve_config(DEFAULT_CONFIG, parse_overrides(list(meta.get("serve_set") or [])))
    return {"block_size": cfg.app.engine.block_size, "kv_bytes": cfg.app.engine.kv_cache_memory_bytes,
            "model_spec": cfg.app.router.model_spec, "gpu_profile": cfg.app.router.gpu_profile,
            "dram_bytes": cfg.app.pool.dram_bytes, "model_path": cfg.app.engine.model_path}


def policy_of(config: str) -> tuple[str, bool]:
    """(kvstack policy, pool on) that simulates a live configuration (Ray Serve LLM's: pool-less prefix affinity)."""
    spec = parse_config(config)
    return spec.policy, spec.pool


def simulate_run(work: Path, *, nodes: int = 2, replicas_per_node: int = 1,
                 pool_tokens: float | None = None, kv_admission: bool = True,
                 engine_fit: bool = True) -> dict[str, Any]:
    from bench.agent import session_plan
    from bench.agent_cli import workload_from_args
    from bench.live_compare import REPO, run_dir, run_label, ttfts
    from bench.simulate import SimConfig, simulate
    from bench.stats import summarize
    from configs.loader import load_gpus, load_tiers, pick
    from router.cost import Hardware, kv_bytes_per_token
    from router.policies.pricing import TierMap

    meta = json.loads((work / "meta.json").read_text())
    entries = [e for e in json.loads((work / "entries.json").read_text()) if e.get("result")]
    if not entries:
        raise ValueError(f"{work}: no finished run to simulate")
    settings = _serve_settings(meta)
    from configs.hf_model import pricing_spec

    base_hw = Hardware(model=pricing_spec(str(REPO / settings["model_path"]), settings["model_spec"]),
                       gpu=pick("GPU", load_gpus(), settings["gpu_profile"]), mfu=0.5, bw_util=0.8)
    kvb = kv_bytes_per_token(base_hw.model)
    hbm_tokens = float(settings["kv_bytes"]) / kvb if settings["kv_bytes"] else math.inf
    pool_dram = pool_tokens if pool_tokens is not None else float(settings["dram_bytes"]) / kvb
    workload = dict(meta["workload"])
    workload.setdefault("max_sessions", 0)
    w = workload_from_args(argparse.Namespace(**workload))
    sizing = meta.get("sizing")
    if not sizing:  # the run was started without the model's tokenizer at hand: size it now
        from bench.live_compare import size_workload

        sizing = size_workload(argparse.Namespace(**workload), REPO / settings["model_path"])
    shared = int(sizing["shared_prefix_tokens"])
    tiers = TierMap.from_tiers(load_tiers())

    run_records: list[list[dict[str, Any]]] = []  # every run's decision records (none: a run without a router)
    records: dict[str, list[dict[str, Any]]] = {}  # the first run of a configuration prices all of its runs
    for e in entries:
        f = run_dir(work, e["policy"], int(e.get("repeat", 1))) / "decisions.json"
        run_records.append(json.loads(f.read_text()) if f.exists() else [])
        if f.exists() and e["policy"] not in records:
            records[e["policy"]] = run_records[-1]
    # One engine everywhere (same arguments, same placement): its prefill rate fitted on every run's prefills.
    engine = [p for recs in records.values() for p in engine_prefills(recs)]
    costs: dict[str, LiveCosts] = {}
    for e in entries:
        config = e["policy"]
        if config in records and config not in costs:
            got = live_costs(records[config], base_hw, e["result"].get("request_log"), prefills=engine)
            if got is not None:
                costs[config] = got
    fallback = next((costs[c] for c in costs if not parse_config(c).pool), next(iter(costs.values()), None))
    # What the engines spent: their busy periods in every run, with the fixed cost per prefill of the fit above.
    engine_cost: EngineCost | None = None
    if engine_fit and fallback is not None:
        engine_cost = fit_engine_cost([p for recs in run_records for p in busy_periods(recs)],
                                      max(0.0, fallback.prefill_overhead_s - fallback.pool_calls_s))

    lengths = known_lengths(e["result"].get("request_log") or [] for e in entries)
    rng = np.random.default_rng(0)
    runs: list[dict[str, Any]] = []
    live: dict[str, list[float]] = {}
    sim: dict[str, list[float]] = {}
    for e in entries:
        config = e["policy"]
        log = replayed_requests(e["result"].get("request_log") or [], lengths)
        variants = {s: session_plan(w, s, 0.0).variant for s in {int(r["session"]) for r in log}}
        trace = live_trace(log, variants, shared, settings["block_size"])  # the same send order as ``log``
        c = costs.get(config) or fallback
        policy, pool = policy_of(config)
        hw = base_hw
        if c:
            gpu = base_hw.gpu.model_copy(update={"bf16_tflops": c.peak_tflops}) if c.peak_tflops else base_hw.gpu
            hw = dataclasses.replace(base_hw, mfu=c.mfu, gpu=gpu, attn_scale=c.attn_scale)
        result = simulate(trace, SimConfig(
            nodes=nodes, replicas_per_node=replicas_per_node, policy=policy, hw=hw, tier_map=tiers,
            hbm_tokens=hbm_tokens, pool_dram_tokens=pool_dram if pool else 0.0,
            prefill_overhead_s=(c.prefill_overhead_s if c else 0.0) if pool else
            (c.prefill_overhead_s - c.pool_calls_s if c else 0.0),
            request_overhead_s=c.request_overhead_s if c else 0.0, engine_sharing="batch",
            kv_admission=kv_admission, engine_cost=engine_cost))
        timed = np.array([r["live_timed"] for r in log], dtype=bool)
        sim_ttft = with_outside_router(result.ttft_s, c, rng)[timed]
        live_ttft = ttfts(e["result"])
        live.setdefault(config, []).extend(live_ttft)
        sim.setdefault(config, []).extend(sim_ttft.tolist())
        runs.append({"run": run_label(e), "configuration": config, "policy": policy, "pool": pool,
                     "requests": len(trace), "replayed_untimed": int((~timed).sum()), "costs": _costs_row(c),
                     "costs_from": config if config in costs else "fallback",
                     "live_ttft_s": summarize(live_ttft), "sim_ttft_s": summarize(sim_ttft),
                     "sim_decisions": result.decisions, "sim_hit_rate_by_tier": result.hit_rate_by_tier()})

    configs = []
    for config in live:
        lv, sv = summarize(live[config]), summarize(sim[config])
        p50_ratio = sv["p50"] / lv["p50"] if lv["p50"] else None
        mean_ratio = sv["mean"] / lv["mean"] if lv["mean"] else None
        configs.append({"configuration": config, "live": lv, "sim": sv, "sim_over_live_p50": p50_ratio,
                        "sim_over_live_mean": mean_ratio,
                        "p50_within": p50_ratio is not None and abs(p50_ratio - 1.0) <= TOLERANCE})
    live_order = [c["configuration"] for c in sorted(configs, key=lambda c: c["live"]["p50"])]
    sim_order = [c["configuration"] for c in sorted(configs, key=lambda c: c["sim"]["p50"])]
    separated = [(a, b) for a in configs for b in configs if a["live"]["p50"] * (1 + ORDER_BAND) < b["live"]["p50"]]
    return {"schema": "kvstack.sim_live/v1", "work_dir": str(work), "tolerance": TOLERANCE,
            "cluster": {"nodes": nodes, "replicas_per_node": replicas_per_node, "hbm_tokens": hbm_tokens,
                        "pool_dram_tokens": pool_dram, "block_size": settings["block_size"],
                        "model_spec": settings["model_spec"], "gpu_profile": settings["gpu_profile"],
                        "kv_admission": kv_admission,
                        "engine_cost": None if engine_cost is None else engine_cost.to_json()},
            "configurations": configs, "live_order_by_p50": live_order, "sim_order_by_p50": sim_order,
            "same_order": live_order == sim_order, "order_band": ORDER_BAND,
            "same_order_beyond_band": all(a["sim"]["p50"] < b["sim"]["p50"] for a, b in separated),
            "all_p50_within": all(c["p50_within"] for c in configs),
            "runs": runs}


def _engine_line(engine: Mapping[str, Any] | None) -> str:
    if not engine:
        return "the simulated prefills take what that fit says (no busy-period fit)"
    return (f"the simulated prefills take what the engines' {engine['busy_periods']} busy periods say "
            f"({engine['per_token_s'] * 1e3:.3g} ms per token + {engine['per_token_sq_s'] * 1e9:.3g} ns per "
            f"token² of attention, `bench.engine_fit`)")


def render(doc: Mapping[str, Any]) -> str:
    def f(v: Any) -> str:
        return "–" if v is None else f"{v:.3f}"

    cl = doc["cluster"]
    lines = ["# The simulator against the live run", "",
             f"Work dir `{doc['work_dir']}`; simulated cluster: {cl['nodes']} nodes × {cl['replicas_per_node']} "
             f"replica(s), {cl['hbm_tokens']:.0f} KV tokens per replica (its prefix cache, and what admits a prompt"
             f"{'' if cl.get('kv_admission') else ': not modelled'}), pool DRAM {cl['pool_dram_tokens']:.0f} "
             f"tokens per node, block {cl['block_size']}, model `{cl['model_spec']}` on `{cl['gpu_profile']}`, "
             f"priced by the policies with the MFU, attention scale and per-prefill cost the router fits, fitted to "
             f"every configuration's live prefills together; {_engine_line(cl.get('engine_cost'))}; the time outside "
             f"the router's view drawn per request from the configuration's own run.", "",
             "| configuration | live p50 | sim p50 | sim/live p50 | live mean | sim mean | sim/live mean | within "
             f"{doc['tolerance']:.0%} |", "|---|---|---|---|---|---|---|---|"]
    for c in doc["configurations"]:
        lines.append(f"| {c['configuration']} | {f(c['live']['p50'])} | {f(c['sim']['p50'])} | "
                     f"{f(c['sim_over_live_p50'])} | {f(c['live']['mean'])} | {f(c['sim']['mean'])} | "
                     f"{f(c['sim_over_live_mean'])} | {'yes' if c['p50_within'] else 'no'} |")
    lines += ["", f"Order by p50, live: {', '.join(doc['live_order_by_p50'])}; simulated: "
              f"{', '.join(doc['sim_order_by_p50'])} ({'same' if doc['same_order'] else 'different'}; on the pairs "
              f"live separates by more than {doc['order_band']:.0%}: "
              f"{'same' if doc['same_order_beyond_band'] else 'different'}).", "",
              "Per run (costs fitted from the configuration's first run's decision records):", ""]
    for r in doc["runs"]:
        c = r["costs"] or {}
        peak = c.get("peak_tflops") or float("nan")
        lines.append(f"- {r['run']}: {r['requests']} requests; MFU {c.get('mfu', float('nan')):.2e} of {peak:.3g} "
                     f"TFLOPS, attention scale {c.get('attn_scale', 1.0):.2f}, per prefill "
                     f"{c.get('prefill_overhead_s', 0.0):.3f} s (pool calls {c.get('pool_calls_s', 0.0):.3f} s), "
                     f"per request {c.get('request_overhead_s', 0.0):.3f} s plus the time outside the router "
                     f"(median {c.get('outside_router_s', 0.0):.3f} s, {c.get('outside_router_gaps', 0)} drawn from) "
                     f"({r['costs_from']}); sim decisions "
                     f"{r['sim_decisions']}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        doc = simulate_run(args.work_dir.resolve(), nodes=args.nodes, replicas_per_node=args.replicas_per_node,
                           pool_tokens=args.pool_tokens, kv_admission=args.kv_admission,
                           engine_fit=args.engine_fit)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvstack bench sim-live: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=2, sort_keys=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim_live.json").write_text(text + "\n")
        (args.out / "sim_live.md").write_text(render(doc))
    if args.json:
        print_document(text)
    else:
        print(render(doc), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_live", description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
