"""The live engine's prefill time as its queue sees it, fitted on its busy periods (issue 13, item 6).

Who calls it: ``bench.sim_live`` fits one ``EngineCost`` on every run of a live comparison and hands it to the
simulator (``bench.simulate.SimConfig.engine_cost``), which then times each simulated prefill with it. The policy
inside the simulator still prices with the router's own model (``router.cost``: FLOPs at a fitted MFU and attention
scale), as the live router did: this module models what the engine did, not what the router believed.

Why not the router's fit: the router's ``MfuEstimator`` fits the prefills timed alone, weighted for relative error
(its predictions are judged that way). A queue sees engine-seconds, so the simulated engine must spend what the live
one spent in total, and the live prefills that overlapped others are most of an overloaded run's work. Until the
router priced the attention apart (``Hardware.attn_scale``), its one MFU for both terms of the FLOPs
(``router.cost.work_flops``) did not fit a CPU engine either: fitted apart on two live comparisons of the tiny heavy
model, the attention term cost ~0.3 of what the matrix products cost per FLOP, so a short suffix over a long cached
prefix (every pool-on revisit) took far less than a one-MFU line says, while the long cold prefills (every pool-off
turn) took more; the simulator was 0.68-0.70 of the live TTFT p50 for the overloaded pool-off configurations of
``bench/reports/live_agent_overflow/overloaded_avx2_box_at_ef7569b``, and up to 1.25 for cost_based once one MFU
was fitted on busy time.

The model, per replica: while at least one prefill is in flight the engine works on them (vLLM's continuous batching
is work-conserving), so a busy period — a maximal union of overlapping [scheduled, first token] intervals on one
replica, on the engine's own clock — lasts the sum of its prefills' service times::

    seconds ≈ n · overhead + per_token_s · Σ (P − c) + per_token_sq_s · Σ (P² − c²)

(P prompt tokens, c cached). The fixed cost per prefill (``overhead``) is the caller's (the router's fit of the
short prefills sets it well; the busy periods cannot separate it from the slopes), the two slopes are least squares
over the periods with both kept ≥ 0. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Fewer busy periods than this fit nothing: the caller keeps the cost model's FLOPs.
MIN_PERIODS = 5


@dataclass(frozen=True, slots=True)
class BusyPeriod:
    """One replica's engine busy without a break: its prefills' totals and how long it took."""

    prefills: int
    tokens: float  # Σ (P − c)
    tokens_sq: float  # Σ (P² − c²)
    seconds: float


@dataclass(frozen=True, slots=True)
class EngineCost:
    """A prefill's service time on the live engine, without the fixed cost per prefill (the simulator adds it)."""

    per_token_s: float
    per_token_sq_s: float
    overhead_s: float  # the fixed cost the fit took as given (for the report; ``SimConfig.prefill_overhead_s``)
    periods: int  # busy periods fitted

    def __post_init__(self) -> None:
        terms = (self.per_token_s, self.per_token_sq_s, self.overhead_s)
        if min(terms) < 0 or self.per_token_s + self.per_token_sq_s <= 0:
            raise ValueError(f"engine cost needs non-negative terms and a positive slope, got {self}")

    def prefill_s(self, tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to compute positions [cached_tokens, tokens)."""
        return self.per_token_s * (tokens - cached_tokens) + self.per_token_sq_s * (tokens**2 - cached_tokens**2)

    def to_json(self) -> dict[str, Any]:
        return {"per_token_s": self.per_token_s, "per_token_sq_s": self.per_token_sq_s,
                "overhead_s": self.overhead_s, "busy_periods": self.periods}


Interval = tuple[str, float, float, int, int]  # (replica, scheduled, first token, prompt tokens, cached tokens)


def engine_intervals(records: Iterable[Mapping[str, Any]]) -> list[Interval]:
    """The prefills one run's decision records timed on the engines (``DecisionRecord.timeline``) that computed
    something, as [scheduled, first token] on one clock: the replica's stamps count from its receipt of the
    request; ``decided_at`` puts them on the router's (give or take the transport to the replica)."""
    out: list[Interval] = []
    for r in records:
        rep = (r.get("timeline") or {}).get("replica") or {}
        cached = r.get("actual_cached_tokens")
        if rep.get("first_token_s") is None or rep.get("scheduled_s") is None or cached is None:
            continue
        at = float(r.get("decided_at") or 0.0)
        t0, t1 = at + float(rep["scheduled_s"]), at + float(rep["first_token_s"])
        prompt = int(r.get("prompt_tokens") or 0)
        if t1 > t0 and prompt > int(cached):
            out.append((str(r.get("replica_id")), t0, t1, prompt, int(cached)))
    return out


def busy_periods(records: Iterable[Mapping[str, Any]]) -> list[BusyPeriod]:
    """The busy periods of one run's engines: each replica's ``engine_intervals`` merged where they overlap."""
    by_replica: dict[str, list[tuple[float, float, int, int]]] = defaultdict(list)
    for replica, t0, t1, prompt, cached in engine_intervals(records):
        by_replica[replica].append((t0, t1, prompt, cached))
    periods: list[BusyPeriod] = []
    for intervals in by_replica.values():
        intervals.sort()
        start = end = 0.0
        members: list[tuple[int, int]] = []
        for t0, t1, prompt, cached in intervals:
            if members and t0 < end:
                end = max(end, t1)
            else:
                if members:
                    periods.append(_period(members, end - start))
                start, end, members = t0, t1, []
            members.append((prompt, cached))
        if members:
            periods.append(_period(members, end - start))
    return periods


def _period(members: Sequence[tuple[int, int]], seconds: float) -> BusyPeriod:
    return BusyPeriod(prefills=len(members), tokens=float(sum(p - c for p, c in members)),
                      tokens_sq=float(sum(p * p - c * c for p, c in members)), seconds=seconds)


def fit_engine_cost(periods: Sequence[BusyPeriod], overhead_s: float) -> EngineCost | None:
    """Least squares of the two slopes over ``periods`` given the fixed cost per prefill (module docstring); a
    slope that comes out negative is dropped and the other refitted alone. None with fewer than ``MIN_PERIODS``
    periods or nothing positive to fit."""
    if overhead_s < 0:
        raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
    if len(periods) < MIN_PERIODS:
        return None
    x = np.array([[p.tokens, p.tokens_sq] for p in periods], dtype=float)
    y = np.array([p.seconds - p.prefills * overhead_s for p in periods], dtype=float)
    slopes, *_ = np.linalg.lstsq(x, y, rcond=None)
    if slopes[0] < 0 or slopes[1] < 0:
        keep = 1 if slopes[0] < 0 else 0
        col = x[:, keep]
        one = float(col @ y / (col @ col)) if col @ col > 0 else 0.0
        slopes = np.zeros(2)
        slopes[keep] = max(0.0, one)
    if slopes.sum() <= 0:
        return None
    return EngineCost(per_token_s=float(slopes[0]), per_token_sq_s=float(slopes[1]), overhead_s=overhead_s,
                      periods=len(periods))
