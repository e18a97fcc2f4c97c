"""``bench.calibration_replay``: a run's prefills replayed through the MFU line, plain and relative fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import calibration_replay


def _records() -> list[dict]:  # type: ignore[type-arg]
    """A sequential run's shape: noisy same-size first turns, short revisits on top of them (live numbers)."""
    first = [0.589, 0.510, 0.504, 0.165, 0.309, 0.178, 0.326, 0.280, 0.310, 0.226]
    revisit = [0.035, 0.030, 0.028, 0.038, 0.036, 0.032, 0.030, 0.028, 0.031, 0.028]
    out = []
    for s in range(10):
        for turn, (seconds, prompt, cached, action) in enumerate(
                [(first[s], 1960, 0, "recompute"), (revisit[s], 2085, 1920, "holder")]):
            out.append({"decided_at": 10.0 * s + turn, "replica_id": "r0", "action": action, "prompt_tokens": prompt,
                        "actual_cached_tokens": cached, "actual_ttft_s": seconds + 0.02,
                        "timeline": {"ingress_s": 0.008, "replica": {
                            "plan_s": 0.0, "queued_s": 0.001, "scheduled_s": 0.002, "first_token_s": 0.002 + seconds,
                            "first_chunk_s": 0.003 + seconds}}})
    out.append({"decided_at": 99.0, "replica_id": "r0", "action": "holder", "prompt_tokens": 10,
                "actual_ttft_s": None, "timeline": None})  # unfinished: skipped
    out.append({"decided_at": 98.0, "replica_id": "r0", "action": "holder", "prompt_tokens": 2085,
                "actual_cached_tokens": 1920, "actual_ttft_s": 0.05,
                "timeline": {"ingress_s": 0.008, "replica": {"plan_s": 0.0, "queued_s": 0.001, "first_token_s": 0.04,
                                                             "first_chunk_s": 0.041}}})  # not scheduled (-1): skipped
    return out


def test_the_relative_fit_predicts_the_short_prefills_where_plain_least_squares_does_not() -> None:
    from configs.loader import load_models

    model = load_models()["tiny-qwen3-heavy"]
    plain = calibration_replay.summarize(calibration_replay.replay(_records(), model, calibration_replay.FITS["plain"]))
    relative = calibration_replay.summarize(
        calibration_replay.replay(_records(), model, calibration_replay.FITS["relative"]))
    assert plain["holder"]["n"] == relative["holder"]["n"] == 5  # decisions 11-20, the revisits among them
    assert plain["holder"]["p50"] > 0.5
    assert relative["holder"]["p50"] < 0.25
    assert relative["all"]["p50"] < plain["all"]["p50"]


def test_the_command_prints_one_json_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "decisions.json"
    path.write_text(json.dumps(_records()))
    assert calibration_replay.main([str(path), "--model", "tiny-qwen3-heavy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc[str(path)]) == {"plain", "relative", "router"}
    with pytest.raises(SystemExit):
        calibration_replay.main([str(path), "--model", "no-such-model"])
