"""What a run's decision records (``/kvstack/decisions``) say about the router: placement, reuse, how good the cost
model's predictions were, and whether the router's view of the caches was exact at decision time.

Input: the records as JSON dicts (``router.decision.DecisionRecord`` as msgspec encodes it), any order. Output of
``summarize`` (a JSON-ready dict):
    records, by_replica                requests per replica
    reused_token_fraction              (HBM + fetched tokens) / prompt tokens, as planned
    median_prediction_error_s          per action: median (actual − predicted) TTFT, seconds (every record)
    relative_error                     per action, records after the first ``warmup`` (by decision time):
                                       n, p50 and p90 of |predicted − actual| / actual — issue 13's accuracy check
                                       (after warm-up the median must be <= 0.25); ``all`` pools the actions
    plan_check                         records whose engine reported what it reused (``actual_cached_tokens``):
                                       compared, equal (planned HBM + fetched tokens == what the engine reused),
                                       under / over (the engine reused more / less than planned), and the tokens
                                       of those differences — the router's view of the HBM prefixes at decision time
    outside_router_s                   with the client's request log (``requests``: ``bench agent --save-requests``):
                                       client TTFT − the router's (``actual_ttft_s``: ingress handler start to the
                                       first chunk at the ingress) per request, p50 / p90 / max — the time spent in
                                       the HTTP proxy, the client and the queues before the ingress, which no
                                       decision sees. Matched by the completion id, else (older logs) by prompt
                                       length in send order (``matched_by``).
    stages_s                           per action, per stage of the request's timeline
                                       (``router.decision.RequestTimeline.stages``: ingress, plan, engine_wait,
                                       prefill, pool_wait, ...): n, p50, p90, mean seconds — where the time went
Pure (no I/O). Called by ``bench.live_compare`` (after each run, and again when a report is rebuilt from a work dir).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from router.decision import RequestTimeline

#: Decisions of a run left out of the accuracy figures: the calibrator fits the replicas' prefill rate and the
#: tiers' bandwidth from the first finished requests (``router.calibration``, 5 observations per fit).
DEFAULT_WARMUP = 10


def quantiles(values: list[float]) -> dict[str, Any]:
    """n, p50 and p90 of ``values`` (None for an empty list): the accuracy figures' shape."""
    if not values:
        return {"n": 0, "p50": None, "p90": None}
    arr = np.asarray(values, dtype=float)
    return {"n": int(arr.size), "p50": float(np.quantile(arr, 0.5)), "p90": float(np.quantile(arr, 0.9))}


def outside_router(ordered: Sequence[Mapping[str, Any]], requests: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Client TTFT − router TTFT per matched request (``ordered``: the records by decision time): quantiles, max,
    mean and how requests were matched."""
    gaps, matched_by = outside_router_gaps(ordered, requests)
    out = quantiles(gaps)
    out.update(max=max(gaps) if gaps else None, mean=float(np.mean(gaps)) if gaps else None, matched_by=matched_by)
    return out


def outside_router_gaps(ordered: Sequence[Mapping[str, Any]], requests: Iterable[Mapping[str, Any]]
                        ) -> tuple[list[float], str]:
    """(client TTFT − router TTFT of every matched request, how they were matched)."""
    timed = [r for r in requests if r.get("ttft_s") is not None and not r.get("error")]
    by_id = {str(r.get("request_id")): r for r in ordered if r.get("actual_ttft_s") is not None}
    gaps: list[float] = []
    if any(r.get("response_id") for r in timed):
        matched_by = "completion id"
        for q in timed:
            rec = by_id.get(str(q.get("response_id")))
            if rec is not None:
                gaps.append(float(q["ttft_s"]) - float(rec["actual_ttft_s"]))
    else:
        matched_by = "prompt tokens"
        queues: dict[int, list[Mapping[str, Any]]] = {}
        for rec in by_id.values():
            queues.setdefault(int(rec.get("prompt_tokens") or -1), []).append(rec)
        for q in sorted(timed, key=lambda r: float(r.get("sent_at_s") or 0.0)):
            same = queues.get(int(q.get("prompt_tokens") or -2))
            if same:
                gaps.append(float(q["ttft_s"]) - float(same.pop(0)["actual_ttft_s"]))
    return gaps, matched_by


def stagequantiles(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``stages_s`` of the module docstring: records without a timeline are left out."""
    by_action: dict[str, dict[str, list[float]]] = {}
    for r in records:
        if not r.get("timeline"):
            continue
        stages = msgspec.convert(r["timeline"], RequestTimeline).stages()
        per = by_action.setdefault(str(r.get("action")), {})
        for name, seconds in stages.items():
            per.setdefault(name, []).append(float(seconds))
    return {action: {name: {**quantiles(v), "mean": float(np.mean(v))} for name, v in per.items()}
            for action, per in sorted(by_action.items())}


def summarize(records: Iterable[Mapping[str, Any]], *, warmup: int = DEFAULT_WARMUP,
              requests: Iterable[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The module docstring's summary of one run's records (and, with ``requests``, the client's view of them)."""
    ordered = sorted(records, key=lambda r: float(r.get("decided_at") or 0.0))
    by_replica: dict[str, int] = {}
    errors: dict[str, list[float]] = {}
    relative: dict[str, list[float]] = {}
    prompt = reused = 0
    compared = equal = under = over = under_tokens = over_tokens = 0
    for i, r in enumerate(ordered):
        rid = str(r.get("replica_id"))
        by_replica[rid] = by_replica.get(rid, 0) + 1
        planned = int(r.get("hbm_tokens") or 0) + int(r.get("fetched_tokens") or 0)
        prompt += int(r.get("prompt_tokens") or 0)
        reused += planned
        action = str(r.get("action"))
        if r.get("prediction_error_s") is not None:
            errors.setdefault(action, []).append(float(r["prediction_error_s"]))
        actual, predicted = r.get("actual_ttft_s"), r.get("predicted_ttft_s")
        if i >= warmup and actual is not None and predicted is not None and float(actual) > 0:
            relative.setdefault(action, []).append(abs(float(predicted) - float(actual)) / float(actual))
        engine = r.get("actual_cached_tokens")
        if engine is not None:
            compared += 1
            diff = int(engine) - planned
            if diff == 0:
                equal += 1
            elif diff > 0:
                under, under_tokens = under + 1, under_tokens + diff
            else:
                over, over_tokens = over + 1, over_tokens - diff
    rel = {a: quantiles(v) for a, v in sorted(relative.items())}
    rel["all"] = quantiles([x for v in relative.values() for x in v])
    extra = {} if requests is None else {"outside_router_s": outside_router(ordered, requests)}
    return {
        **extra,
        "records": len(ordered),
        "by_replica": by_replica,
        "reused_token_fraction": (reused / prompt) if prompt else None,
        "median_prediction_error_s": {a: float(np.median(v)) for a, v in errors.items()},
        "stages_s": stagequantiles(ordered),
        "warmup_decisions": warmup,
        "relative_error": rel,
        "plan_check": {"compared": compared, "equal": equal, "under": under, "over": over,
                       "under_tokens": under_tokens, "over_tokens": over_tokens},
    }
