"""Replays a live run's cost_based decisions with other models of the replica's queue, to see how much of the
whole-TTFT prediction error is the queue estimate (issue 13, item 1).

Input: decision logs (``decisions.json`` of ``bench.live_compare``'s work dirs: ``router.decision.DecisionRecord``
as JSON, with the timeline and the reason). Each run is replayed alone. For every decision of a pricing policy (its
reason names the ``queue`` and the chosen action's ``prefill``, ``router.policies.cost_based._formula``), the
requests waiting on its replica at decision time are rebuilt from the same run's records: a request waits from its
decision to its first token there (``timeline.replica.first_token_s``; the few milliseconds of transport are
ignored), oldest first, and its work costs what its own decision priced its prefill at. The decision's predicted
TTFT is then re-priced with the queue each model gives, the rest of the prediction kept:

    recorded   the queue the router priced (what it knew then: the replicas' last reports and its own in-flight)
    waiting    overhead + Σ the waiting requests' prefills (the replica-side model with a fresh report, no progress)
    head       overhead + the same less what the engine has done of the oldest, at most its prefill (since the
               later of its arrival and the replica's last first token: ``deployments.prefill_queue``)

(overhead: the least queue the router priced on that replica in the run, its fixed cost with nothing waiting.)
Output per run and model, the decisions after ``--warmup``: n, median and p90 of |predicted − actual| / actual
(``bench.decision_audit``'s accuracy measure). With ``--json`` one JSON document on stdout.

Usage: ``python -m bench.queue_replay W/cost_based*/decisions.json [--warmup 10] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.decision_audit import DEFAULT_WARMUP, quantiles

MODELS = ("recorded", "waiting", "head")
_QUEUE = re.compile(r"queue (\d+(?:\.\d+)?)")
_PREFILL = re.compile(r"prefill\([^)]*\) (\d+(?:\.\d+)?)")
_KV_WAIT = re.compile(r"kv admission (\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class Priced:
    replica: str
    decided: float  # the router's clock
    first_token: float  # the same clock: decided + the replica's first token offset
    queue: float  # the queue the router priced (with any KV admission wait: both precede the prefill)
    prefill: float  # the chosen action's own prefill, as priced
    predicted: float
    actual: float


def priced(records: Sequence[dict[str, Any]]) -> list[Priced]:
    """The records of one run that a pricing policy decided and that got their first token, in decision order."""
    out = []
    for r in records:
        reason, actual = r.get("reason") or "", r.get("actual_ttft_s")
        q, pre = _QUEUE.search(reason), _PREFILL.findall(reason)
        if q is None or not pre or actual is None:
            continue
        kv = _KV_WAIT.search(reason)
        queue = float(q.group(1)) + (float(kv.group(1)) if kv else 0.0)
        offset = ((r.get("timeline") or {}).get("replica") or {}).get("first_token_s")
        first = r["decided_at"] + (offset if offset is not None and offset >= 0 else actual)
        out.append(Priced(r["replica_id"], r["decided_at"], first, queue, float(pre[-1]), r["predicted_ttft_s"],
                          actual))
    out.sort(key=lambda p: p.decided)
    return out


def queues(run: Sequence[Priced], k: int, overhead: float) -> dict[str, float]:
    """The queue of decision ``k``'s replica at its decision time under each model."""
    d = run[k]
    mine = [p for p in run[:k] if p.replica == d.replica]
    waiting = [p for p in mine if p.first_token > d.decided]
    total = sum(p.prefill for p in waiting)
    done = 0.0
    if waiting:
        head = waiting[0]
        last_first = max((p.first_token for p in mine if p.first_token <= d.decided), default=float("-inf"))
        done = min(head.prefill, max(0.0, d.decided - max(head.decided, last_first)))
    return {"recorded": d.queue, "waiting": overhead + total, "head": overhead + total - done}


def replay(records: Sequence[dict[str, Any]], warmup: int = DEFAULT_WARMUP) -> dict[str, dict[str, Any]]:
    run = priced(records)
    overhead: dict[str, float] = {}
    for p in run:
        overhead[p.replica] = min(overhead.get(p.replica, p.queue), p.queue)
    errors: dict[str, list[float]] = {m: [] for m in MODELS}
    for k in range(warmup, len(run)):
        d = run[k]
        for model, q in queues(run, k, overhead[d.replica]).items():
            errors[model].append(abs(d.predicted - d.queue + q - d.actual) / d.actual)
    return {m: quantiles(e) for m, e in errors.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.queue_replay", description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="decisions.json files (one run each)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="decisions left out at the start")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    doc = {}
    for path in args.logs:
        with open(path) as f:
            doc[path] = replay(json.load(f), args.warmup)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    for path, models in doc.items():
        if not models["recorded"]["n"]:
            print(f"{path}: no priced decision after the warm-up")
            continue
        cells = "  ".join(f"{m} {v['p50']:.3f} / {v['p90']:.3f}" for m, v in models.items())
        print(f"{path}: n {models['recorded']['n']}  |pred - actual| / actual p50 / p90:  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
