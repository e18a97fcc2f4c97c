"""``bench.engine_fit``: the live engines' busy periods from decision records, the two-slope fit on them, and the
simulator timing its prefills with the fit (``SimConfig.engine_cost``)."""

from __future__ import annotations

import pytest

from bench.engine_fit import BusyPeriod, EngineCost, busy_periods, engine_intervals, fit_engine_cost
from bench.simulate import SimConfig, simulate
from bench.traces import TraceRecord
from configs.loader import load_gpus, load_models, load_tiers
from router.cost import Hardware, t_prefill
from router.policies.pricing import TierMap

HW = Hardware(model=load_models()["tiny-qwen3"], gpu=load_gpus()["cpu-2core"], mfu=0.5, bw_util=0.8)
TIERS = TierMap.from_tiers(load_tiers())


def _rec(replica: str, decided: float, scheduled: float, first: float, prompt: int, cached: int) -> dict:
    return {"replica_id": replica, "decided_at": decided, "prompt_tokens": prompt, "actual_cached_tokens": cached,
            "timeline": {"replica": {"scheduled_s": scheduled, "first_token_s": first}}}


def test_busy_periods_merge_the_overlapping_prefills_of_one_replica() -> None:
    records = [
        _rec("a", 10.0, 0.5, 2.5, 1000, 0),  # a: [10.5, 12.5]
        _rec("a", 11.0, 0.0, 3.0, 800, 200),  # a: [11.0, 14.0] overlaps the first: one period [10.5, 14.0]
        _rec("a", 14.0, 0.2, 1.2, 500, 100),  # a: [14.2, 15.2] after a gap: its own period
        _rec("b", 11.0, 0.0, 1.0, 600, 0),  # another replica: its own period, although it overlaps a's in time
        _rec("b", 12.0, 0.0, 1.0, 600, 600),  # computed nothing: not a prefill
        {"replica_id": "b", "decided_at": 13.0, "prompt_tokens": 700, "actual_cached_tokens": 0,
         "timeline": {"replica": {"scheduled_s": 0.1}}},  # no first token (cancelled): not timed
        {"replica_id": "b", "decided_at": 13.0, "prompt_tokens": 700, "timeline": None},  # a router without a timeline
    ]
    assert len(engine_intervals(records)) == 4
    periods = sorted(busy_periods(records), key=lambda p: (-p.prefills, p.tokens))
    assert periods[0] == BusyPeriod(prefills=2, tokens=1000 + 600, tokens_sq=1000**2 + 800**2 - 200**2,
                                    seconds=pytest.approx(3.5))
    assert [(p.prefills, p.tokens, p.seconds) for p in periods[1:]] == [
        (1, 400, pytest.approx(1.0)), (1, 600, pytest.approx(1.0))]


def _periods(per_token: float, per_sq: float, overhead: float) -> list[BusyPeriod]:
    shapes = [(1, 2000, 0), (1, 3000, 0), (2, 2500, 0), (1, 600, 2400), (3, 500, 3000), (1, 200, 1800),
              (2, 1200, 1500)]  # (prefills, tokens computed each, cached each)
    out = []
    for n, new, cached in shapes:
        tokens, tokens_sq = n * new, n * ((cached + new) ** 2 - cached**2)
        out.append(BusyPeriod(n, tokens, tokens_sq, n * overhead + per_token * tokens + per_sq * tokens_sq))
    return out


def test_the_fit_recovers_both_slopes_given_the_fixed_cost() -> None:
    got = fit_engine_cost(_periods(3e-3, 2.5e-7, 0.02), overhead_s=0.02)
    assert got is not None
    assert got.per_token_s == pytest.approx(3e-3, rel=1e-6)
    assert got.per_token_sq_s == pytest.approx(2.5e-7, rel=1e-6)
    assert got.periods == 7 and got.overhead_s == 0.02
    assert got.prefill_s(3000, 2400) == pytest.approx(3e-3 * 600 + 2.5e-7 * (3000**2 - 2400**2))


def test_a_negative_slope_is_dropped_and_too_few_periods_fit_nothing() -> None:
    linear = fit_engine_cost(_periods(3e-3, 0.0, 0.0), overhead_s=0.0)
    assert linear is not None and linear.per_token_sq_s == pytest.approx(0.0, abs=1e-15)
    # periods that cost less the more attention they carry: the attention slope would be negative; it is dropped
    odd = [BusyPeriod(1, 1000, sq, 3.0 - sq * 1e-7) for sq in (1e6, 2e6, 4e6, 8e6, 1.6e7)]
    got = fit_engine_cost(odd, overhead_s=0.0)
    assert got is not None and got.per_token_sq_s == 0.0 and got.per_token_s > 0
    assert fit_engine_cost(_periods(3e-3, 2.5e-7, 0.0)[:4], overhead_s=0.0) is None
    with pytest.raises(ValueError):
        fit_engine_cost(_periods(3e-3, 2.5e-7, 0.0), overhead_s=-1.0)
    with pytest.raises(ValueError):
        EngineCost(per_token_s=0.0, per_token_sq_s=0.0, overhead_s=0.0, periods=5)


def test_the_simulator_times_its_prefills_with_the_engine_cost_while_the_policy_prices_with_its_model() -> None:
    recs = [TraceRecord(0, 0.0, 1024, 1, (1, 2), 512), TraceRecord(1, 60_000.0, 1536, 1, (1, 2, 3), 512)]
    engine = EngineCost(per_token_s=2e-3, per_token_sq_s=1e-7, overhead_s=0.0, periods=5)
    base = dict(nodes=1, policy="round_robin", hw=HW, tier_map=TIERS, prefill_overhead_s=0.01)
    model = simulate(recs, SimConfig(**base))  # type: ignore[arg-type]
    measured = simulate(recs, SimConfig(**base, engine_cost=engine))  # type: ignore[arg-type]
    assert model.ttft_s[0] == pytest.approx(t_prefill(HW.model, HW.gpu, 1024, mfu=HW.mfu) + 0.01)
    assert measured.ttft_s[0] == pytest.approx(engine.prefill_s(1024) + 0.01)
    # the second turn reuses the first's 1,024 tokens from HBM and computes 512 more
    assert measured.ttft_s[1] == pytest.approx(engine.prefill_s(1536, 1024) + 0.01)
    assert measured.predicted_ttft_s == pytest.approx(model.predicted_ttft_s)  # the policy's own model
    assert SimConfig(**base, engine_cost=engine).describe()["engine_cost"]["per_token_s"] == 2e-3  # type: ignore
