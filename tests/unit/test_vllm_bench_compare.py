"""``bench.vllm_bench_compare``: the argv it hands vLLM's ``vllm bench serve``, and the report it builds from vLLM's
detailed results (pooled TTFTs of successful requests, ratios, greedy outputs per prompt). Servers and vLLM's load
generator are the live part (run by hand; the report in ``bench/reports``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import vllm_bench_compare as vbc
from cluster import cli


def result(ttfts: list[float], texts: list[str], errors: list[str] | None = None) -> dict:
    errors = errors or [""] * len(ttfts)
    return {"completed": sum(1 for e in errors if not e), "failed": sum(1 for e in errors if e), "ttfts": ttfts,
            "errors": errors, "generated_texts": texts, "median_ttft_ms": 1000 * sorted(ttfts)[len(ttfts) // 2],
            "p99_ttft_ms": 1000 * max(ttfts), "output_throughput": 10.0, "duration": 5.0,
            "latencies": [t + 0.9 if t else 0.0 for t in ttfts], "output_lens": [10 if t else 0 for t in ttfts],
            "itls": [[0.1] * 9 if t else [] for t in ttfts]}


def test_the_argv_is_the_endpoint_and_result_file_then_the_users_vllm_arguments(tmp_path: Path) -> None:
    argv = vbc.bench_argv(8123, "m", Path("/models/m"), tmp_path, ["--dataset-name", "random", "--num-prompts", "8"])
    assert argv[1:3] == ["-m", "bench.vllm_bench_serve"]
    joined = " ".join(argv)
    assert "--base-url http://127.0.0.1:8123" in joined and "--endpoint /v1/chat/completions" in joined
    assert "--save-detailed" in argv and f"--result-dir {tmp_path}" in joined
    assert argv[-4:] == ["--dataset-name", "random", "--num-prompts", "8"]  # the user's last: theirs win
    parser = argparse.ArgumentParser()
    vbc.configure(parser)
    args = parser.parse_args(["--configs", "cost_based", "--", "--num-prompts", "4"])
    assert args.vllm_args == ["--", "--num-prompts", "4"]  # run() drops the separator
    assert any(name == "vllm-compare" and mod == "bench.vllm_bench_compare" for name, mod, _ in cli.BENCH_COMMANDS)


def test_the_report_pools_successful_requests_and_compares_outputs_per_prompt() -> None:
    entries = [
        {"config": "ray_serve_llm", "repeat": 1, "result": result([0.4, 0.5, 0.6, 0.0], ["a", "b", "c", ""],
                                                                  ["", "", "", "timeout"])},
        {"config": "cost_based", "repeat": 1, "result": result([0.1, 0.2, 0.3, 0.2], ["a", "b", "x", "d"])},
        {"config": "cost_based", "repeat": 2, "result": result([0.1, 0.2, 0.3, 0.2], ["a", "b", "c", "d"]),
         "decisions": {"relative_error": {"fetch": {"n": 3, "p50": 0.21, "p90": 0.4},
                                          "holder": {"n": 0, "p50": None, "p90": None},
                                          "all": {"n": 3, "p50": 0.21, "p90": 0.4}},
                       "reused_token_fraction": 0.5, "plan_check": {"compared": 4, "equal": 4}}},
        {"config": "round_robin", "repeat": 1, "error": "RuntimeError: did not start"},
    ]
    agg = vbc.aggregate(entries, "cost_based")
    assert agg["configs"] == ["ray_serve_llm", "cost_based", "round_robin"]
    assert agg["ttft_s"]["ray_serve_llm"]["n"] == 3  # the failed request has no TTFT
    assert agg["ttft_s"]["cost_based"]["n"] == 8 and agg["ttft_s"]["round_robin"]["n"] == 0
    r = agg["ratios"]["ray_serve_llm"]
    assert r["p50"]["ratio"] == pytest.approx(0.2 / 0.5) and r["mean"] == pytest.approx(0.2 / 0.5)
    assert "round_robin" not in agg["ratios"]  # nothing to compare with
    # the first run of each configuration, prompt by prompt, where both answered
    assert agg["outputs_vs_first"] == {"first": "ray_serve_llm", "cost_based": {"compared": 4, "equal": 2}}
    meta = {"started_utc": "T", "host": "2 CPUs", "wall_s": 10.0, "model": "m", "subject": "cost_based",
            "run_order": [(1, "ray_serve_llm"), (1, "cost_based")], "command": "python -m bench.vllm_bench_compare"}
    text = vbc.render_report(meta, agg)
    assert "| cost_based | 8 | 0.200 |" in text and "0.40×" in text
    # decode: 9 tokens after the first in 0.9 s, 9 chunk gaps of 0.1 s per request; the failed request has none
    tpot = agg["decode_s"]["ray_serve_llm"]["tpot"]
    assert tpot["n"] == 3 and tpot["p50"] == pytest.approx(0.1)
    assert agg["decode_s"]["ray_serve_llm"]["itl"]["n"] == 27 and agg["decode_s"]["round_robin"]["tpot"]["n"] == 0
    assert "| ray_serve_llm | 0.1000 | 0.1000 | 0.1000 | 0.1000 | 0.1000 | 27 | 1.400 |" in text
    assert "did not start" in text and "cost_based 2/4 equal" in text
    assert "- cost_based #2: fetch 3 (err 0.21); reused 50% of prompt tokens; plan = engine on 4/4" in text
    assert vbc._decision_line({"error": "ConnectError: refused"}) == "no decision records (ConnectError: refused)"
