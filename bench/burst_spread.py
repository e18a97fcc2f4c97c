"""``kvstack bench burst``: does a burst of fresh prompts spread over the replicas, through several routers?

    kvstack bench burst [--endpoint URL] [--rounds 16] [--burst 16] [--concurrency 8] [--routers 2] [--json]

Each round sends ``--burst`` chat completions with distinct fresh prompts (nothing to reuse: for its TTFT every idle
replica is an equal choice), ``--concurrency`` at a time, and reads each response's ``x-kvstack-router`` and
``x-kvstack-replica`` headers (``router.ingress``). Per round: requests per replica and per (router, replica), the
fewest any replica got, and the client's latency. Over the rounds: the fewest's median and minimum, and the rounds
where some replica got less than half its even share (``burst / replicas / 2``: the bound of the two-router e2e
test, ``tests/e2e/shared_serve/test_serve_local.py``, which sends its one round through ``burst``).

Without ``--endpoint`` it starts ``kvstack serve`` (``bench.live_compare.serve_command``: the default config, 2 CPU
replicas, the pool on) with ``app.ingress.num_replicas=--routers`` and ``--serve-set`` overrides, and stops it after.

Output: a JSON document (schema ``kvstack.bench.burst/v1``; ``--json`` prints it on stdout, logs go to stderr).
Who calls it: operators, and the e2e test above (``burst``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.stats import percentile
from cluster.cli_output import print_document

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "kvstack.bench.burst/v1"


def burst(base_url: str, model: str, n: int, concurrency: int, tag: str = "", timeout_s: float = 120.0
          ) -> list[dict[str, Any]]:
    """``n`` fresh chat prompts (4 greedy tokens each), ``concurrency`` at a time, through ``base_url`` (an OpenAI
    base URL, ``.../v1``). One row per request, in sending order: its HTTP status, the router and replica that
    served it, the replica the router decided on (``target``), the client's latency and, on an error, the body."""

    def one(i: int) -> dict[str, Any]:
        body = {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"unrelated question {tag}number {i} " + "x" * (i % 7)}]}
        t0 = time.monotonic()
        r = httpx.post(base_url + "/chat/completions", json=body, timeout=timeout_s)
        row = {"status": r.status_code, "latency_s": time.monotonic() - t0,
               "router": r.headers.get("x-kvstack-router", ""), "replica": r.headers.get("x-kvstack-replica", ""),
               "target": r.headers.get("x-kvstack-target", "")}
        if r.status_code != 200:
            row["error"] = r.text[:500]
        return row

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def round_summary(rows: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    """What one burst did: requests per replica (a replica that got none counts 0 of ``replicas``) and per router."""
    per_replica = Counter(r["replica"] for r in rows if r["status"] == 200)
    per_pair = Counter(f"{r['router']} -> {r['replica']}" for r in rows if r["status"] == 200)
    counts = sorted(per_replica.values()) + [0] * max(0, replicas - len(per_replica))
    lat = [r["latency_s"] for r in rows]
    return {"requests": len(rows), "errors": sum(r["status"] != 200 for r in rows),
            "per_replica": dict(per_replica), "per_router_replica": dict(sorted(per_pair.items())),
            "fewest": min(counts) if counts else 0, "most": max(counts) if counts else 0,
            "latency_p50_s": percentile(lat, 50), "latency_p90_s": percentile(lat, 90)}


def summarize(rounds: list[dict[str, Any]], burst_size: int, replicas: int) -> dict[str, Any]:
    bound = burst_size / replicas / 2
    fewest = [r["fewest"] for r in rounds]
    return {"rounds": len(rounds), "even_share": burst_size / replicas, "bound": bound,
            "fewest_median": percentile(fewest, 50), "fewest_min": min(fewest, default=None),
            "rounds_below_bound": sum(f < bound for f in fewest), "fewest_by_round": fewest,
            "latency_p50_s": percentile([r["latency_p50_s"] for r in rounds if r["latency_p50_s"] is not None], 50)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="", help="a running server's OpenAI base URL (default: start one)")
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--replicas", type=int, default=2, help="the server's replica count (a replica that got "
                                                                  "nothing counts as 0)")
    parser.add_argument("--routers", type=int, default=2, help="router replicas of the server started here")
    parser.add_argument("--policy", default="cost_based", help="the router policy of the server started here")
    parser.add_argument("--serve-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a --set for the server started here (repeatable)")
    parser.add_argument("--work-dir", default=".kvstack/burst", help="the started server's state, logs and SSD tier")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--burst", type=int, default=16, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--pause-s", type=float, default=2.0, help="between rounds")
    parser.add_argument("--out", default="", help="write result.json here")
    parser.add_argument("--json", action="store_true", help="print the JSON result")


def measure(endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    for i in range(args.rounds):
        rows = burst(endpoint, args.model, args.burst, args.concurrency, tag=f"round {i} ")
        rounds.append(round_summary(rows, args.replicas))
        print(f"[burst] round {i}: per replica {sorted(rounds[-1]['per_replica'].values())}, latency p50 "
              f"{rounds[-1]['latency_p50_s']:.3f} s", file=sys.stderr, flush=True)
        time.sleep(args.pause_s)
    return {"schema": SCHEMA, "endpoint": endpoint, "burst": args.burst, "concurrency": args.concurrency,
            "replicas": args.replicas, "summary": summarize(rounds, args.burst, args.replicas), "rounds": rounds}


def run(args: argparse.Namespace) -> int:
    from bench.live_compare import serve_command
    from bench.serve_process import ServerProcess, log_contains
    from cluster.local_cluster import free_port

    server = None
    work = Path(args.work_dir).resolve()
    try:
        if args.endpoint:
            endpoint = args.endpoint
        else:
            port = free_port()
            work.mkdir(parents=True, exist_ok=True)
            sets = [*args.serve_set, f"app.ingress.num_replicas={args.routers}"]
            server = ServerProcess("kvstack serve", serve_command(args.policy, port, sets, work), work / "serve.log",
                                   cwd=REPO)
            print(f"[burst] starting kvstack serve on :{port} (log {work / 'serve.log'})", file=sys.stderr, flush=True)
            server.start()
            server.wait_ready(log_contains(work / "serve.log", "is serving"), args.ready_timeout_s)
            endpoint = f"http://127.0.0.1:{port}/v1"
        result = measure(endpoint, args)
    finally:
        if server is not None:
            server.stop(60.0, reap=True)
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(text)
    if args.json:
        print_document(text)
    s = result["summary"]
    print(f"[burst] fewest per replica: median {s['fewest_median']}, min {s['fewest_min']} (even share "
          f"{s['even_share']:.1f}); rounds below {s['bound']:.1f}: {s['rounds_below_bound']} of {s['rounds']}",
          file=sys.stderr)
    return 0
