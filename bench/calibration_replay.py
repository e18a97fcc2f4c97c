"""Replay a live run's prefills through the MFU line, to compare ways of fitting it on what the engines really did.

Input: ``decisions.json`` files (a run's ``/kvstack/decisions`` records, as ``bench.live_compare`` keeps them in its
work directory, one per run). Per file and replica, in decision order, each request's engine prefill (the
``prefill`` stage of the record's ``router.decision.RequestTimeline``: vLLM's scheduled → first token) against its
FLOPs (``router.cost.prefill_flops`` of the prompt and the tokens the engine reused) is predicted from the line
fitted on the replica's earlier prefills, then fed to it. Output, per file and fit (``OnlineLine`` plain least
squares over the prefill's FLOPs; ``relative``: each sample weighs 1/y², the router's line before it priced the
attention apart; ``router``: the router's ``MfuEstimator`` as it is, with the attention at a rate of its own once
the prefills tell it apart): the median |predicted − actual| / actual per action after the run's first
``--warmup`` decisions, and over all actions.

Offline and pure apart from reading the files; what the router's ``Calibrator`` does live, minus the start-up probe
(its samples are not in the records). Run: ``python -m bench.calibration_replay --model tiny-qwen3-heavy
WORK/cost_based/decisions.json ... [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from bench.decision_audit import DEFAULT_WARMUP
from configs.loader import load_models
from configs.schema import GpuProfile, ModelSpec
from router.calibration import MfuEstimator, OnlineLine
from router.cost import Hardware, prefill_flops, prefill_terms
from router.decision import RequestTimeline


class PrefillFit(Protocol):
    """A prefill-time fit replayed over a run: seconds of a prefill of ``prompt`` tokens with ``cached`` reused."""

    @property
    def ready(self) -> bool: ...

    def predict(self, prompt: int, cached: int) -> float: ...

    def observe(self, prompt: int, cached: int, seconds: float) -> None: ...


class OneMfu:
    """One line over the prefill's FLOPs, both terms at one MFU (``OnlineLine``): the router before it priced the
    attention apart."""

    def __init__(self, model: ModelSpec, line: OnlineLine) -> None:
        self.model = model
        self.line = line

    @property
    def ready(self) -> bool:
        return self.line.ready

    def predict(self, prompt: int, cached: int) -> float:
        fit = self.line.fit()
        return math.nan if fit is None else fit[0] + fit[1] * prefill_flops(self.model, prompt, cached)

    def observe(self, prompt: int, cached: int, seconds: float) -> None:
        self.line.observe(prefill_flops(self.model, prompt, cached), seconds)


class RouterFit:
    """The router's own fit (``router.calibration.MfuEstimator``: the attention at a rate of its own once the
    prefills tell it apart)."""

    def __init__(self, model: ModelSpec) -> None:
        gpu = GpuProfile(name="replay", bf16_tflops=1.0, hbm_gbps=1.0, hbm_gib=1.0)  # only the fitted slopes count
        self.model = model
        self.est = MfuEstimator(Hardware(model=model, gpu=gpu, mfu=0.5, bw_util=0.8))

    @property
    def ready(self) -> bool:
        return self.est.proven

    def predict(self, prompt: int, cached: int) -> float:
        got = self.est.predict(*prefill_terms(self.model, prompt, cached))
        return math.nan if got is None else got

    def observe(self, prompt: int, cached: int, seconds: float) -> None:
        self.est.observe(prompt, cached, seconds)


FITS: dict[str, Callable[[ModelSpec], PrefillFit]] = {
    "plain": lambda m: OneMfu(m, OnlineLine()),
    "relative": lambda m: OneMfu(m, OnlineLine(relative=True)),
    "router": RouterFit,
}


def replay(records: Sequence[Mapping[str, Any]], model: ModelSpec, make: Callable[[ModelSpec], PrefillFit], *,
           warmup: int = DEFAULT_WARMUP) -> dict[str, list[float]]:
    """Relative errors of the prefill predictions per action (records after the first ``warmup`` by decision time,
    on a replica whose fit is ready)."""
    lines: dict[str, PrefillFit] = {}
    errors: dict[str, list[float]] = {}
    for i, r in enumerate(sorted(records, key=lambda r: r["decided_at"])):
        if not r.get("timeline") or r.get("actual_ttft_s") is None:
            continue
        seconds = msgspec.convert(r["timeline"], RequestTimeline).stages().get("prefill", 0.0)
        if seconds <= 0:  # vLLM did not report the step (or a zero-length one): nothing to fit
            continue
        prompt = int(r["prompt_tokens"])
        cached = min(int(r.get("actual_cached_tokens") or 0), prompt)
        if prompt <= cached:
            continue
        line = lines.setdefault(r["replica_id"], make(model))
        if line.ready and i >= warmup:
            errors.setdefault(r["action"], []).append(abs(line.predict(prompt, cached) - seconds) / seconds)
        line.observe(prompt, cached, seconds)
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
