"""``bench.decision_audit.summarize``: accuracy after warm-up per action, and the plan-vs-engine check."""

from __future__ import annotations

import pytest

from bench.decision_audit import summarize


def _rec(t: float, action: str, predicted: float, actual: float | None, *, hbm: int = 0, fetched: int = 0,
         engine: int | None = None, replica: str = "r0") -> dict:
    return {"decided_at": t, "action": action, "replica_id": replica, "prompt_tokens": 1000, "hbm_tokens": hbm,
            "fetched_tokens": fetched, "predicted_ttft_s": predicted, "actual_ttft_s": actual,
            "prediction_error_s": None if actual is None else actual - predicted, "actual_cached_tokens": engine}


def test_relative_error_skips_the_warm_up_and_splits_by_action() -> None:
    # The warm-up records (decided first, given out of order) are wildly off; the rest are 10% / 50% off.
    records = [_rec(100.0 + i, "holder", 1.1, 1.0, hbm=512, engine=512) for i in range(6)]
    records += [_rec(200.0 + i, "fetch", 1.5, 1.0, fetched=768, engine=768) for i in range(4)]
    records += [_rec(float(i), "recompute", 0.01, 5.0) for i in range(3)]
    s = summarize(list(reversed(records)), warmup=3)
    assert s["records"] == 13 and s["warmup_decisions"] == 3
    assert "recompute" not in s["relative_error"]
    assert s["relative_error"]["holder"] == {"n": 6, "p50": pytest.approx(0.1), "p90": pytest.approx(0.1)}
    assert s["relative_error"]["fetch"]["p50"] == pytest.approx(0.5)
    assert s["relative_error"]["all"]["n"] == 10
    assert s["median_prediction_error_s"]["recompute"] == pytest.approx(4.99)  # every record, warm-up included
    assert s["reused_token_fraction"] == pytest.approx((6 * 512 + 4 * 768) / 13000)


def test_plan_check_counts_what_the_engine_reused_against_the_plan() -> None:
    records = [_rec(1, "holder", 1, 1, hbm=512, engine=512), _rec(2, "holder", 1, 1, hbm=512, engine=640),
               _rec(3, "fetch", 1, 1, hbm=128, fetched=512, engine=512), _rec(4, "recompute", 1, None)]
    pc = summarize(records, warmup=0)["plan_check"]
    assert pc == {"compared": 3, "equal": 1, "under": 1, "over": 1, "under_tokens": 128, "over_tokens": 128}


def test_no_records() -> None:
    s = summarize([], warmup=10)
    assert s["records"] == 0 and s["reused_token_fraction"] is None
    assert s["relative_error"] == {"all": {"n": 0, "p50": None, "p90": None}}


def test_outside_router_matches_the_client_log_by_completion_id_or_prompt_length() -> None:
    recs = [dict(_rec(1.0, "holder", 1, 0.5), request_id="chatcmpl-a", prompt_tokens=100),
            dict(_rec(2.0, "fetch", 1, 0.25), request_id="chatcmpl-b", prompt_tokens=200)]
    by_id = [{"response_id": "chatcmpl-b", "ttft_s": 1.25, "sent_at_s": 0.0, "prompt_tokens": 200},
             {"response_id": "chatcmpl-a", "ttft_s": 0.75, "sent_at_s": 1.0, "prompt_tokens": 100},
             {"response_id": "chatcmpl-x", "ttft_s": None, "error": "APITimeoutError", "sent_at_s": 2.0}]
    out = summarize(recs, warmup=0, requests=by_id)["outside_router_s"]
    assert out["matched_by"] == "completion id" and out["n"] == 2
    assert out["max"] == pytest.approx(1.0) and out["mean"] == pytest.approx(0.625)
    by_len = [{"ttft_s": 0.75, "sent_at_s": 0.0, "prompt_tokens": 100}, {"ttft_s": 0.5, "sent_at_s": 1.0,
                                                                         "prompt_tokens": 200}]
    out = summarize(recs, warmup=0, requests=by_len)["outside_router_s"]
    assert out["matched_by"] == "prompt tokens" and out["n"] == 2 and out["max"] == pytest.approx(0.25)
    assert "outside_router_s" not in summarize(recs, warmup=0)


def test_stages_split_where_the_time_went_per_action() -> None:
    def timed(t: float, action: str, wait: float, prefill: float, pool: bool) -> dict:
        replica = {"plan_s": 0.001, "queued_s": 0.002, "scheduled_s": 0.002 + wait,
                   "first_token_s": 0.002 + wait + prefill, "first_chunk_s": 0.003 + wait + prefill}
        pool_t = {"lookup_s": 0.004, "lease_s": 0.005, "wait_s": 0.006} if pool else None
        return dict(_rec(t, action, 1, 1), timeline={"ingress_s": 0.01, "transport_s": 0.005, "replica": replica,
                                                       "pool": pool_t})

    records = [timed(1, "fetch", 0.02, 0.1, True), timed(2, "fetch", 0.04, 0.3, True),
               timed(3, "recompute", 0.0, 1.0, False), _rec(4, "holder", 1, 1)]
    st = summarize(records, warmup=0)["stages_s"]
    assert set(st) == {"fetch", "recompute"}  # a record without a timeline is left out
    assert st["fetch"]["engine_wait"]["n"] == 2 and st["fetch"]["engine_wait"]["mean"] == pytest.approx(0.03)
    assert st["fetch"]["prefill"]["p50"] == pytest.approx(0.2) and st["fetch"]["pool_wait"]["p50"] == 0.006
    assert "pool_wait" not in st["recompute"] and st["recompute"]["prefill"]["mean"] == pytest.approx(1.0)
