"""bench.live_compare: the pure parts (``bench agent`` argv, ratios with bootstrap intervals, aggregation, report)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from bench import live_compare as lc
from bench.stats import ratio_with_ci


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lc.configure(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_agent_argv_is_accepted_by_the_real_bench_agent_parser() -> None:
    from bench.agent_cli import workload_from_args
    from cluster.cli import build_parser

    args = _args(system_prompt_words=123, think_time_s=0.5)
    argv = lc.agent_argv(args, "http://127.0.0.1:9/v1", "rr", Path("/tmp/x"))
    assert argv[1:5] == ["-m", "cluster.cli", "bench", "agent"]
    parsed = build_parser().parse_args(argv[3:])
    w = workload_from_args(parsed)
    assert (w.system_prompt_words, w.think_time_mean_s, parsed.tools_mode) == (123, 0.5, "tools")
    assert (parsed.max_requests, parsed.duration_s, parsed.save_requests) == (80, 210.0, True)
    assert parsed.max_concurrent_sessions == 0
    sequential = build_parser().parse_args(lc.agent_argv(_args(max_concurrent_sessions=1), "http://127.0.0.1:9/v1",
                                                         "rr", Path("/tmp/x"))[3:])
    assert sequential.max_concurrent_sessions == 1


def test_bench_compare_live_is_live_compare() -> None:
    """``kvstack bench compare --live ...`` parses as ``kvstack bench live-compare ...`` with the same flags."""
    from cluster.cli import build_parser, resolve_aliases

    argv = resolve_aliases(["bench", "compare", "--repeats", "3", "--live", "--max-concurrent-sessions", "1"])
    assert argv == ["bench", "live-compare", "--repeats", "3", "--max-concurrent-sessions", "1"]
    args = build_parser().parse_args(argv)
    assert args._run is lc.run and args.repeats == 3 and args.max_concurrent_sessions == 1
    assert resolve_aliases(["bench", "compare", "--no-sim"]) == ["bench", "compare", "--no-sim"]


def test_ratio_with_ci_known_values() -> None:
    a = [1.0, 2.0, 3.0, 4.0, 5.0] * 20
    b = [2.0, 4.0, 6.0, 8.0, 10.0] * 20
    r = ratio_with_ci(a, b, 50)
    assert r["ratio"] == pytest.approx(0.5)
    assert r["ci_low"] <= 0.5 <= r["ci_high"] and r["ci_high"] < 1.0
    assert ratio_with_ci([], b, 50)["ratio"] is None


def test_ratio_ci_is_wide_for_few_samples() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.exponential(1.0, 8).tolist(), rng.exponential(1.0, 8).tolist()
    r = ratio_with_ci(a, b, 99)
    assert r["ci_high"] / r["ci_low"] > 2.0


def test_the_bootstrap_over_sessions_is_wider_when_a_session_s_requests_move_together() -> None:
    # Ten sessions of ten requests each; a session's requests share its latency (one prefix, one replica).
    rng = np.random.default_rng(2)
    level = rng.exponential(1.0, 10)
    a = np.repeat(level, 10).tolist()
    groups = [f"run1:{i}" for i in range(10) for _ in range(10)]
    b = [1.0] * 100
    by_request = ratio_with_ci(a, b, 50)
    by_session = ratio_with_ci(a, b, 50, groups_a=groups)
    assert by_session["ratio"] == by_request["ratio"]
    width = lambda r: r["ci_high"] - r["ci_low"]  # noqa: E731
    assert width(by_session) > 1.5 * width(by_request)
    with pytest.raises(ValueError, match="one label per sample"):
        ratio_with_ci(a, b, 50, groups_b=groups[:5])


def _entry(policy: str, ttft: list[float], *, hbm: float, actions: dict[str, float]) -> dict[str, object]:
    log = [{"ttft_s": t, "error": None, "cancelled": False, "prompt_tokens": 1000, "turn": i % 3, "sent_at_s": i}
           for i, t in enumerate(ttft)]
    log.append({"ttft_s": None, "error": "APITimeoutError: x", "cancelled": False, "prompt_tokens": None, "turn": 0,
                "sent_at_s": 50.0})
    log.append({"ttft_s": 99.0, "error": None, "cancelled": True, "prompt_tokens": None, "turn": 1, "sent_at_s": 60.0})
    log.append({"ttft_s": None, "error": None, "cancelled": True, "prompt_tokens": None, "turn": 2, "sent_at_s": 61.0})
    from bench.stats import summarize

    result = {
        "requests": {"sent": len(log), "ok": len(ttft), "errors": 1, "cancelled": 0},
        "ttft_s": summarize(ttft), "tpot_s": summarize([0.01]), "e2e_s": summarize(ttft),
        "throughput": {"requests_per_s": 1.0}, "per_turn": [], "sessions": {"started": 3, "completed": 2},
        "errors": {"by_type": {"APITimeoutError": 1}},
        "router": {"available": True, "hit_tokens_by_tier": {"hbm": hbm}, "decisions_by_action": actions},
        "request_log": log,
    }
    audit = {"records": 30, "by_replica": {"r0": 20, "r1": 10}, "reused_token_fraction": 0.8,
             "median_prediction_error_s": {"holder": 0.25}}
    return {"policy": policy, "result": result, "load_avg_before": [3.0], "load_avg_after": [4.0],
            "server": {"ready_s": 120.0}, "decisions": audit}


def test_aggregate_and_report() -> None:
    entries = [
        _entry("round_robin", [2.0] * 30, hbm=10_000, actions={"recompute": 20, "holder": 10}),
        {"policy": "prefix_affinity", "error": "TimeoutError: not serving"},
        _entry("cost_based", [1.0] * 30, hbm=25_000, actions={"holder": 30}),
    ]
    agg = lc.aggregate(entries, "cost_based")
    assert set(agg["ratios"]) == {"cost_based/round_robin"}
    assert agg["ratios"]["cost_based/round_robin"]["p50"]["ratio"] == pytest.approx(0.5)
    cb = agg["rows"][2]
    assert cb["prompt_tokens_per_ok_request"] == 1000 and cb["hit_tokens_per_decision"] == pytest.approx(25_000 / 30)
    assert agg["rows"][1] == {"policy": "prefix_affinity", "error": "TimeoutError: not serving"}
    # the request cancelled after its first token counts only in the "with cancelled" view; the other one in neither
    assert cb["ttft_s"]["max"] == 1.0 and cb["ttft_with_cancelled_s"]["max"] == 99.0
    assert cb["ttft_with_cancelled_s"]["n"] == 31 and cb["cancelled_before_first_token"] == 1
    assert agg["ratios_with_cancelled"]["cost_based/round_robin"]["p50"]["ratio"] == pytest.approx(0.5)
    meta = {"started_utc": "T", "host": "2 CPUs", "wall_s": 1.0, "model": "m", "policies": ["a"], "command": "c",
            "subject": "cost_based",
            "workload": {k: getattr(_args(), k) for k in lc.AGENT_FLAGS}, "sizing": None, "work_dir": "/w"}
    text = lc.render_report({"aggregate": agg, "meta": meta}, ["ttft_cdf.png"])
    assert "| cost_based/round_robin | ok | 0.50× [0.50, 0.50] |" in text
    assert "failed: TimeoutError" in text and "holder 30" in text and "![ttft_cdf.png](ttft_cdf.png)" in text
    assert "- cost_based: 30 records; per replica r0 20, r1 10; reused 0.80; prediction error holder +0.25 s" in text


def test_ttft_per_turn_pools_the_runs_and_gives_the_subject_s_ratio_per_turn() -> None:
    # turn = i % 3: the subject is as fast as round_robin on first turns (0) and twice as fast on revisits
    rr = [3.0 if i % 3 == 0 else 2.0 for i in range(30)]
    cb = [3.0 if i % 3 == 0 else 1.0 for i in range(30)]
    entries = [_entry("round_robin", rr, hbm=0, actions={}), _entry("cost_based", cb, hbm=0, actions={}),
               _entry("cost_based", cb, hbm=0, actions={})]
    by_turn = lc.aggregate(entries, "cost_based")["ttft_by_turn"]
    assert set(by_turn) == {"round_robin", "cost_based"} and set(by_turn["cost_based"]) == {"0", "1", "2"}
    assert by_turn["cost_based"]["0"]["n"] == 20 and by_turn["round_robin"]["0"]["n"] == 10  # errors, cancels out
    assert by_turn["round_robin"]["0"]["subject_ratio_p50"] == pytest.approx(1.0)
    assert by_turn["round_robin"]["1"]["subject_ratio_mean"] == pytest.approx(0.5)
    assert "subject_ratio_p50" not in by_turn["cost_based"]["1"]
    meta = {"started_utc": "T", "host": "2 CPUs", "wall_s": 1.0, "model": "m", "policies": ["a"], "command": "c",
            "subject": "cost_based", "workload": {k: getattr(_args(), k) for k in lc.AGENT_FLAGS}, "sizing": None,
            "work_dir": "/w"}
    text = lc.render_report({"aggregate": lc.aggregate(entries, "cost_based"), "meta": meta}, [])
    assert "| round_robin | 2 | 10 | 2.000 | 2.000 | 2.000 | 2.000 | 0.50×, 0.50× |" in text


def test_report_from_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    # matplotlib takes seconds on a loaded box; the plots are drawn by the real run, here only their names matter
    monkeypatch.setattr(lc, "write_plots", lambda agg, out: ["ttft_cdf.png"] if agg["ttft_samples"] else [])

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    entries = [_entry("round_robin", [2.0, 3.0] * 10, hbm=1, actions={"holder": 1}),
               _entry("cost_based", [1.0, 1.5] * 10, hbm=2, actions={"holder": 2})]
    (work / "entries.json").write_text(json.dumps(entries))
    meta = {"started_utc": "T", "host": "2 CPUs", "wall_s": 1.0, "model": "m",
            "policies": ["round_robin", "cost_based"],
            "command": "c", "subject": "cost_based", "workload": {k: getattr(_args(), k) for k in lc.AGENT_FLAGS},
            "sizing": None, "work_dir": str(work)}
    (work / "meta.json").write_text(json.dumps(meta))
    assert lc.report_from_work_dir(work, out) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["aggregate"]["ratios"]["cost_based/round_robin"]["p50"]["ratio"] == pytest.approx(1.25 / 2.5)
    assert "![ttft_cdf.png](ttft_cdf.png)" in (out / "report.md").read_text()
    assert lc.report_from_work_dir(tmp_path / "missing", out) == 2


def test_configurations_start_the_right_server() -> None:
    work = Path("/w")
    anchor = lc.serve_command(lc.ANCHOR, 8100, ["a.b=1"], work)
    assert anchor[1:3] == ["-m", "bench.ray_serve_llm"] and anchor[-2:] == ["--set", "a.b=1"]
    nopool = lc.serve_command("prefix_affinity-nopool", 8101, [], work)
    assert nopool[nopool.index("--policy") + 1] == "prefix_affinity" and "app.pool.enabled=false" in nopool
    pool = lc.serve_command("cost_based", 8102, [], work)
    assert pool[pool.index("--policy") + 1] == "cost_based" and "app.pool.enabled=false" not in pool
    assert lc.run_order(["a", "b", "c"], 2) == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a")]
    own = lc.serve_command("cost_based-nopool@app.replicas.cpu_binding=unbound@x.y=2", 8103, ["x.y=1"], work)
    assert own[own.index("--policy") + 1] == "cost_based" and "app.pool.enabled=false" in own
    assert own[-6:] == ["--set", "x.y=1", "--set", "app.replicas.cpu_binding=unbound", "--set", "x.y=2"]


def test_configuration_names_and_their_checks() -> None:
    from bench.bench_configs import check_configs, parse_config

    assert parse_config("ray_serve_llm").anchor and parse_config("ray_serve_llm").policy == "prefix_affinity"
    spec = parse_config("round_robin@app.replicas.cpu_binding=unbound")
    assert (spec.kvstack, spec.policy, spec.pool, spec.overrides) == (
        True, "round_robin", True, ("app.replicas.cpu_binding=unbound",))
    for bad in ("ray_serve_llm@a=1", "cost_based@novalue", "cost_based@=1"):
        with pytest.raises(ValueError):
            parse_config(bad)
    check_configs(["ray_serve_llm", "cost_based@app.replicas.cpu_binding=unbound"], [])
    with pytest.raises(Exception, match="cpu_binding"):
        check_configs(["cost_based@app.replicas.cpu_binding=floating"], [])
    with pytest.raises(Exception):
        check_configs(["no_such_policy"], [])


def test_repeats_pool_per_configuration_and_outputs_are_compared() -> None:
    def with_texts(e: dict, texts: list[str], repeat: int) -> dict:
        for i, r in enumerate(e["result"]["request_log"][: len(texts)]):
            r.update(request_id=f"s{i}-t0", text=texts[i], prompt_tokens=1000)
        e.update(repeat=repeat, repeats=2)
        return e

    entries = [
        with_texts(_entry(lc.ANCHOR, [3.0] * 10, hbm=0, actions={}), ["x", "y", "z"], 1),
        with_texts(_entry("cost_based", [1.0] * 10, hbm=5, actions={"holder": 10}), ["x", "y", "q"], 1),
        with_texts(_entry("cost_based", [2.0] * 10, hbm=5, actions={"holder": 10}), ["x", "y", "z"], 2),
        with_texts(_entry(lc.ANCHOR, [3.0] * 10, hbm=0, actions={}), ["x", "y", "z"], 2),
    ]
    agg = lc.aggregate(entries, "cost_based")
    assert [r["policy"] for r in agg["rows"]] == [f"{lc.ANCHOR} #1", "cost_based #1", "cost_based #2",
                                                  f"{lc.ANCHOR} #2"]
    assert agg["ttft_pooled"]["cost_based"]["n"] == 20 and agg["ttft_pooled"]["cost_based"]["p50"] == 1.5
    assert agg["ratios"][f"cost_based/{lc.ANCHOR}"]["mean"] == pytest.approx(0.5)
    assert agg["outputs_agreement"] == {f"cost_based #1 vs {lc.ANCHOR} #1": {"compared": 3, "equal": 2},
                                        f"cost_based #2 vs {lc.ANCHOR} #1": {"compared": 3, "equal": 3},
                                        f"{lc.ANCHOR} #2 vs {lc.ANCHOR} #1": {"compared": 3, "equal": 3}}
