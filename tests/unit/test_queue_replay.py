"""bench.queue_replay: a decision log re-priced with the queue models; a holder decided while a long cold prefill
had mostly run on its replica is priced right by the head model and far off by the whole waiting work."""

from __future__ import annotations

import json

import pytest

from bench.queue_replay import main, replay


def record(rid: str, decided: float, queue: float, prefill: float, actual: float, replica: str = "r") -> dict:
    return {"request_id": rid, "replica_id": replica, "decided_at": decided, "predicted_ttft_s": queue + prefill,
            "actual_ttft_s": actual, "reason": f"holder {replica}: ttft = queue {queue:.4f} + prefill(2000−1900 "
                                               f"cached tok) {prefill:.4f} = {queue + prefill:.4f}s",
            "timeline": {"ingress_s": 0.01, "replica": {"first_token_s": actual - 0.01}}}


def test_the_head_model_takes_the_done_part_of_the_oldest_prefill_off(tmp_path) -> None:
    records = [
        record("cold", 0.0, 0.1, 8.0, 8.1),  # a cold prefill of 8 s, alone
        record("other", 1.0, 0.1, 1.0, 1.1, replica="q"),  # another replica: not in r's queue
        record("late", 6.0, 8.1, 0.5, 2.6),  # priced behind all 8 s; it had 2 s left to wait
        record("no reason", 7.0, 0.1, 0.5, 0.6) | {"reason": ""},  # not a priced decision: left out
    ]
    out = replay(records, warmup=0)
    assert out["head"]["n"] == 3
    late = 8.1 + 0.5  # predicted; the recorded errors are [0, 0, |late − 2.6| / 2.6], whose p90 interpolates to 0.8×
    assert out["recorded"]["p90"] == pytest.approx(0.8 * abs(late - 2.6) / 2.6, rel=0.05)
    assert out["head"]["p50"] == pytest.approx(0.0, abs=0.01) and out["head"]["p90"] == pytest.approx(0.0, abs=0.01)
    assert out["waiting"]["p90"] > 1.0  # the whole 8 s still counted
    path = tmp_path / "decisions.json"
    path.write_text(json.dumps(records))
    assert main([str(path), "--warmup", "0"]) == 0
