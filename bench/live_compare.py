"""Live comparison: one fresh server per configuration, the same ``kvstack bench agent`` run against each.

    flock /tmp/kvstack-heavy.lock timeout -k 300 4800 .venv/bin/python -m bench.live_compare \\
        --out bench/reports/live_agent_compare
    .venv/bin/python -m bench.live_compare --dry-run     # validate the config, size the prompts; starts nothing

Configurations (``--configs``, default ``ray_serve_llm,prefix_affinity-nopool,round_robin,cost_based``):
``ray_serve_llm`` is Ray Serve LLM's own OpenAI app with its ``PrefixCacheAffinityRouter`` over the same engine
arguments (``bench.ray_serve_llm``: the anchor a user would pick instead); ``POLICY`` is ``kvstack serve --policy
POLICY`` with the KV pool; ``POLICY-nopool`` the same with the pool off. Each runs ``--repeats`` times (default 2),
interleaved: the first round in the given order, the second reversed. Per run: start the server on a free port
with the heavy tiny model (``--serve-set`` overrides, applied to every configuration; fresh SSD dir and state file
under ``--work-dir``), wait for "is serving" (bounded), send a few unrelated warm-up requests and (kvstack) reset
the replicas' prefix caches, run ``kvstack bench agent`` as a subprocess (bounded) with ``--save-requests``, save
the run's ``/kvstack/decisions`` records (kvstack), SIGTERM the server and wait for it to exit (bounded; then
SIGKILL of its own process group), check that no process of its session is left, and remove its SSD dir (~1 GiB
per shard). Then aggregate: TTFT p50/p90/p99 per run and per configuration (its runs pooled), ``--subject`` /
other ratios of p50 and p99 with bootstrap 95% intervals (sessions resampled: a session's requests share a
prefix and a replica), decisions by action and hit tokens
by tier (the router's ``/metrics`` deltas the agent bench recorded), requests per replica from the decision audit,
and the greedy outputs of every run against the first run's (same session, turn and prompt length). Writes
``report.md``, ``results.json`` and the plots (kept only under 200 KB) into ``--out``; raw per-run results and
server logs stay under ``--work-dir``; ``--from-work-dir`` re-renders a report from them.

Called by hand or as ``kvstack bench live-compare`` (issue 13's live check). Every wait has a deadline;
SIGTERM/SIGINT of this process stops the running server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import decision_audit
from bench.bench_configs import ANCHOR, NO_POOL, check_configs, parse_config
from bench.host import describe_host
from bench.serve_process import (ServerProcess, log_contains, new_ray_like_processes, scheduling_facts,
                                 scheduling_line)
from bench.stats import ratio_with_ci, summarize
from cluster.local_cluster import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_POLICIES = f"{ANCHOR},prefix_affinity{NO_POOL},round_robin,cost_based"
HEAVY_MODEL = "tiny-qwen3-heavy"
DEFAULT_SERVE_SET = (
    "tiny_model.preset=heavy",
    f"app.engine.model=.kvstack/models/{HEAVY_MODEL}",
    f"app.engine.served_model_name={HEAVY_MODEL}",
    f"app.router.model_spec={HEAVY_MODEL}",
)
# Sized for a loaded 2-core box: ~1.6k-token shared prefix (3 variants), 3-5 turns of ~80-400 new tokens each,
# about 2 sessions in flight, ~0.3 requests/s; contexts stay under 4k tokens (max_model_len 4096).
WORKLOAD_DEFAULTS: dict[str, Any] = {
    "sessions_per_s": 0.08,
    "system_prompt_variants": 3,
    "system_prompt_words": 400,
    "tools": 2,
    "tool_description_words": 24,
    "turns_min": 3,
    "turns_max": 5,
    "user_words": 24,
    "tool_result_words": 120,
    "tool_result_fraction": 0.6,
    "think_time_s": 3.0,
    "max_output_tokens": 16,
    "seed": 0,
    "max_sessions": 0,
}
# AgentWorkload-shaped args of ``kvstack bench agent`` (dest -> flag), passed through unchanged.
AGENT_FLAGS: dict[str, str] = {
    "sessions_per_s": "--sessions-per-s",
    "system_prompt_variants": "--system-prompt-variants",
    "system_prompt_words": "--system-prompt-words",
    "tools": "--tools",
    "tool_description_words": "--tool-description-words",
    "turns_min": "--turns-min",
    "turns_max": "--turns-max",
    "user_words": "--user-words",
    "tool_result_words": "--tool-result-words",
    "tool_result_fraction": "--tool-result-fraction",
    "think_time_s": "--think-time-s",
    "max_output_tokens": "--max-output-tokens",
    "seed": "--seed",
    "max_sessions": "--max-sessions",
    "tools_mode": "--tools-mode",
    "max_concurrent_sessions": "--max-concurrent-sessions",
    "max_requests": "--max-requests",
    "duration_s": "--duration-s",
    "request_timeout_s": "--request-timeout-s",
}
PLOT_LIMIT_BYTES = 200 * 1024


class Interrupted(BaseException):
    """SIGTERM / SIGINT arrived: stop the running server and write what was measured (not an ``Exception``, so a
    per-policy failure handler does not swallow it)."""


def configure(parser: argparse.ArgumentParser) -> None:
    from bench.agent_cli import add_workload_args

    parser.add_argument("--configs", "--policies", dest="policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated configurations, run in this order: {ANCHOR} (Ray Serve LLM), a kvstack "
                             f"routing policy (pool on), or POLICY{NO_POOL} (pool off); NAME@KEY=VALUE adds a serve "
                             f"override of that configuration's own (bench.bench_configs)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="run every configuration this many times, interleaved: odd rounds in the given order, "
                             "even rounds reversed")
    parser.add_argument("--subject", default="cost_based", help="ratios are subject / each other policy")
    parser.add_argument("--out", type=Path, default=REPO / "bench/reports/live_agent_compare",
                        help="report directory (report.md, results.json, small PNGs)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="logs, raw per-policy results, SSD dirs (default .kvstack/live_compare/<time>)")
    parser.add_argument("--serve-set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"kvstack serve --set overrides (default, the heavy tiny model: {list(DEFAULT_SERVE_SET)})"
                        )
    parser.add_argument("--ready-timeout-s", type=float, default=720.0, help="wait for 'is serving' at most this")
    parser.add_argument("--stop-timeout-s", type=float, default=180.0, help="wait for serve to exit at most this")
    parser.add_argument("--warmup-requests", type=int, default=4, help="unrelated requests before each run")
    parser.add_argument("--dry-run", action="store_true", help="validate and size the workload; start nothing")
    parser.add_argument("--from-work-dir", type=Path, default=None,
                        help="rebuild report.md/results.json from a previous run's work dir; start nothing")
    add_workload_args(parser)
    g = parser.add_argument_group("agent run")
    g.add_argument("--tools-mode", choices=["tools", "user"], default="tools",
                   help="tools (default): OpenAI `tools` and tool-role results, as agent frameworks send them (every "
                        "configuration serves them with the config's tool parser); user: tool definitions in the "
                        "system prompt, as the reports before issue 13's item 3 ran it")
    g.add_argument("--max-concurrent-sessions", type=int, default=0,
                   help="0 (default): the concurrent variant, Poisson session arrivals; 1: the sequential variant, "
                        "one session after another (each waits for its arrival time and the previous session's end)")
    g.add_argument("--max-requests", type=int, default=80)
    g.add_argument("--duration-s", type=float, default=210.0)
    g.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.set_defaults(**WORKLOAD_DEFAULTS)


# ------------------------------------------------------------------------------------------- processes
def serve_command(config: str, port: int, serve_set: list[str], work: Path) -> list[str]:
    """The server of one configuration on ``port``: Ray Serve LLM's app (``ANCHOR``) or ``kvstack serve`` with the
    policy (and ``-nopool``: the pool off), its state file and SSD dir under ``work``. Both print "is serving"."""
    spec = parse_config(config)
    if spec.anchor:
        cmd = [sys.executable, "-m", "bench.ray_serve_llm", "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--policy", spec.policy, "--port", str(port),
               "--state-file", str(work / "serve.json"), "--set", f"app.pool.ssd_dir={work / 'ssd'}",
               "--log-dir", str(work / "logs")]
        if not spec.pool:
            cmd += ["--set", "app.pool.enabled=false"]
    for item in [*serve_set, *spec.overrides]:  # the configuration's own overrides last: they win
        cmd += ["--set", item]
    return cmd


def is_kvstack(config: str) -> bool:
    return parse_config(config).kvstack


def run_order(configs: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, configuration) in run order: round 1 as given, round 2 reversed, and so on (interleaved, so a drift
    of the machine's speed does not favour one configuration)."""
    out: list[tuple[int, str]] = []
    for r in range(repeats):
        out += [(r + 1, c) for c in (configs if r % 2 == 0 else configs[::-1])]
    return out


def warm_up(endpoint: str, model: str, n: int, *, reset: bool = True) -> dict[str, Any]:
    """``n`` unrelated requests (two at a time, so both replicas see some), then (``reset``: kvstack) drop every
    replica's HBM cache."""
    import concurrent.futures

    import httpx

    def one(i: int) -> float:
        body = {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"warm up {i}: " + "lorem ipsum dolor " * (40 * (i % 3 + 1))}]}
        t = time.monotonic()
        r = httpx.post(endpoint + "/chat/completions", json=body, timeout=180)
        r.raise_for_status()
        return time.monotonic() - t

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        times = list(pool.map(one, range(n)))
    if not reset:
        return {"requests": n, "seconds": times, "prefix_cache_reset_ok": None}
    resp = httpx.post(endpoint[: -len("/v1")] + "/kvstack/admin/reset_prefix_cache", timeout=120)
    ok = resp.status_code == 200 and all(r.get("ok") for r in resp.json())
    return {"requests": n, "seconds": times, "prefix_cache_reset_ok": ok}


def fetch_decisions(endpoint: str, n: int, path: Path, requests: list[dict[str, Any]] | None = None
                    ) -> dict[str, Any]:
    """The router's newest ``n`` decision records (the run's, when ``n`` is the run's decision count), saved to
    ``path``, summarised by ``bench.decision_audit.summarize``. Never fatal: a failure is recorded instead."""
    import httpx

    try:
        resp = httpx.get(endpoint[: -len("/v1")] + "/kvstack/decisions", params={"limit": max(n, 1)}, timeout=60)
        resp.raise_for_status()
        records = resp.json()
        if not isinstance(records, list):
            raise ValueError(f"/kvstack/decisions returned {type(records).__name__}, not a list")
    except Exception as exc:  # noqa: BLE001 - a missing audit must not lose the run
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    records = sorted(records, key=lambda r: r.get("decided_at", 0.0))[-n:] if n > 0 else []
    path.write_text(json.dumps(records, indent=1, sort_keys=True))
    return decision_audit.summarize(records, requests=requests)


def agent_argv(args: argparse.Namespace, endpoint: str, label: str, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "cluster.cli", "bench", "agent", "--endpoint", endpoint, "--label", label,
            "--out", str(out), "--save-requests", "--no-progress"]
    for dest, flag in AGENT_FLAGS.items():
        argv += [flag, str(getattr(args, dest))]
    return argv


def run_dir(work: Path, policy: str, repeat: int) -> Path:
    """Where one run of a configuration keeps its logs, raw results and decision records."""
    return work / (policy if repeat == 1 else f"{policy}#{repeat}")


def stop_server(server: ServerProcess, rdir: Path, deadline_s: float) -> dict[str, Any]:
    """Stop one run's server (its whole session) and return its summary. Once it is gone, its pool shards' SSD
    tier files (``serve_command`` puts them under ``rdir``; preallocated, ~1 GiB per shard) go too: they outlive
    the server and are not worth keeping."""
    server.stop(deadline_s, reap=True)
    if not server.running():
        shutil.rmtree(rdir / "ssd", ignore_errors=True)
    return server.summary()


def run_policy(args: argparse.Namespace, policy: str, work: Path, serve_set: list[str], model: str,
               repeat: int = 1, repeats: int = 1) -> dict[str, Any]:
    """Serve, warm up, bench, stop — for one configuration. Returns its entry for results.json (``error`` on
    failure)."""
    import psutil

    pdir = run_dir(work, policy, repeat)
    pdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/v1"
    serve_log = pdir / "serve.log"
    server = ServerProcess(f"{policy} #{repeat}", serve_command(policy, port, serve_set, pdir), serve_log, cwd=REPO)
    entry: dict[str, Any] = {"policy": policy, "repeat": repeat, "repeats": repeats,
                             "load_avg_before": list(os.getloadavg())}
    pids_before = set(psutil.pids())
    t0 = time.monotonic()
    try:
        print(f"[live-compare] {policy} #{repeat}: starting on :{port}", file=sys.stderr, flush=True)
        server.start()
        server.wait_ready(log_contains(serve_log, "is serving"), args.ready_timeout_s)
        entry["scheduling"] = scheduling_facts(server.proc.pid if server.proc else None)
        print(f"[live-compare] {policy}: serving after {server.ready_s:.0f} s; warming up", file=sys.stderr, flush=True)
        entry["warmup"] = warm_up(endpoint, model, args.warmup_requests, reset=is_kvstack(policy))
        time.sleep(2.0)  # let the routers see the emptied caches
        argv = agent_argv(args, endpoint, policy, pdir / "agent")
        entry["agent_command"] = argv
        t_bench = time.monotonic()
        with open(pdir / "agent.log", "wb") as log:
            proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.duration_s + args.request_timeout_s + 120.0)
        entry["bench_wall_s"] = time.monotonic() - t_bench
        entry["agent_exit_code"] = proc.returncode
        result_file = pdir / "agent" / "result.json"
        if not result_file.exists():
            raise RuntimeError(f"bench agent wrote no result (exit {proc.returncode}); see {pdir / 'agent.log'}")
        entry["result"] = json.loads(result_file.read_text())
        if is_kvstack(policy):
            n_decisions = int(sum((entry["result"].get("router") or {}).get("decisions_by_action", {}).values()))
            entry["decisions"] = fetch_decisions(endpoint, n_decisions, pdir / "decisions.json",
                                                 entry["result"].get("request_log"))
        print(f"[live-compare] {policy}: {entry['result']['requests']} TTFT p50 "
              f"{entry['result']['ttft_s']['p50']}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - one policy's failure is recorded; the next policy still runs
        entry["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        print(f"[live-compare] {policy}: FAILED {entry['error'][:500]}", file=sys.stderr, flush=True)
    finally:
        entry["server"] = {"port": port, **stop_server(server, pdir, args.stop_timeout_s)}
        entry["new_ray_like_processes_after_stop"] = new_ray_like_processes(pids_before)
        entry["load_avg_after"] = list(os.getloadavg())
        entry["wall_s"] = time.monotonic() - t0
        if server.leftover_pids:
            print(f"[live-compare] {policy}: killed leftover pids {server.leftover_pids}", file=sys.stderr, flush=True)
    return entry


# ------------------------------------------------------------------------------------------- aggregation
def ttfts(result: dict[str, Any], *, with_cancelled: bool = False) -> list[float]:
    """TTFTs of a ``bench agent`` result saved with ``--save-requests``: the successful requests (the bench's own
    definition) or, ``with_cancelled``, also those cancelled at the run's deadline after their first token (an
    overloaded run cancels its slowest requests, which biases the ok-only tail low)."""
    return [r["ttft_s"] for r in _timed(result, with_cancelled)]


def ttft_sessions(result: dict[str, Any], run: str, *, with_cancelled: bool = False) -> list[str]:
    """The session of each of ``ttfts(result)``'s samples, labelled with its run (a session of one run is not the
    same draw as the same session of another): the groups of the bootstrap over sessions."""
    return [f"{run}:{r.get('session')}" for r in _timed(result, with_cancelled)]


def _by_session(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """The configurations whose every sample knows its session (older logs do not: those resample requests)."""
    return {c: g for c, g in groups.items() if not any(x.endswith(":None") for x in g)}


def is_timed(row: dict[str, Any], *, with_cancelled: bool = False) -> bool:
    """Whether a saved request row counts in the TTFT summaries: a first token, no error, and not cancelled at the
    run's deadline (the bench's own "ok"), or ``with_cancelled`` also one cancelled after its first token."""
    return row.get("ttft_s") is not None and row.get("error") is None and (with_cancelled or not row.get("cancelled"))


def _timed(result: dict[str, Any], with_cancelled: bool) -> list[dict[str, Any]]:
    return [r for r in result.get("request_log", []) if is_timed(r, with_cancelled=with_cancelled)]


def ttft_by_turn(done: list[dict[str, Any]], subject: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Per configuration and turn (0: a session's first request), every run's successful TTFTs pooled: their
    summary and, for every configuration but the subject, subject / it at p50 and mean (no interval: few samples
    per turn). Turn 0 is where the pool can supply at most the shared system prompt: issue 13's first-turn goal."""
    pooled: dict[str, dict[int, list[float]]] = {}
    for e in done:
        for r in _timed(e["result"], False):
            pooled.setdefault(e["policy"], {}).setdefault(int(r.get("turn") or 0), []).append(r["ttft_s"])
    out: dict[str, dict[str, dict[str, Any]]] = {}
    mine = pooled.get(subject, {})
    for config, turns in pooled.items():
        out[config] = {}
        for turn, xs in sorted(turns.items()):
            row = summarize(xs)
            ys = mine.get(turn)
            if config != subject and ys:
                row["subject_ratio_p50"] = float(np.median(ys)) / float(np.median(xs))
                row["subject_ratio_mean"] = float(np.mean(ys)) / float(np.mean(xs))
            out[config][str(turn)] = row
    return out


def _ratios(samples: dict[str, list[float]], subject: str,
            groups: dict[str, list[str]] | None = None) -> dict[str, dict[str, Any]]:
    """subject / every other configuration: p50 and p99 with bootstrap intervals (sessions resampled when
    ``groups`` labels every sample with its session), and the ratio of means."""
    out: dict[str, dict[str, Any]] = {}
    if subject not in samples:
        return out
    g = groups or {}
    for other, xs in samples.items():
        if other != subject:
            mine = samples[subject]
            ci = {"groups_a": g.get(subject), "groups_b": g.get(other)}
            out[f"{subject}/{other}"] = {
                "p50": ratio_with_ci(mine, xs, 50, **ci),
                "p99": ratio_with_ci(mine, xs, 99, **ci),
                "mean": (float(np.mean(mine)) / float(np.mean(xs))) if xs and mine else None,
            }
    return out


def policy_row(entry: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one policy that the report shows (None where the run failed)."""
    r = entry.get("result")
    if r is None:
        return {"policy": run_label(entry), "error": entry.get("error", "no result")}
    router = r.get("router") or {}
    ok_prompts = [x.get("prompt_tokens") or 0 for x in r.get("request_log", []) if is_timed(x)]
    hits = {k: float(v) for k, v in (router.get("hit_tokens_by_tier") or {}).items()}
    decisions = {k: float(v) for k, v in (router.get("decisions_by_action") or {}).items()}
    n_dec = sum(decisions.values())
    return {
        "policy": run_label(entry),
        "configuration": entry["policy"],
        "requests": r["requests"],
        "sessions": r.get("sessions"),
        "ttft_s": r["ttft_s"],
        "tpot_s": r["tpot_s"],
        "e2e_s": r["e2e_s"],
        "throughput": r["throughput"],
        "per_turn": r.get("per_turn", []),
        "decisions_by_action": decisions,
        "hit_tokens_by_tier": hits,
        # Router counters cover every routed request (also those the bench cancelled, whose usage never came), so
        # they are put per decision rather than over the finished requests' prompt tokens.
        "hit_tokens_per_decision": (sum(hits.values()) / n_dec) if n_dec else None,
        "prompt_tokens_per_ok_request": (sum(ok_prompts) / len(ok_prompts)) if ok_prompts else None,
        "decision_audit": entry.get("decisions"),
        "router_metrics_available": bool(router.get("available")),
        "saver": router.get("saver") or {},  # the engines' save counters over the run (bench.prom)
        "errors": r.get("errors"),
        "load_avg_before": entry.get("load_avg_before"),
        "load_avg_after": entry.get("load_avg_after"),
        "server_ready_s": (entry.get("server") or {}).get("ready_s"),
        "bench_wall_s": entry.get("bench_wall_s"),
    }


def run_label(entry: dict[str, Any]) -> str:
    """``config`` when it ran once, ``config #k`` for the k-th of its ``repeats`` runs."""
    return entry["policy"] if entry.get("repeats", 1) == 1 else f"{entry['policy']} #{entry.get('repeat', 1)}"


def outputs_agreement(done: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Greedy outputs of every run against the first run of the first configuration (the anchor by default):
    requests of the same id (session, turn) whose prompt has the same token count, and how many returned the same
    text. A differing turn changes its session's later prompts, which then drop out of the comparison."""
    if not done:
        return {}
    ref = {r.get("request_id"): r for r in done[0]["result"].get("request_log", []) if r.get("text") is not None}
    out: dict[str, dict[str, int]] = {}
    for e in done[1:]:
        compared = equal = 0
        for r in e["result"].get("request_log", []):
            o = ref.get(r.get("request_id"))
            if o is None or r.get("text") is None or r.get("prompt_tokens") != o.get("prompt_tokens"):
                continue
            compared += 1
            equal += r["text"] == o["text"]
        out[f"{run_label(e)} vs {run_label(done[0])}"] = {"compared": compared, "equal": equal}
    return out


def aggregate(entries: list[dict[str, Any]], subject: str) -> dict[str, Any]:
    """Rows per run; TTFT samples, ratios and CDFs per configuration, pooled over its repeats."""
    rows = [policy_row(e) for e in entries]
    done = [e for e in entries if e.get("result")]
    samples: dict[str, list[float]] = {}
    with_cancelled: dict[str, list[float]] = {}
    sessions: dict[str, list[str]] = {}
    sessions_wc: dict[str, list[str]] = {}
    for e in done:
        samples.setdefault(e["policy"], []).extend(ttfts(e["result"]))
        with_cancelled.setdefault(e["policy"], []).extend(ttfts(e["result"], with_cancelled=True))
        sessions.setdefault(e["policy"], []).extend(ttft_sessions(e["result"], run_label(e)))
        sessions_wc.setdefault(e["policy"], []).extend(ttft_sessions(e["result"], run_label(e), with_cancelled=True))
    for row, e in zip(rows, entries, strict=True):
        if e.get("result"):
            log = e["result"].get("request_log", [])
            row["ttft_with_cancelled_s"] = summarize(ttfts(e["result"], with_cancelled=True))
            row["cancelled_before_first_token"] = sum(1 for r in log if r.get("cancelled") and r.get("ttft_s") is None)
    timeline = {run_label(e): [(r["sent_at_s"], r["ttft_s"]) for r in e["result"].get("request_log", [])
                               if r.get("ttft_s") is not None and r.get("error") is None] for e in done}
    # Every kvstack configuration must run on the same engine placement (threads and binding per replica), or the
    # TTFTs compare thread counts, not policies. (The Ray Serve LLM anchor reports none: same thread count, unbound.)
    placements = {run_label(e): sorted((p.get("threads"), p.get("binding"), len(p.get("cores") or []))
                                       for p in e["result"].get("placement") or []) for e in done
                  if is_kvstack(e["policy"])}
    return {"rows": rows, "ratios": _ratios(samples, subject, _by_session(sessions)),
            "ratios_with_cancelled": _ratios(with_cancelled, subject, _by_session(sessions_wc)),
            "ttft_samples": samples,
            "ttft_pooled": {c: summarize(v) for c, v in samples.items()},
            "ttft_by_turn": ttft_by_turn(done, subject),
            "ttft_timeline": timeline, "outputs_agreement": outputs_agreement(done),
            "placement": {run_label(e): e["result"].get("placement") for e in done},
            "same_placement": len({json.dumps(p) for p in placements.values()}) <= 1}


# ------------------------------------------------------------------------------------------- report
def _f(v: Any, fmt: str = ".3f") -> str:
    return "–" if v is None else format(v, fmt)


#: The timeline stages the report shows (``router.decision.RequestTimeline.stages``): the engine's queue (a load
#: from the pool included), its prefill, and what the connector waited on the pool before its read.
REPORT_STAGES = ("engine_wait", "prefill", "pool_wait")


def _stage_table(audits: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Where each run's time went, per action: p50 / p90 / mean of the report's stages (``stages_s``)."""
    rows = [(name, action, per) for name, a in audits for action, per in (a.get("stages_s") or {}).items()]
    if not rows:
        return []
    head = " | ".join(f"{s} p50 / p90 / mean s" for s in REPORT_STAGES)
    lines = ["Where the time went per action (the requests' timelines, `router.decision.RequestTimeline`; "
             "engine_wait holds a load from the pool):", "", f"| run | action | n | {head} |",
             "|---|---|---|" + "---|" * len(REPORT_STAGES)]
    for name, action, per in rows:
        cells = [" / ".join(_f(per[s][k], ".3f") for k in ("p50", "p90", "mean")) if s in per else "–"
                 for s in REPORT_STAGES]
        n = max((v["n"] for v in per.values()), default=0)
        lines.append(f"| {name} | {action} | {n} | " + " | ".join(cells) + " |")
    return lines + [""]


def _kv(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.0f}" for k, v in sorted(d.items())) or "–"


def _ratio_cell(r: dict[str, Any]) -> str:
    if r.get("ratio") is None:
        return "–"
    return f"{r['ratio']:.2f}× [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def render_report(payload: dict[str, Any], plots: list[str]) -> str:
    agg, meta = payload["aggregate"], payload["meta"]
    order = meta.get("run_order") or [[1, p] for p in meta["policies"]]
    lines = ["# Live comparison: `kvstack bench agent` against each configuration", "",
             f"Run {meta['started_utc']} on {meta['host']}, wall {meta['wall_s']:.0f} s. Model `{meta['model']}`, "
             f"2 vLLM replicas (CPU build) on a local Ray cluster of a head + 2 worker nodes. Configurations: "
             f"`{ANCHOR}` = Ray Serve LLM's own app (`build_openai_app`, `PrefixCacheAffinityRouter`) over the same "
             f"engine arguments; `POLICY` = `kvstack serve --policy POLICY` with the KV pool; `POLICY{NO_POOL}` = "
             f"the pool off. One fresh server per run, in the order "
             + ", ".join(f"{c} #{r}" for r, c in order) + ".", "",
             "Command:", "", "```", meta["command"], "```", "",
             scheduling_line([r["scheduling"] for r in payload.get("runs", []) if r.get("scheduling")]), "",
             "Engine placement per policy (threads, cores per replica): " + "; ".join(
                 f"{pol}: " + ", ".join(f"{p.get('threads')}×{p.get('cores')}" for p in (pl or []))
                 for pol, pl in agg.get("placement", {}).items())
             + ("" if agg.get("same_placement", True) else " — **NOT the same for every policy**"), "",
             "## TTFT and routing per policy", ""]
    header = ["policy", "ok/sent", "err", "cancelled", "TTFT p50 s", "p90", "p99", "mean",
              "p50 / p99 incl. cancelled", "TPOT p50 s", "decisions by action", "hit tokens by tier",
              "hit tok / decision", "prompt tok / ok req", "load avg (1 min) before→after"]
    table = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in agg["rows"]:
        if "error" in row:
            failed = row["error"][:120].replace("|", "/")
            table.append(f"| {row['policy']} | failed: {failed} |" + " |" * (len(header) - 2))
            continue
        rq, t = row["requests"], row["ttft_s"]
        la, lb = row.get("load_avg_before") or [None], row.get("load_avg_after") or [None]
        wc = row.get("ttft_with_cancelled_s") or {}
        table.append("| " + " | ".join([
            row["policy"], f"{rq['ok']}/{rq['sent']}", str(rq["errors"]), str(rq.get("cancelled", 0)), _f(t["p50"]),
            _f(t["p90"]), _f(t["p99"]), _f(t["mean"]),
            f"{_f(wc.get('p50'))} / {_f(wc.get('p99'))}",
            _f(row["tpot_s"]["p50"], ".4f"), _kv(row["decisions_by_action"]),
            _kv(row["hit_tokens_by_tier"]), _f(row["hit_tokens_per_decision"], ".0f"),
            _f(row["prompt_tokens_per_ok_request"], ".0f"), f"{_f(la[0], '.1f')}→{_f(lb[0], '.1f')}",
        ]) + " |")
    lines += table + [""]
    saves = [(row["policy"], row.get("saver") or {}) for row in agg["rows"] if row.get("saver")]
    if saves:
        lines += ["The engines' save path over each run (`vllm:kvpool_saver_*`, summed over the replicas): blocks "
                  "committed / dropped (no staging slot) / failed saves, and the saves the catch-up lane ran (they "
                  "had waited `app.pool.saver_max_lag_s` for the nice-19 saver thread): "
                  + "; ".join(f"{name}: {_f(c.get('blocks_committed'), '.0f')} / {_f(c.get('blocks_dropped'), '.0f')}"
                              f" / {_f(c.get('save_failures'), '.0f')}, catch-up {_f(c.get('catch_up_saves'), '.0f')}"
                              f" of {_f(c.get('saves'), '.0f')} saves" for name, c in saves) + ".", ""]
    audits = [(row["policy"], row["decision_audit"]) for row in agg["rows"] if row.get("decision_audit")]
    if audits:
        lines += ["Decision audit (`/kvstack/decisions`, the run's records; `bench.decision_audit`): requests per "
                  "replica, reused-token fraction (HBM + fetched / prompt), median actual − predicted TTFT per "
                  "action, the relative prediction error per action after the run's first decisions (issue 13: "
                  "median <= 0.25), whether the planned reuse is what the engine reused (the router's view of "
                  "the caches at decision time), and the client's TTFT less the router's (time outside the "
                  "router's view: HTTP proxy, client, queues before the ingress).", ""]
        for name, a in audits:
            if "error" in a:
                lines.append(f"- {name}: audit unavailable ({a['error'][:200]})")
                continue
            errs = ", ".join(f"{k} {v:+.2f} s" for k, v in sorted(a["median_prediction_error_s"].items())) or "–"
            rel = a.get("relative_error") or {}
            rels = ", ".join(f"{k} {_f(v['p50'], '.2f')} / {_f(v['p90'], '.2f')} (n {v['n']})"
                             for k, v in rel.items() if v["n"]) or "–"
            pc = a.get("plan_check") or {}
            plan = (f"; planned reuse = engine's on {pc['equal']}/{pc['compared']} (engine reused more on "
                    f"{pc['under']}, {pc['under_tokens']:,} tok; less on {pc['over']}, {pc['over_tokens']:,} tok)"
                    if pc.get("compared") else "")
            out = a.get("outside_router_s") or {}
            outside = (f"; client − router TTFT p50 {_f(out.get('p50'))} / p90 {_f(out.get('p90'))} / max "
                       f"{_f(out.get('max'))} s (n {out['n']}, by {out.get('matched_by')})" if out.get("n") else "")
            lines.append(f"- {name}: {a['records']} records; per replica {_kv(a['by_replica'])}; reused "
                         f"{_f(a['reused_token_fraction'], '.2f')}; prediction error {errs}; |predicted − actual| "
                         f"/ actual p50 / p90 after {a.get('warmup_decisions', 0)} decisions: {rels}{plan}{outside}")
        lines.append("")
        lines += _stage_table(audits)
    pooled = agg.get("ttft_pooled") or {}
    if pooled:
        lines += ["## TTFT per configuration (every run pooled)", "",
                  "| configuration | n | p50 s | p90 | p99 | mean |", "|---|---|---|---|---|---|"]
        lines += [f"| {c} | {t['n']} | {_f(t['p50'])} | {_f(t['p90'])} | {_f(t['p99'])} | {_f(t['mean'])} |"
                  for c, t in pooled.items()]
        lines.append("")
    by_turn = agg.get("ttft_by_turn") or {}
    if by_turn:
        subject = meta["subject"]
        lines += ["## TTFT per turn (every run pooled; turn 0 = a session's first request)", "",
                  f"| configuration | turn | n | p50 s | p90 | p99 | mean | {subject} / it: p50, mean |",
                  "|---|---|---|---|---|---|---|---|"]
        for c, turns in by_turn.items():
            for turn, t in turns.items():
                ratio = (f"{t['subject_ratio_p50']:.2f}×, {t['subject_ratio_mean']:.2f}×"
                         if "subject_ratio_p50" in t else "–")
                lines.append(f"| {c} | {turn} | {t['n']} | {_f(t['p50'])} | {_f(t['p90'])} | {_f(t['p99'])} | "
                             f"{_f(t['mean'])} | {ratio} |")
        lines.append("")
    agreement = agg.get("outputs_agreement") or {}
    if agreement:
        lines += ["Greedy outputs (temperature 0) of the same request (session, turn, prompt length) against the "
                  "first run: " + "; ".join(f"{k}: {v['equal']}/{v['compared']} equal" for k, v in agreement.items())
                  + ". bf16 results depend on the compute split (a reused prefix is computed by an earlier request), "
                  "so reuse may change a greedy token; a run against a repeat of itself shows the floor.", ""]
    if agg["ratios"]:
        lines += ["## Ratios (bootstrap 95% interval, sessions resampled; every run of a configuration pooled)", "",
                  "| ratio | requests | TTFT p50 | TTFT p99 | TTFT mean |", "|---|---|---|---|---|"]
        for kind, key in (("ok", "ratios"), ("ok + cancelled after 1st token", "ratios_with_cancelled")):
            for name, r in agg.get(key, {}).items():
                lines.append(f"| {name} | {kind} | {_ratio_cell(r['p50'])} | {_ratio_cell(r['p99'])} | "
                             f"{_f(r['mean'], '.2f')}{'×' if r['mean'] is not None else ''} |")
        lines += ["", "Ratios < 1: the subject is faster. \"ok\" is the bench's definition (finished requests); the "
                  "second set adds requests cancelled at the run's deadline after their first token arrived "
                  "(their TTFT is real; leaving them out trims an overloaded run's tail)."]
        censored = [f"{row['policy']} {row['cancelled_before_first_token']}" for row in agg["rows"]
                    if "cancelled_before_first_token" in row]
        if censored:
            lines.append("Requests cancelled before any token (no TTFT, in neither set): " + ", ".join(censored) + ".")
        lines.append("")
    w = meta["workload"]
    lines += ["## Workload", "",
              ("Sequential agent sessions (one at a time" if w.get("max_concurrent_sessions") == 1 else
               f"Agent sessions (at most {w['max_concurrent_sessions']} at once" if w.get("max_concurrent_sessions")
               else "Concurrent agent sessions (no bound")
              + f"; Poisson arrivals, {w['sessions_per_s']}/s), {w['system_prompt_variants']} shared system-prompt "
              f"variants of {w['system_prompt_words']} words + {w['tools']} tool definitions ({w['tools_mode']} mode), "
              f"{w['turns_min']}-{w['turns_max']} turns of {w['user_words']}-word user messages or "
              f"{w['tool_result_words']}-word tool results (fraction {w['tool_result_fraction']}), think time "
              f"{w['think_time_s']} s mean, max_tokens {w['max_output_tokens']}, seed {w['seed']}; bounded by "
              f"{w['max_requests']} requests / {w['duration_s']:.0f} s per policy. "
              + (f"Sized: {meta['sizing']['shared_prefix_tokens']} shared-prefix tokens, prompts up to "
                 f"{meta['sizing']['max_prompt_tokens']} tokens (estimate)." if meta.get("sizing") else ""), ""]
    lines += [f"![{p}]({p})" for p in plots] + [""]
    lines += ["Raw per-policy results, server and bench logs: `" + meta["work_dir"] + "` (not committed).", ""]
    return "\n".join(lines)


def write_plots(agg: dict[str, Any], out: Path) -> list[str]:
    from bench import plots

    written = [plots.ttft_cdf(agg["ttft_samples"], out / "ttft_cdf.png", title="live TTFT CDF per policy")]
    per_turn = {r["policy"]: r["per_turn"] for r in agg["rows"] if "per_turn" in r}
    if per_turn:
        written.append(plots.ttft_by_turn(per_turn, out / "ttft_by_turn.png"))
    hits = {r["policy"]: r["hit_tokens_by_tier"] for r in agg["rows"] if r.get("hit_tokens_by_tier")}
    if hits:
        written.append(plots.hit_tokens_by_tier(hits, out / "hit_tokens_by_tier.png"))
    if agg.get("ttft_timeline"):
        written.append(plots.ttft_timeline(agg["ttft_timeline"], out / "ttft_over_time.png"))
    kept = []
    for p in written:
        if p.stat().st_size < PLOT_LIMIT_BYTES:
            kept.append(p.name)
        else:
            p.unlink()
    return kept


# ------------------------------------------------------------------------------------------- sizing
def size_workload(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    """Token counts of the planned prompts (assistant replies approximated by ``max_output_tokens`` filler words)."""
    from transformers import AutoTokenizer

    from bench.agent import plan_sessions, system_prompt, tool_definitions, turn_text
    from bench.agent_cli import workload_from_args

    w = workload_from_args(args)
    tok = AutoTokenizer.from_pretrained(str(model_path))
    sessions = plan_sessions(w, horizon_s=args.duration_s)
    tools_text = "\nTools:\n" + json.dumps(tool_definitions(w)) if w.tool_count else ""

    def count(messages: list[dict[str, str]]) -> int:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False).input_ids)

    shared = count([{"role": "system", "content": system_prompt(w, 0) + tools_text}])
    longest = 0
    planned = 0
    for s in sessions:
        msgs = [{"role": "system", "content": system_prompt(w, s.variant) + tools_text}]
        for t, turn in enumerate(s.turns):
            text = turn_text(w, s.session_id, t, turn.words)
            msgs.append({"role": "user", "content": text if turn.kind == "user" else "Tool result:\n" + text})
            longest = max(longest, count(msgs))
            msgs.append({"role": "assistant", "content": " ".join(["ka"] * w.max_output_tokens)})
            planned += 1
    return {"sessions_in_horizon": len(sessions), "requests_in_horizon": planned,
            "shared_prefix_tokens": shared, "max_prompt_tokens": longest}


# ------------------------------------------------------------------------------------------- entry point
def run(args: argparse.Namespace) -> int:
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides

    if args.from_work_dir is not None:
        return report_from_work_dir(args.from_work_dir.resolve(), args.out)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    serve_set = list(args.serve_set) if args.serve_set else list(DEFAULT_SERVE_SET)
    overrides = parse_overrides(serve_set)
    try:
        cfg = load_serve_config(DEFAULT_CONFIG, overrides)
        check_configs(policies, serve_set)
    except Exception as exc:  # noqa: BLE001 - config errors of any kind are usage errors here
        print(f"live_compare: bad serve config: {exc}", file=sys.stderr)
        return 2
    model_path = REPO / cfg.app.engine.model_path
    sizing = size_workload(args, model_path) if (model_path / "tokenizer.json").exists() else None
    if sizing and sizing["max_prompt_tokens"] + args.max_output_tokens > cfg.app.engine.max_model_len:
        print(f"live_compare: prompts reach {sizing['max_prompt_tokens']} tokens, over max_model_len "
              f"{cfg.app.engine.max_model_len}; shrink the workload", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps({"policies": policies, "serve_set": serve_set, "sizing": sizing,
                          "agent_argv": agent_argv(args, "http://127.0.0.1:PORT/v1", "POLICY", Path("OUT"))}, indent=2))
        return 0

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = (args.work_dir or REPO / ".kvstack/live_compare" / stamp).resolve()
    work.mkdir(parents=True, exist_ok=True)

    def interrupt(*_: object) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):  # a second signal must not abort the server's shutdown
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupt)
    t0 = time.monotonic()
    meta: dict[str, Any] = {
        "schema": "kvstack.bench.live_compare/v1",
        "started_utc": stamp, "host": describe_host(), "wall_s": None,
        "model": cfg.app.engine.served_model_name, "policies": policies, "subject": args.subject,
        "repeats": args.repeats, "run_order": run_order(policies, args.repeats),
        "serve_set": serve_set, "workload": {k: getattr(args, k) for k in AGENT_FLAGS}, "sizing": sizing,
        "work_dir": str(work), "interrupted": False,
        "command": " ".join([Path(sys.executable).name, "-m", "bench.live_compare", *sys.argv[1:]]),
    }
    (work / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    entries: list[dict[str, Any]] = []
    interrupted = False
    try:
        for repeat, policy in run_order(policies, args.repeats):
            entries.append(run_policy(args, policy, work, serve_set, cfg.app.engine.served_model_name, repeat,
                                      args.repeats))
            (work / "entries.json").write_text(json.dumps(entries, indent=2, sort_keys=True))
    except Interrupted:
        interrupted = True
        print("[live-compare] interrupted; writing what was measured", file=sys.stderr, flush=True)
    meta.update(wall_s=time.monotonic() - t0, interrupted=interrupted)
    (work / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    write_report(entries, meta, args.out)
    print(f"[live-compare] wrote {args.out / 'report.md'} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    ok = all(e.get("result") for e in entries) and len(entries) == len(policies) * args.repeats and not interrupted
    return 0 if ok else 1


def write_report(entries: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    """Aggregate ``entries`` (one per policy, as ``run_policy`` returns them) into ``out``: results.json, report.md,
    plots."""
    agg = aggregate(entries, meta["subject"])
    out.mkdir(parents=True, exist_ok=True)
    plot_names = write_plots(agg, out) if agg["ttft_samples"] else []
    slim = [{k: v for k, v in e.items() if k != "result"} for e in entries]
    payload = {"meta": meta, "aggregate": {k: v for k, v in agg.items() if k not in ("ttft_samples", "ttft_timeline")},
               "ttft_samples_s": agg["ttft_samples"], "runs": slim}
    (out / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True))
    (out / "report.md").write_text(render_report(payload, plot_names))


def report_from_work_dir(work: Path, out: Path) -> int:
    """Rebuild the report of a finished (or interrupted) run from its work dir, without starting anything."""
    entries_file = work / "entries.json"
    if not entries_file.exists():
        print(f"live_compare: {entries_file} not found", file=sys.stderr)
        return 2
    meta_file = work / "meta.json"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
    elif (out / "results.json").exists():  # runs written before meta.json existed: their report's meta
        meta = json.loads((out / "results.json").read_text())["meta"]
    else:
        print(f"live_compare: no {meta_file} and no {out / 'results.json'} to take the run's meta from",
              file=sys.stderr)
        return 2
    entries = json.loads(entries_file.read_text())
    for e in entries:  # the audit again from the saved records (the summary may have grown since the run)
        records = run_dir(work, e["policy"], int(e.get("repeat", 1))) / "decisions.json"
        if e.get("decisions") and records.exists():
            e["decisions"] = decision_audit.summarize(json.loads(records.read_text()),
                                                      requests=(e.get("result") or {}).get("request_log"))
    write_report(entries, meta, out)
    print(f"[live-compare] rewrote {out / 'report.md'} from {work}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.live_compare", description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
