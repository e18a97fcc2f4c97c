"""``kvstack bench vllm-compare``: vLLM's own load generator against each configuration, side by side.

    kvstack bench vllm-compare --configs ray_serve_llm,prefix_affinity-nopool,round_robin,cost_based --repeats 2 \\
        --out bench/reports/vllm_bench_serve [--serve-set KEY=VALUE ...] \\
        -- --dataset-name prefix_repetition --prefix-repetition-num-prefixes 16 --num-prompts 64 --request-rate 1

The outside oracle next to ``bench.live_compare`` (which drives every configuration with kvstack's own agent load
generator): the load and the TTFT here are measured by ``vllm bench serve`` — vLLM's code, its datasets, its
clock — through ``bench.vllm_bench_serve``. Configurations are named as in ``bench.live_compare`` (Ray Serve LLM's
app, ``POLICY`` = ``kvstack serve --policy POLICY`` with the pool, ``POLICY-nopool`` without, ``NAME@KEY=VALUE`` with a
serve override of its own: ``bench.bench_configs``) and started by the same
``serve_command``; one fresh server per configuration and repeat, interleaved (odd rounds in order, even rounds
reversed), warmed up and — kvstack — its replicas' prefix caches emptied before the run. Every argument after
``--`` is ``vllm bench serve``'s; this adds the endpoint, model, tokenizer and ``--save-result --save-detailed`` (every
request's TTFT and text come back). Greedy outputs are compared across configurations per prompt (vLLM's default
sampling in this bench is greedy unless ``--temperature`` is given).

Writes, under ``--out``: ``results.json`` (per run: vLLM's summary without the per-request lists, the server's
start and stop; per configuration: the TTFT summary over every repeat's requests; the subject's ratios with
bootstrap 95% intervals, ``bench.stats.ratio_with_ci``) and ``report.md``. Raw vLLM reports and server logs stay in
``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import decision_audit
from bench.bench_configs import check_configs
from bench.host import describe_host
from bench.live_compare import (
    DEFAULT_SERVE_SET,
    REPO,
    fetch_decisions,
    is_kvstack,
    run_order,
    serve_command,
    stop_server,
    warm_up,
)
from bench.serve_process import ServerProcess, log_contains, scheduling_facts, scheduling_line
from bench.stats import ratio_with_ci, summarize
from cluster.local_cluster import free_port

RESULT_FILE = "vllm_bench.json"
PER_REQUEST = ("ttfts", "itls", "input_lens", "output_lens", "start_times", "generated_texts", "errors", "latencies",
               "queue_times")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="ray_serve_llm,prefix_affinity-nopool,round_robin,cost_based",
                        help="comma-separated configurations (as bench.live_compare names them), run in this order")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved")
    parser.add_argument("--subject", default="cost_based", help="ratios are subject / each other configuration")
    parser.add_argument("--out", type=Path, default=REPO / "bench/reports/vllm_bench_serve")
    parser.add_argument("--work-dir", type=Path, default=None, help="logs and raw reports (default .kvstack/...)")
    parser.add_argument("--serve-set", action="append", default=None, metavar="KEY=VALUE",
                        help="kvstack serve --set overrides, for every configuration (default: the heavy tiny model)")
    parser.add_argument("--warmup-requests", type=int, default=4)
    parser.add_argument("--ready-timeout-s", type=float, default=720.0)
    parser.add_argument("--stop-timeout-s", type=float, default=180.0)
    parser.add_argument("--bench-timeout-s", type=float, default=1800.0, help="one vllm bench serve run, at most")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vllm bench serve's own arguments")


def bench_argv(port: int, model: str, tokenizer: Path, out_dir: Path, vllm_args: list[str]) -> list[str]:
    """``python -m bench.vllm_bench_serve`` against one server: the endpoint, model and result file, then the
    user's dataset and load arguments."""
    return [sys.executable, "-m", "bench.vllm_bench_serve", "--backend", "openai-chat",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions", "--model", model,
            "--tokenizer", str(tokenizer), "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", RESULT_FILE, "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", *vllm_args]


def run_config(args: argparse.Namespace, config: str, repeat: int, work: Path, serve_set: list[str], model: str,
               tokenizer: Path) -> dict[str, Any]:
    """Serve, warm up, ``vllm bench serve``, stop — one configuration once. Its entry (``error`` on failure)."""
    rdir = work / f"{config}#{repeat}"
    rdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = ServerProcess(f"{config} #{repeat}", serve_command(config, port, serve_set, rdir), rdir / "serve.log",
                           cwd=REPO)
    entry: dict[str, Any] = {"config": config, "repeat": repeat, "load_avg_before": list(os.getloadavg())}
    try:
        print(f"[vllm-compare] {config} #{repeat}: starting on :{port}", file=sys.stderr, flush=True)
        server.start()
        server.wait_ready(log_contains(rdir / "serve.log", "is serving"), args.ready_timeout_s)
        entry["scheduling"] = scheduling_facts(server.proc.pid if server.proc else None)
        entry["warmup"] = warm_up(f"http://127.0.0.1:{port}/v1", model, args.warmup_requests,
                                  reset=is_kvstack(config))
        time.sleep(2.0)  # the routers see the emptied caches
        argv = bench_argv(port, model, tokenizer, rdir, args.vllm_args)
        entry["command"] = argv
        with open(rdir / "bench.log", "wb") as log:
            proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.bench_timeout_s)
        entry["bench_exit_code"] = proc.returncode
        raw = json.loads((rdir / RESULT_FILE).read_text())
        entry["result"] = raw
        if is_kvstack(config):  # the router's records of this run's requests: actions, reuse, prediction error
            entry["decisions"] = fetch_decisions(f"http://127.0.0.1:{port}/v1", len(raw.get("ttfts") or []),
                                                 rdir / "decisions.json")
        print(f"[vllm-compare] {config} #{repeat}: {raw.get('completed')} completed, {raw.get('failed')} failed, "
              f"TTFT median {raw.get('median_ttft_ms')} ms", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - one run's failure is recorded; the next still runs
        entry["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        print(f"[vllm-compare] {config} #{repeat}: FAILED {entry['error'][:500]}", file=sys.stderr, flush=True)
    finally:
        entry["server"] = stop_server(server, rdir, args.stop_timeout_s)
        entry["load_avg_after"] = list(os.getloadavg())
    return entry


def aggregate(entries: list[dict[str, Any]], subject: str) -> dict[str, Any]:
    """Per configuration, every repeat's successful requests pooled: TTFT summary (seconds), decode summaries
    (``decode_times``), failures, output throughput per run; the subject's TTFT ratios (p50, p90, p99, mean)
    against each other configuration, with bootstrap intervals; greedy outputs of each configuration against the
    first configuration's, per prompt."""
    ttft: dict[str, list[float]] = {}
    decode: dict[str, dict[str, list[float]]] = {}
    texts: dict[str, dict[int, str]] = {}
    runs: list[dict[str, Any]] = []
    for e in entries:
        cfg, res = e["config"], e.get("result") or {}
        times = res.get("ttfts") or []
        errors = res.get("errors") or [""] * len(times)
        ok = [t for t, err in zip(times, errors, strict=True) if not err and t is not None and t > 0]
        ttft.setdefault(cfg, []).extend(ok)
        for key, values in decode_times(res).items():
            decode.setdefault(cfg, {}).setdefault(key, []).extend(values)
        if res.get("generated_texts") and cfg not in texts:
            texts[cfg] = dict(enumerate(res["generated_texts"]))
        runs.append({"config": cfg, "repeat": e["repeat"], "error": e.get("error"),
                     "completed": res.get("completed"), "failed": res.get("failed"),
                     "output_throughput": res.get("output_throughput"), "duration_s": res.get("duration"),
                     "median_ttft_ms": res.get("median_ttft_ms"), "p99_ttft_ms": res.get("p99_ttft_ms"),
                     "load_avg": [e.get("load_avg_before", [None])[0], e.get("load_avg_after", [None])[0]],
                     "decisions": _decision_line(e.get("decisions")), "scheduling": e.get("scheduling")})
    configs = list(dict.fromkeys(e["config"] for e in entries))
    summary = {c: summarize(ttft.get(c, [])) for c in configs}
    ratios: dict[str, dict[str, Any]] = {}
    if subject in ttft:
        for other in configs:
            if other == subject or not ttft.get(other):
                continue
            row = {f"p{q}": ratio_with_ci(ttft[subject], ttft[other], q) for q in (50, 90, 99)}
            mean_o = sum(ttft[other]) / len(ttft[other])
            row["mean"] = (sum(ttft[subject]) / len(ttft[subject])) / mean_o if mean_o > 0 else None
            ratios[other] = row
    outputs: dict[str, dict[str, int]] = {}
    if configs and configs[0] in texts:
        ref = texts[configs[0]]
        for c in configs[1:]:
            if c in texts:
                both = [i for i in ref if i in texts[c]]
                outputs[c] = {"compared": len(both), "equal": sum(ref[i] == texts[c][i] for i in both)}
    decode_s = {c: {k: summarize(v) for k, v in decode.get(c, {}).items()} for c in configs}
    return {"configs": configs, "ttft_s": summary, "decode_s": decode_s, "ratios": ratios, "runs": runs,
            "outputs_vs_first": {"first": configs[0] if configs else None, **outputs}}


def decode_times(res: dict[str, Any]) -> dict[str, list[float]]:
    """One run's successful requests, from vLLM's detailed result: ``tpot`` (seconds per output token after the
    first, vLLM's own definition), ``itl`` (every gap between two stream chunks the client received; tokens that
    came in one chunk have none between them) and ``e2el`` (the whole request)."""
    out: dict[str, list[float]] = {"tpot": [], "itl": [], "e2el": []}
    ttfts, lats = res.get("ttfts") or [], res.get("latencies") or []
    lens, itls = res.get("output_lens") or [], res.get("itls") or []
    errors = res.get("errors") or [""] * len(ttfts)
    for i, err in enumerate(errors):
        if err or i >= min(len(ttfts), len(lats), len(lens)) or not lats[i]:
            continue
        out["e2el"].append(lats[i])
        if lens[i] > 1:
            out["tpot"].append((lats[i] - ttfts[i]) / (lens[i] - 1))
        if i < len(itls):
            out["itl"].extend(itls[i] or [])
    return out


def _decision_line(audit: dict[str, Any] | None) -> str | None:
    """One run's decision audit (``bench.decision_audit.summarize``) in a line: requests per action after warm-up
    with their median |predicted − actual| / actual, the reused share of prompt tokens, the plan check."""
    if not audit:
        return None
    if "error" in audit:
        return f"no decision records ({audit['error'][:80]})"
    rel = audit.get("relative_error") or {}
    acts = ", ".join(f"{a} {v['n']} (err {_f(v['p50'], '.2f')})" for a, v in rel.items() if a != "all" and v["n"])
    plan = audit.get("plan_check") or {}
    reused = audit.get("reused_token_fraction")
    return (f"{acts}; reused {_f(None if reused is None else 100 * reused, '.0f')}% of prompt tokens; plan = "
            f"engine on {plan.get('equal', 0)}/{plan.get('compared', 0)}")


def _f(v: Any, fmt: str = ".3f") -> str:
    return "–" if v is None else format(v, fmt)


def render_report(meta: dict[str, Any], agg: dict[str, Any]) -> str:
    lines = [
        "# `vllm bench serve` against each configuration", "",
        f"Run {meta['started_utc']} on {meta['host']}, wall {_f(meta.get('wall_s'), '.0f')} s. Model "
        f"`{meta['model']}`. One fresh server per run, in the order "
        f"{', '.join(f'{c} #{r}' for r, c in meta['run_order'])}. The load and every TTFT are vLLM's own "
        "(`vllm.benchmarks.serve` through `bench.vllm_bench_serve`).", "",
        "Command:", "", "```", meta["command"], "```", "",
        scheduling_line([r["scheduling"] for r in agg["runs"] if r.get("scheduling")]), "",
        "## TTFT per configuration (every repeat's successful requests pooled)", "",
        "| configuration | n | p50 s | p90 | p99 | mean |", "|---|---|---|---|---|---|",
    ]
    for c in agg["configs"]:
        s = agg["ttft_s"][c]
        lines.append(f"| {c} | {s['n']} | {_f(s['p50'])} | {_f(s['p90'])} | {_f(s['p99'])} | {_f(s['mean'])} |")
    if any(d.get("tpot", {}).get("n") for d in agg.get("decode_s", {}).values()):  # a request was measured
        lines += ["", "## Decode per configuration (seconds; every repeat's successful requests pooled)", "",
                  "TPOT: per request, (latency − TTFT) / (output tokens − 1). ITL: every gap between two chunks "
                  "the client received.", "",
                  "| configuration | TPOT p50 | p90 | p99 | ITL p50 | p99 | chunk gaps | E2E latency p50 | p99 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in agg["configs"]:
            d = agg["decode_s"].get(c) or {}
            t, i, e = d.get("tpot", {}), d.get("itl", {}), d.get("e2el", {})
            lines.append(f"| {c} | {_f(t.get('p50'), '.4f')} | {_f(t.get('p90'), '.4f')} | "
                         f"{_f(t.get('p99'), '.4f')} | {_f(i.get('p50'), '.4f')} | {_f(i.get('p99'), '.4f')} | "
                         f"{i.get('n', 0)} | {_f(e.get('p50'))} | {_f(e.get('p99'))} |")
    lines += ["", "## Runs", "", "| run | completed | failed | TTFT median ms | p99 ms | output tok/s | load avg "
              "before→after | error |", "|---|---|---|---|---|---|---|---|"]
    for r in agg["runs"]:
        la = r["load_avg"]
        lines.append(f"| {r['config']} #{r['repeat']} | {r['completed']} | {r['failed']} | "
                     f"{_f(r['median_ttft_ms'], '.1f')} | {_f(r['p99_ttft_ms'], '.1f')} | "
                     f"{_f(r['output_throughput'], '.1f')} | {_f(la[0], '.1f')}→{_f(la[1], '.1f')} | "
                     f"{(r['error'] or '')[:120]} |")
    audits = [r for r in agg["runs"] if r.get("decisions")]
    if audits:
        lines += ["", f"Decisions (`/kvstack/decisions`, the run's requests; after the first "
                  f"{decision_audit.DEFAULT_WARMUP}, `bench.decision_audit`):", ""]
        lines += [f"- {r['config']} #{r['repeat']}: {r['decisions']}" for r in audits]
    if agg["ratios"]:
        lines += ["", f"## Ratios: {meta['subject']} / each (bootstrap 95% interval; < 1: {meta['subject']} faster)",
                  "", "| vs | TTFT p50 | p90 | p99 | mean |", "|---|---|---|---|---|"]
        for other, row in agg["ratios"].items():
            cells = [f"{_f(row[k]['ratio'], '.2f')}× [{_f(row[k]['ci_low'], '.2f')}, {_f(row[k]['ci_high'], '.2f')}]"
                     for k in ("p50", "p90", "p99")]
            lines.append(f"| {other} | {' | '.join(cells)} | {_f(row['mean'], '.2f')}× |")
    out = agg["outputs_vs_first"]
    if len(out) > 1:
        lines += ["", f"Greedy outputs per prompt against {out['first']}'s first run: " + "; ".join(
            f"{c} {v['equal']}/{v['compared']} equal" for c, v in out.items() if c != "first") + "."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides

    vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else list(args.vllm_args)
    args.vllm_args = vllm_args
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or args.repeats < 1:
        print("vllm_bench_compare: need at least one configuration and --repeats >= 1", file=sys.stderr)
        return 2
    serve_set = list(args.serve_set) if args.serve_set else list(DEFAULT_SERVE_SET)
    try:
        cfg = load_serve_config(DEFAULT_CONFIG, parse_overrides(serve_set))
        check_configs(configs, serve_set)
    except Exception as exc:  # noqa: BLE001 - a config error is a usage error
        print(f"vllm_bench_compare: bad serve config: {exc}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = (args.work_dir or REPO / ".kvstack/vllm_compare" / stamp).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = cfg.app.engine.served_model_name, REPO / cfg.app.engine.model_path
    order = run_order(configs, args.repeats)
    meta = {"schema": "kvstack.bench.vllm_compare/v1", "started_utc": stamp, "host": describe_host(),
            "model": model, "configs": configs, "subject": args.subject, "run_order": order,
            "serve_set": serve_set, "vllm_args": vllm_args, "work_dir": str(work),
            "command": " ".join([Path(sys.executable).name, "-m", "bench.vllm_bench_compare", *sys.argv[1:]])}
    t0 = time.monotonic()
    entries = []
    for repeat, config in order:
        entries.append(run_config(args, config, repeat, work, serve_set, model, tokenizer))
        (work / "entries.json").write_text(json.dumps(entries, indent=1, sort_keys=True))
    meta["wall_s"] = time.monotonic() - t0
    agg = aggregate(entries, args.subject)
    args.out.mkdir(parents=True, exist_ok=True)
    slim = [{**e, "result": {k: v for k, v in (e.get("result") or {}).items() if k not in PER_REQUEST}}
            for e in entries]
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "aggregate": agg, "runs": slim}, indent=1,
                                                      sort_keys=True))
    (args.out / "report.md").write_text(render_report(meta, agg))
    print(f"[vllm-compare] wrote {args.out / 'report.md'} ({meta['wall_s']:.0f} s)", file=sys.stderr)
    return 0 if all(e.get("result") and not e["result"].get("failed") for e in entries) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_bench_compare", description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
