"""Replay a live run's prefills through the MFU line, to compare ways of fitting it on what the engines really did.

Input: ``decisions.json`` files (a run's ``/kvstack/decisions`` records, as ``bench.live_compare`` keeps them in its
work directory, one per run). Per file and replica, in decision order, each request's engine prefill (the
``prefill`` stage of the record's ``router.decision.RequestTimeline``: vLLM's scheduled → first token) against its
FLOPs (``router.cost.prefill_flops`` of the prompt and the tokens the engine reused) is predicted from the line
fitted on the replica's earlier prefills, then fed to it. Output, per file and fit (``OnlineLine`` plain least
squares, and ``relative``: each sample weighs 1/y², the router's; ``relative_batch``: the same weights over every
earlier prefill at once, without decay or outlier rejection; ``two_slope``: like ``relative_batch`` with the
attention FLOPs at a rate of their own, ``TwoSlope``): the median |predicted − actual| / actual per action after the
run's first ``--warmup`` decisions, and over all actions.

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
import numpy as np

from bench.decision_audit import DEFAULT_WARMUP
from configs.loader import load_models
from configs.schema import ModelSpec
from router.calibration import OnlineLine
from router.cost import work_flops
from router.decision import RequestTimeline


class PrefillFit(Protocol):
    """A prefill-time fit replayed over a run: seconds from the prefill's linear and attention FLOPs."""

    @property
    def ready(self) -> bool: ...

    def predict(self, linear: float, attention: float) -> float: ...

    def observe(self, linear: float, attention: float, seconds: float) -> None: ...


class OneMfu:
    """The router's model: one line over the prefill's FLOPs, both terms at one MFU (``OnlineLine``)."""

    def __init__(self, line: OnlineLine) -> None:
        self.line = line

    @property
    def ready(self) -> bool:
        return self.line.ready

    def predict(self, linear: float, attention: float) -> float:
        fit = self.line.fit()
        return math.nan if fit is None else fit[0] + fit[1] * (linear + attention)

    def observe(self, linear: float, attention: float, seconds: float) -> None:
        self.line.observe(linear + attention, seconds)


class TwoSlope:
    """Relative least squares (each sample weighs 1/seconds²) of seconds ≈ a + b₁·linear FLOPs + b₂·attention FLOPs
    over every prefill seen, refitted per prediction (offline: no decay, no outlier rejection). ``two=False`` fits
    one slope over their sum, the same way (``relative_batch``: what ``two_slope`` is compared with). A fit with a
    negative coefficient falls back to the one-slope fit, then to a line through the origin."""

    def __init__(self, *, two: bool = True, min_obs: int = 5) -> None:
        self.two = two
        self.min_obs = min_obs
        self.rows: list[tuple[float, float, float]] = []

    @property
    def ready(self) -> bool:
        return len(self.rows) >= self.min_obs

    def _coef(self) -> tuple[float, float, float]:
        x = np.array(self.rows, dtype=float)
        y, w = x[:, 2], 1.0 / x[:, 2]
        designs = ([np.c_[np.ones(len(x)), x[:, 0], x[:, 1]]] if self.two else []) + [
            np.c_[np.ones(len(x)), x[:, 0] + x[:, 1]]]
        for design in designs:
            coef, *_ = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)
            if (coef >= 0).all() and coef[1:].sum() > 0:
                return (float(coef[0]), float(coef[1]), float(coef[2] if len(coef) == 3 else coef[1]))
        total = x[:, 0] + x[:, 1]
        b = float((total * w) @ (y * w) / ((total * w) @ (total * w)))
        return 0.0, b, b

    def predict(self, linear: float, attention: float) -> float:
        a, b1, b2 = self._coef()
        return a + b1 * linear + b2 * attention

    def observe(self, linear: float, attention: float, seconds: float) -> None:
        self.rows.append((linear, attention, seconds))


FITS: dict[str, Callable[[], PrefillFit]] = {
    "plain": lambda: OneMfu(OnlineLine()),
    "relative": lambda: OneMfu(OnlineLine(relative=True)),
    "relative_batch": lambda: TwoSlope(two=False),
    "two_slope": lambda: TwoSlope(),
}


def replay(records: Sequence[Mapping[str, Any]], model: ModelSpec, make: Callable[[], PrefillFit], *,
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
        linear = work_flops(model, prompt - cached, 0.0)  # the cost model's two terms (``router.cost``)
        attention = work_flops(model, 0.0, prompt * prompt - cached * cached)
        line = lines.setdefault(r["replica_id"], make())
        if line.ready and i >= warmup:
            errors.setdefault(r["action"], []).append(abs(line.predict(linear, attention) - seconds) / seconds)
        line.observe(linear, attention, seconds)
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
