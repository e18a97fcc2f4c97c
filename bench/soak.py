"""``kvstack bench soak``: a long, bounded run of agent sessions with tools against a local ``kvstack serve``, and
what it left behind: errors, wrong outputs, memory growth, pool blocks, live leases, engine step times.

What one run does:
1. Starts ``kvstack serve`` (``bench.live_compare.serve_command``: the default config — a local multi-node Ray
   cluster, 2 CPU replicas, the pool on — with ``--policy`` and ``--serve-set`` overrides), or, with ``--endpoint``,
   uses a running server (``--server-pid``: a process of its session, whose processes are measured).
2. Records the RSS of every process of the server (``bench.serve_process.server_pids``: Ray's GCS and raylets,
   Serve's controller, proxies and replicas, vLLM's engine cores, the pool shards) and scrapes ``/metrics``.
3. Runs ``bench.agent.run_sessions`` — OpenAI ``tools`` and tool-role results over shared system-prompt variants —
   with ``--in-flight`` sessions at once (new ones keep arriving) for ``--duration-s`` seconds; the requests still
   running at the deadline are cancelled (counted apart from errors).
4. After the load: scrapes ``/metrics`` again. Engine step time is vLLM's own ``vllm:inter_token_latency_seconds``
   histogram over the run (the engine-core time between two tokens of a running request: one engine step, as the
   requests saw it), its percentiles interpolated within buckets (``bench.prom.histogram_quantile``). Waits (at most
   ``LEASE_DRAIN_S``) for the pool's leases to drain (releases are asynchronous) and records every shard's blocks
   and live leases (``/kvstack/status``; goal: 0 leases); RSS again (processes gone or new are listed).
   During the load the RSS of every process is also sampled every ``--rss-interval-s`` (``RssSampler``), and each
   process's growth is split into the run's first and second half (``rss_trend``): KV pages or an arena being
   touched as they fill up grow early and flatten; a leak keeps growing in the second half.
5. Spot check (``--spot-sessions`` > 0): ``bench.oracle.compare`` through the pool as the soak left it — fresh
   sessions, one request at a time, every replica's HBM emptied after each round so revisits come from the pool —
   each greedy answer judged against plain vLLM (``bench.oracle.ReferenceServer``, started only once the load is
   over, so the two never share the cores under load; or the caller's, idle during the load). ``wrong_outputs`` is
   its unexplained verdicts (goal: 0).

Output: ``result.json`` (schema ``kvstack.bench.soak/v1``; ``--json`` prints it) and ``soak.png`` (TTFT over the
run) in ``--out``. Exit 0 when nothing failed (no errors, no wrong outputs, no live lease at the end), else 1.
Who calls it: operators (``kvstack bench soak``; the default is 10 minutes at 16 in flight, ~15 minutes with
start-up on a 2-core box) and ``tests/e2e/shared_serve/test_serve_local.py`` (a 40-second run in CI, judged
against the module's own reference server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cluster.cli_output import print_document

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "kvstack.bench.soak/v1"
STEP_HISTOGRAM = "vllm:inter_token_latency_seconds"
LEASE_DRAIN_S = 20.0  # releases run on the connectors' pool-call threads: give them a moment after the load
MIB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    from bench.agent_cli import add_workload_args
    from bench.live_compare import WORKLOAD_DEFAULTS

    g = parser.add_argument_group("server")
    g.add_argument("--endpoint", default="", help="a running server's OpenAI base URL (default: start kvstack serve)")
    g.add_argument("--server-pid", type=int, default=0,
                   help="with --endpoint: a process of the server's session (its processes' RSS is measured)")
    g.add_argument("--policy", default="cost_based", help="the router policy of the server started here")
    g.add_argument("--serve-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a --set for the server started here (repeatable)")
    g.add_argument("--work-dir", default=".kvstack/soak", help="the server's state, logs and SSD tier")
    g.add_argument("--ready-timeout-s", type=float, default=600.0)
    g = parser.add_argument_group("load")
    g.add_argument("--duration-s", type=float, default=600.0)
    g.add_argument("--in-flight", type=int, default=16, help="agent sessions at once (new ones wait for a slot)")
    g.add_argument("--request-timeout-s", type=float, default=120.0)
    g.add_argument("--rss-interval-s", type=float, default=30.0, help="RSS sampling period during the load")
    add_workload_args(parser)  # the agent workload's knobs, sized as live-compare's (prompts fit the tiny models)
    parser.set_defaults(**{**WORKLOAD_DEFAULTS, "sessions_per_s": 4.0, "think_time_s": 0.5})
    g = parser.add_argument_group("spot check")
    g.add_argument("--spot-sessions", type=int, default=6, help="oracle sessions after the load (0: none)")
    g.add_argument("--spot-turns", type=int, default=2)
    parser.add_argument("--out", default="", help="directory for result.json and soak.png")
    parser.add_argument("--json", action="store_true", help="print the JSON result")


# ------------------------------------------------------------------------------------------------ measurements
def _label(proc: Any) -> str:
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - a process that just went
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0]  # Ray's process title: ray::ServeReplica:..., ray::PoolShard, ray::IDLE
    return " ".join(Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd[:3]))[:100] if cmd else proc.name()


def server_rss(pid: int) -> dict[int, dict[str, Any]]:
    """RSS (MiB) and a label for every live process of the server whose main process is ``pid``
    (``bench.serve_process.server_pids``)."""
    import psutil

    from bench.serve_process import server_pids

    out: dict[int, dict[str, Any]] = {}
    for p in server_pids(pid):
        try:
            proc = psutil.Process(p)
            out[p] = {"label": _label(proc), "rss_mib": round(proc.memory_info().rss / MIB, 1)}
        except psutil.Error:
            continue
    return out


def rss_change(start: dict[int, dict[str, Any]], end: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per process: RSS at start and end (None: not there then), and the totals."""
    rows = [{"pid": pid, "label": (start.get(pid) or end[pid])["label"],
             "rss_start_mib": start[pid]["rss_mib"] if pid in start else None,
             "rss_end_mib": end[pid]["rss_mib"] if pid in end else None} for pid in sorted({*start, *end})]
    both = [r for r in rows if r["rss_start_mib"] is not None and r["rss_end_mib"] is not None]
    return {
        "processes": rows,
        "total_start_mib": round(sum(v["rss_mib"] for v in start.values()), 1),
        "total_end_mib": round(sum(v["rss_mib"] for v in end.values()), 1),
        "max_growth_mib": max((r["rss_end_mib"] - r["rss_start_mib"] for r in both), default=0.0),
        "gone": sum(r["rss_end_mib"] is None for r in rows),
        "new": sum(r["rss_start_mib"] is None for r in rows),
    }


class RssSampler:
    """``server_rss(pid)`` every ``interval_s`` on a thread of its own, from ``start()`` to ``stop()`` (which takes
    one last sample): ``samples`` is [(seconds since start, {pid: {label, rss_mib}})]."""

    def __init__(self, pid: int, interval_s: float, measure: Any = None) -> None:
        import threading

        if interval_s <= 0:
            raise ValueError(f"rss interval must be positive, got {interval_s}")
        self.pid, self.interval_s = pid, interval_s
        self._measure = measure or server_rss
        self.samples: list[tuple[float, dict[int, dict[str, Any]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self._t0 = 0.0

    def start(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.samples.append((round(time.monotonic() - self._t0, 1), self._measure(self.pid)))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> list[tuple[float, dict[int, dict[str, Any]]]]:
        self._stop.set()
        self._thread.join(timeout=60.0)
        self._sample()
        return self.samples


def rss_trend(samples: list[tuple[float, dict[int, dict[str, Any]]]]) -> dict[str, Any]:
    """The RSS series (total per sample) and, per process present in every sample, its growth over the first and
    the second half of the run (the sample nearest the middle splits them); ``growing`` lists the processes whose
    second half grew by more than ``max(16 MiB, 10%)`` of what they held at the middle: the leak candidates."""
    if not samples:
        return {"series": [], "processes": [], "growing": []}
    series = [{"t_s": t, "total_mib": round(sum(v["rss_mib"] for v in procs.values()), 1)} for t, procs in samples]
    t_end = samples[-1][0]
    mid = min(range(len(samples)), key=lambda i: abs(samples[i][0] - t_end / 2))
    first, middle, last = samples[0][1], samples[mid][1], samples[-1][1]
    rows = []
    for pid in sorted(set(first).intersection(*(procs for _, procs in samples))):
        a, m, b = first[pid]["rss_mib"], middle[pid]["rss_mib"], last[pid]["rss_mib"]
        rows.append({"pid": pid, "label": last[pid]["label"], "first_half_mib": round(m - a, 1),
                     "second_half_mib": round(b - m, 1)})
    rows.sort(key=lambda r: -r["second_half_mib"])
    growing = [r for r in rows if r["second_half_mib"] > max(16.0, 0.1 * middle[r["pid"]]["rss_mib"])]
    return {"series": series, "processes": rows, "growing": growing}


def metrics_text(endpoint: str) -> str:
    import httpx

    from bench.prom import metrics_url

    return httpx.get(metrics_url(endpoint), timeout=30).raise_for_status().text


def step_times(before: str, after: str) -> dict[str, Any]:
    """Engine step time over the run from the ``STEP_HISTOGRAM`` difference of two scrapes."""
    from bench.prom import histogram_buckets, histogram_quantile

    b, a = histogram_buckets(before, STEP_HISTOGRAM), histogram_buckets(after, STEP_HISTOGRAM)
    delta = {le: n - b.get(le, 0.0) for le, n in a.items()}
    q = {f"p{int(p * 100)}": histogram_quantile(delta, p) for p in (0.5, 0.9, 0.99)}
    return {"source": STEP_HISTOGRAM, "samples": int(max(delta.values(), default=0.0)), **q}


def pool_state(endpoint: str, drain_s: float = LEASE_DRAIN_S) -> dict[str, Any]:
    """Every shard's blocks and live leases, once the leases drained (or ``drain_s`` passed)."""
    import httpx

    from bench.live import server_root

    deadline = time.monotonic() + drain_s
    while True:
        shards = httpx.get(server_root(endpoint) + "/kvstack/status", timeout=60).raise_for_status().json()["shards"]
        leases = sum(int(s.get("leases", 0)) for s in shards)
        if leases == 0 or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    return {"shards": [{k: s.get(k) for k in ("shard_id", "dram_blocks", "ssd_blocks", "leases", "error")}
                       for s in shards],
            "blocks": sum(int(s.get("dram_blocks", 0)) + int(s.get("ssd_blocks", 0)) for s in shards),
            "leases": leases, "waited_s": round(drain_s - max(0.0, deadline - time.monotonic()), 1)}


async def agent_load(endpoint: str, args: argparse.Namespace) -> tuple[list[Any], dict[str, Any], str]:
    from bench.agent import LiveOptions, run_sessions
    from bench.agent_cli import workload_from_args
    from bench.live import make_client, resolve_model
    from bench.loadgen import Budget, Progress

    workload = workload_from_args(args)
    client = make_client(argparse.Namespace(endpoint=endpoint, api_key=None,
                                            request_timeout_s=args.request_timeout_s))
    try:
        model = await resolve_model(client, None)
        opts = LiveOptions(model=model, request_timeout_s=args.request_timeout_s,
                           max_concurrent_sessions=args.in_flight)
        records, sessions = await run_sessions(client, workload, opts, Budget(max_requests=None,
                                                                               duration_s=args.duration_s),
                                               progress=Progress(enabled=False, total=None, description="soak"),
                                               clock=time.monotonic)
    finally:
        await client.close()
    return records, {"workload": asdict(workload), "sessions": sessions}, model


def spot_check(endpoint: str, model: str, args: argparse.Namespace, log_dir: Path,
               reference: Any = None) -> dict[str, Any]:
    """``bench.oracle.compare`` against plain vLLM with the config's engine arguments, bound as one replica: a
    ``ReferenceServer`` started here, or ``reference`` (a ready one of the caller's, on the same engine arguments
    and binding, left running)."""
    from bench.oracle import ReferenceServer, compare, replica_threads
    from cluster.local_cluster import free_port
    from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides

    cfg = load_serve_config(DEFAULT_CONFIG, parse_overrides(args.serve_set))
    server = reference
    if server is None:
        server = ReferenceServer({**cfg.app.engine.vllm_engine_kwargs(),
                                  **cfg.app.ingress.openai.vllm_serve_kwargs()},
                                 list(range(replica_threads(endpoint))), log_dir / "reference.log", free_port())
    try:
        if reference is None:
            server.wait_ready()
        result = compare(endpoint, server.base, model, sessions=args.spot_sessions, turns=args.spot_turns,
                         reset_hbm=True, seed=args.seed + 1, max_prompt_tokens=cfg.app.engine.max_model_len)
    finally:
        if reference is None:
            server.stop()
    return {k: result[k] for k in ("compared", "unexplained", "verdicts", "by_action", "reused_requests",
                                   "reused_tokens", "unexplained_cases")}


# ------------------------------------------------------------------------------------------------ the run
def soak(endpoint: str, server_pid: int, args: argparse.Namespace, out: Path,
         reference: Any = None) -> dict[str, Any]:
    """Steps 2-5 of the module docstring against a serving ``endpoint`` (``reference``: ``spot_check``'s)."""
    from bench.loadgen import summarize_records

    rss_start = server_rss(server_pid) if server_pid else {}
    before = metrics_text(endpoint)
    t0 = time.monotonic()
    print(f"[soak] {args.duration_s:.0f} s at {args.in_flight} sessions in flight", file=sys.stderr, flush=True)
    sampler = RssSampler(server_pid, args.rss_interval_s).start() if server_pid else None
    try:
        records, extra, model = asyncio.run(agent_load(endpoint, args))
    finally:
        samples = sampler.stop() if sampler is not None else []
    wall = time.monotonic() - t0
    after = metrics_text(endpoint)
    pool = pool_state(endpoint)
    rss_end = server_rss(server_pid) if server_pid else {}
    summary = summarize_records(records, wall)
    result: dict[str, Any] = {
        "schema": SCHEMA, "endpoint": endpoint, "model": model, "wall_s": round(wall, 1),
        "config": {"duration_s": args.duration_s, "in_flight": args.in_flight, **extra},
        **summary,
        "step_s": step_times(before, after),
        "pool_end": pool,
        "rss": {**rss_change(rss_start, rss_end), "during_load": rss_trend(samples)} if server_pid else None,
    }
    if args.spot_sessions > 0:
        print("[soak] spot check against plain vLLM", file=sys.stderr, flush=True)
        result["spot_check"] = spot_check(endpoint, model, args, out, reference)
        result["wrong_outputs"] = result["spot_check"]["unexplained"]
    else:
        result["spot_check"], result["wrong_outputs"] = None, None
    result["ok"] = (summary["requests"]["errors"] == 0 and summary["requests"]["ok"] > 0 and pool["leases"] == 0
                    and not result["wrong_outputs"])
    from bench import plots

    plots.ttft_timeline({"soak": [(r.sent_at_s, r.ttft_s) for r in records if r.ok]}, out / "soak.png")
    return result


def run(args: argparse.Namespace) -> int:
    from bench.live_compare import serve_command
    from bench.serve_process import ServerProcess, log_contains
    from cluster.local_cluster import free_port

    work = Path(args.work_dir).resolve()
    out = Path(args.out).resolve() if args.out else work / "report"
    out.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        if args.endpoint:
            endpoint, pid = args.endpoint, args.server_pid
        else:
            port = free_port()
            work.mkdir(parents=True, exist_ok=True)
            server = ServerProcess("kvstack serve", serve_command(args.policy, port, args.serve_set, work),
                                   work / "serve.log", cwd=REPO)
            print(f"[soak] starting kvstack serve on :{port} (log {work / 'serve.log'})", file=sys.stderr, flush=True)
            server.start()
            server.wait_ready(log_contains(work / "serve.log", "is serving"), args.ready_timeout_s)
            endpoint, pid = f"http://127.0.0.1:{port}/v1", server.proc.pid
        result = soak(endpoint, pid, args, out)
    finally:
        if server is not None:
            server.stop(60.0, reap=True)
    text = json.dumps(result, indent=2, sort_keys=True)
    (out / "result.json").write_text(text)
    if args.json:
        print_document(text)
    else:
        r = result["requests"]
        print(f"[soak] {r['ok']} ok, {r['errors']} errors, {r['cancelled']} cancelled at the deadline; "
              f"wrong outputs {result['wrong_outputs']}; leases at the end {result['pool_end']['leases']}; "
              f"step p50/p99 {result['step_s']['p50']}/{result['step_s']['p99']} s; {out / 'result.json'}",
              file=sys.stderr)
    return 0 if result["ok"] else 1
