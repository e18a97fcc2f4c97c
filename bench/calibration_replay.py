"""Replay a live run's prefills through the MFU line, to compare ways of fitting it on what the engines really did.

Input: ``decisions.json`` files (a run's ``/kvstack/decisions`` records, as ``bench.live_compare`` keeps them in its
work directory, one per run). Per file and replica, in decision order, each request's engine prefill (the
``prefill`` stage of the record's ``router.decision.RequestTimeline``: vLLM's scheduled → first token) against its
FLOPs (``router.cost.prefill_flops`` of the prompt and the tokens the engine reused) is predicted from the line
fitted on the replica's earlier prefills, then fed to it. Output, per file and fit (``OnlineLine`` plain least
squares, and ``relative``: each sample weighs 1/y²): the median |predicted − actual| / actual per action after the
run's first ``--warmup`` decisions, and over all actions.

Offline and pure apart from reading the files; what the router's ``Calibrator`` does live, minus the start-up probe
(its samples are not in the records). Run: ``python -m bench.calibration_replay --model tiny-qwen3-heavy
WORK/cost_based/decisions.json ... [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.decision_audit import DEFAULT_WARMUP
from configs.loader import load_models
from configs.schema import ModelSpec
from router.calibration import OnlineLine
from router.cost import prefill_flops
from router.decision import RequestTimeline

FITS: dict[str, Callable[[], OnlineLine]] = {
    "plain": lambda: OnlineLine(),
    "relative": lambda: OnlineLine(relative=True),
}


def replay(records: Sequence[Mapping[str, Any]], model: ModelSpec, make: Callable[[], OnlineLine], *,
           warmup: int = DEFAULT_WARMUP) -> dict[str, list[float]]:
    """Relative errors of the prefill predictions per action (records after the first ``warmup`` by decision time,
    on a replica whose line is ready)."""
    lines: dict[str, OnlineLine] = {}
    errors: dict[str, list[float]] = {}
    for i, r in enumerate(sorted(records, key=lambda r: r["decided_at"])):
        if not r.get("timeline") or r.get("actual_ttft_s") is None:
            continue
        seconds = msgspec.convert(r["timeline"], RequestTimeline).stages().get("prefill", 0.0)
        if seconds <= 0:  # vLLM did not report the step (or a zero-length one): nothing to fit
            continue
        prompt = int(r["prompt_tokens"])
        x = prefill_flops(model, prompt, min(int(r.get("actual_cached_tokens") or 0), prompt))
        if x <= 0:
            continue
        line = lines.setdefault(r["replica_id"], make())
        fit = line.fit() if line.ready else None
        if fit is not None and i >= warmup:
            errors.setdefault(r["action"], []).append(abs(fit[0] + fit[1] * x - seconds) / seconds)
        line.observe(x, seconds)
    return errors


def summarize(errors: Mapping[str, list[float]]) -> dict[str, Any]:
    pooled = [e for v in errors.values() for e in v]
    out: dict[str, Any] = {a: {"n": len(v), "p50": statistics.median(v)} for a, v in sorted(errors.items()) if v}
    out["all"] = {"n": len(pooled), "p50": statistics.median(pooled) if pooled else None}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibration_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="decisions.json files (one per run)")
    parser.add_argument("--model", required=True, help="the served model's spec name (configs), e.g. tiny-qwen3-heavy")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    models = load_models()
    if args.model not in models:
        parser.error(f"unknown model {args.model!r}; known: {', '.join(sorted(models))}")
    model = models[args.model]
    result = {}
    for path in args.files:
        records = json.loads(path.read_text())
        result[str(path)] = {name: summarize(replay(records, model, make, warmup=args.warmup))
                             for name, make in FITS.items()}
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    for path, fits in result.items():
        cells = [f"{name}: all {s['all']['p50']:.2f}" if s["all"]["p50"] is not None else f"{name}: -"
                 for name, s in fits.items()]
        print(f"{path}  " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
