"""``kvstack status``: nodes, replicas, pool shards (blocks per tier) and recent decisions of a running stack.

Reads the endpoint from ``kvstack serve``'s state file (or ``--endpoint``) and asks the ingress's
``/kvstack/status`` route, which answers from inside the cluster. Exit 1 when nothing answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cluster.cli_output import print_document


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="base URL, e.g. http://127.0.0.1:8000/v1 (default: from --state-file)")
    parser.add_argument("--state-file", type=Path, default=Path(".kvstack/serve.json"))
    parser.add_argument("--decisions", type=int, default=10, help="recent decisions to show")
    parser.add_argument("--json", action="store_true", help="print the raw status object")
    parser.add_argument("--timeout", type=float, default=10.0)


def _endpoint(args: argparse.Namespace) -> str | None:
    if args.endpoint:
        return args.endpoint.rstrip("/")
    try:
        return json.loads(args.state_file.read_text())["endpoint"].rstrip("/")
    except (OSError, ValueError, KeyError):
        return None


def fetch_status(endpoint: str, decisions: int, timeout: float) -> dict[str, Any]:
    """The endpoint's ``/kvstack/status`` (with ``$KVSTACK_ADMIN_KEY`` as the bearer key when it is set: an
    endpoint with API keys serves it to the admin key only, ``router.access``)."""
    import os

    from router.access import ADMIN_KEY_ENV

    base = endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint
    req = urllib.request.Request(f"{base}/kvstack/status?decisions={decisions}")
    if os.environ.get(ADMIN_KEY_ENV):
        req.add_header("Authorization", f"Bearer {os.environ[ADMIN_KEY_ENV]}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _placement(p: dict[str, Any] | None) -> str:
    if not p:
        return "cpus=?"
    shared = f" shared with {','.join(p['shared_with'])}" if p.get("shared_with") else ""
    workers = "".join(f" worker {pid}@{cpus}" for pid, cpus in p.get("engine_workers") or [])
    return f"threads={p['threads']} cpus={p['cores']} ({p['binding']}, numa {p['numa_nodes']}){shared}{workers}"


def render(status: dict[str, Any]) -> str:
    lines = [f"nodes ({len(status['nodes'])}):"]
    lines += [f"  {n['ip']:<12} {n['node_id'][:12]}  cpus={n['cpus']:g}  alive={n['alive']}" for n in status["nodes"]]
    lines.append(f"replicas ({len(status['replicas'])}):")
    lines += [f"  {r['replica_id']:<14} node={r['node_id'][:12]}  running={r['running']} waiting={r['waiting']} "
              f"hbm_blocks={r['hbm_blocks']}  {_placement(r.get('placement'))}" for r in status["replicas"]]
    lines.append(f"pool shards ({len(status['shards'])}):")
    for s in status["shards"]:
        lines.append(f"  {s['shard_id']:<14} node={s['node_id'][:12]}  dram_blocks={s['dram_blocks']} "
                     f"ssd_blocks={s['ssd_blocks']}  leases={s.get('leases', 0)}")
        lines += [f"    model {m['model'] or '?'} (layout {m['layout'][:12]}): dram_blocks={m['dram_blocks']} "
                  f"ssd_blocks={m['ssd_blocks']}" for m in s.get("models", [])]
    tiers = status.get("tiers", [])
    if tiers:
        lines.append("pool tier prices (this router):")
        lines += [f"  {t['tier_class']:<12} {t['bandwidth_gbps']:8.3f} GB/s  {t['latency_s'] * 1000:7.2f} ms  "
                  f"{'calibrated' if t['calibrated'] else 'configured'} ({t['observed']} fetches seen; {t['tier']})"
                  for t in tiers]
    lines.append(f"recent decisions ({len(status['decisions'])}):")
    for d in status["decisions"]:
        preds = "  ".join(f"{k}={v * 1000:.1f}ms" for k, v in sorted(d.get("predicted", {}).items()))
        actual = d.get("actual_ttft_s")
        actual_s = f"{actual * 1000:.1f}ms" if actual is not None else "-"
        lines.append(f"  {d['request_id'][:20]:<20} {d['action']:<9} → {d.get('replica_id', '')[:14]:<14} "
                     f"actual={actual_s}  predicted: {preds}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args)
    if endpoint is None:
        print(f"kvstack status: no --endpoint and no state file at {args.state_file} (is `kvstack serve` running?)",
              file=sys.stderr)
        return 1
    try:
        status = fetch_status(endpoint, args.decisions, args.timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"kvstack status: {endpoint} did not answer: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_document(json.dumps(status, indent=2))
    else:
        print(render(status))
    return 0
