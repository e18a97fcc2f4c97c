"""Live load generators (``kvstack bench agent / trace / compare``) against a neighbour OpenAI-compatible server.

The server (``tests.fakes.openai_server.FakeOpenAIServer``) is a real HTTP server on 127.0.0.1 streaming SSE; the load
generators talk to it through the real ``openai`` SDK, exactly as they would to vLLM or to kvstack's ingress.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.traces import TokenMapper, load_trace
from cluster.cli import main as kvstack_main
from tests.fakes.openai_server import FakeOpenAIServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(p: Path) -> bool:
    return p.exists() and p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000


AGENT_SMALL = [
    "--sessions-per-s", "20", "--system-prompt-variants", "2", "--system-prompt-words", "300", "--tools", "3",
    "--tool-description-words", "20", "--turns-min", "2", "--turns-max", "4", "--user-words", "30",
    "--tool-result-words", "80", "--think-time-s", "0.05", "--max-output-tokens", "8", "--no-progress",
]


def test_agent_bench_json_pngs_and_request_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agent"
    with FakeOpenAIServer() as srv:
        rc = kvstack_main(["bench", "agent", "--endpoint", srv.base_url, *AGENT_SMALL, "--max-requests", "30",
                           "--duration-s", "60", "--out", str(out), "--json", "--save-requests"])
        received = list(srv.received)
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    result = json.loads((out / "result.json").read_text())
    assert printed == result
    assert result["schema"] == "kvstack.bench.agent/v1"
    assert result["model"] == "fake-model"
    # request bound: exactly what was sent, never more than asked
    assert result["requests"]["sent"] == len(received) == 30
    assert result["requests"]["ok"] == 30 and result["requests"]["errors"] == 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for q in ("p50", "p90", "p99"):
            assert result[key][q] is not None and result[key][q] > 0
    assert result["ttft_s"]["p50"] <= result["ttft_s"]["p90"] <= result["ttft_s"]["p99"]
    assert result["throughput"]["requests_per_s"] > 0 and result["throughput"]["output_tokens_per_s"] > 0
    assert result["requests"]["ok"] * 8 == sum(r["output_tokens"] for r in result["request_log"])
    turns = [row["turn"] for row in result["per_turn"]]
    assert turns[0] == 0 and len(turns) >= 2
    assert result["sessions"]["started"] >= 8
    # router counters read from /metrics: one decision per request, prefix hits on later turns
    router = result["router"]
    assert router["available"] is True
    assert sum(router["decisions_by_action"].values()) == 30
    assert router["decisions_by_action"].get("holder", 0) > 0
    assert router["hit_tokens_by_tier"]["hbm"] > 0
    # the plots
    assert set(result["plots"]) == {"ttft_cdf.png", "ttft_by_turn.png", "hit_tokens_by_tier.png"}
    for name in result["plots"]:
        assert _is_png(out / name), name
    # what went over the wire: shared system-prompt variants, tools, multi-turn with tool results
    systems = {r["messages"][0]["content"] for r in received}
    assert 1 <= len(systems) <= 2
    assert all(r["tools"] and len(r["tools"]) == 3 and "tool_choice" not in r for r in received)
    multi = [r for r in received if len(r["messages"]) > 2]
    assert multi, "no session reached a second turn"
    for r in multi:
        roles = [m["role"] for m in r["messages"]]
        assert roles[0] == "system" and roles[1] == "user"
        for i, m in enumerate(r["messages"]):
            if m["role"] == "tool":  # a tool result follows the assistant message that called it
                prev = r["messages"][i - 1]
                assert prev["role"] == "assistant" and prev["tool_calls"][0]["id"] == m["tool_call_id"]
    # a later turn extends the earlier turn's messages verbatim (what makes prefix reuse possible)
    by_session: dict[str, list[dict]] = {}
    for r in received:
        by_session.setdefault(json.dumps(r["messages"][:2]), []).append(r)
    extended = [rs for rs in by_session.values() if len(rs) > 1]
    assert extended
    for rs in extended:
        rs.sort(key=lambda r: len(r["messages"]))
        for a, b in zip(rs, rs[1:]):
            assert b["messages"][: len(a["messages"])] == a["messages"]


def test_agent_bench_time_bound_cancels_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "slow"
    with FakeOpenAIServer(token_delay_s=0.25) as srv:  # 8 tokens -> ~2 s per request
        t0 = time.monotonic()
        rc = kvstack_main(["bench", "agent", "--endpoint", srv.base_url, *AGENT_SMALL, "--max-requests", "1000",
                           "--duration-s", "1.5", "--out", str(out)])
        wall = time.monotonic() - t0
    result = json.loads((out / "result.json").read_text())
    assert wall < 1.5 + 6.0  # deadline plus start-up, scrapes and plots
    assert result["wall_s"] < 1.5 + 1.0
    assert result["requests"]["sent"] >= 1
    assert result["requests"]["cancelled"] >= 1  # in-flight streams were cut at the deadline
    assert rc == 1  # nothing finished in time: no successful request


def test_agent_bench_counts_errors_and_survives_a_server_without_metrics(tmp_path: Path) -> None:
    out = tmp_path / "err"
    with FakeOpenAIServer(fail_every=4, metrics=False) as srv:
        rc = kvstack_main(["bench", "agent", "--endpoint", srv.base_url, *AGENT_SMALL, "--max-requests", "20",
                           "--duration-s", "60", "--tools-mode", "user", "--out", str(out)])
        received = list(srv.received)
    result = json.loads((out / "result.json").read_text())
    assert rc == 0
    assert result["requests"]["sent"] == len(received) <= 20
    assert result["requests"]["errors"] >= 1
    assert result["requests"]["errors"] + result["requests"]["ok"] == result["requests"]["sent"]
    assert any("InternalServerError" in k or "APIError" in k for k in result["errors"]["by_type"])
    assert result["router"] == {"available": False, "hit_tokens_by_tier": {}, "decisions_by_action": {},
                                "saver": {}}
    assert "tools" not in received[0] and "Tools:" in received[0]["messages"][0]["content"]
    assert set(result["plots"]) == {"ttft_cdf.png", "ttft_by_turn.png"}


def _trace_file(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 400, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 800, "input_length": 700, "output_length": 20, "hash_ids": [4, 5]},
        {"timestamp": 1200, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 1600, "input_length": 900, "output_length": 20, "hash_ids": [4, 6]},
        {"timestamp": 2000, "input_length": 100, "output_length": 20, "hash_ids": [7]},
    ]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_trace_replay_maps_equal_hash_ids_to_equal_token_blocks(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    out = tmp_path / "trace"
    with FakeOpenAIServer() as srv:
        rc = kvstack_main(["bench", "trace", "--trace", str(trace), "--endpoint", srv.base_url, "--time-scale", "0.5",
                           "--length-scale", "0.25", "--max-requests", "5", "--duration-s", "30", "--vocab-size", "1000",
                           "--seed", "3", "--out", str(out), "--no-progress", "--save-requests"])
        received = list(srv.received)
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert result["schema"] == "kvstack.bench.trace/v1"
    assert result["requests"]["sent"] == result["requests"]["ok"] == len(received) == 5  # the 6th is past the bound
    assert _is_png(out / "ttft_cdf.png")
    prompts = [r["prompt"] for r in received]
    # length scale 0.25: blocks of 128 tokens; input lengths scaled, block count kept
    assert [len(p) for p in prompts] == [256 + 19, 256 + 69, 128 + 47, 256 + 19, 128 + 97]
    assert all(isinstance(t, int) and 16 <= t < 1000 for p in prompts for t in p)
    assert prompts[0][:256] == prompts[1][:256]  # ids 0, 1 shared
    assert prompts[0][256:] != prompts[1][256:256 + 19]
    assert prompts[0] == prompts[3]  # identical ids, identical prompt
    assert prompts[2][:128] == prompts[4][:128] and prompts[2][128:] != prompts[4][128:175]
    # the mapping is the library's, so a live run and an offline check agree
    recs = load_trace(trace)
    from bench.traces import scale_trace

    assert prompts[1] == TokenMapper(vocab_size=1000, seed=3).prompt_tokens(scale_trace(recs, length_scale=0.25)[1])
    # time scale 0.5: the trace's 0.4 s gaps become 0.2 s (client-side send times, relative to the start)
    sent = [r["sent_at_s"] for r in result["request_log"]]
    assert sent == sorted(sent)
    assert all(abs(t - 0.2 * i) < 0.1 for i, t in enumerate(sent)), sent
    # max_tokens follows the scaled output length
    assert all(r["max_tokens"] == 5 for r in received)
    # the fake saw the shared blocks as reuse
    assert result["router"]["hit_tokens_by_tier"]["hbm"] > 0


def test_trace_replay_chat_mode(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    with FakeOpenAIServer() as srv:
        rc = kvstack_main(["bench", "trace", "--trace", str(trace), "--endpoint", srv.base_url, "--time-scale", "0.05",
                           "--length-scale", "0.1", "--prompt-mode", "chat", "--max-requests", "6", "--no-progress"])
        received = list(srv.received)
    assert rc == 0
    texts = [r["messages"][0]["content"] for r in received]
    assert len(texts) == 6 and texts[0] == texts[3] and texts[0] != texts[1]


def test_compare_report_sim_and_live(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    with FakeOpenAIServer() as a, FakeOpenAIServer(base_ttft_s=0.02) as b:
        rc = kvstack_main([
            "bench", "compare", "--agent-sessions", "30", *AGENT_SMALL, "--nodes", "4", "--hbm-tokens", "5k",
            "--pool-tokens", "50k", "--policies", "round_robin,prefix_affinity,cost_based",
            "--endpoint", f"round_robin={a.base_url}", "--endpoint", f"cost_based={b.base_url}",
            "--live-max-requests", "12", "--live-duration-s", "30", "--out", str(out),
        ])
        assert len(a.received) == len(b.received) == 12
    assert rc == 0
    report = (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    assert set(results["simulator"]) == {"round_robin", "prefix_affinity", "cost_based"}
    assert set(results["live"]) == {"round_robin", "cost_based"}
    assert "## Simulator" in report and "## Live" in report
    for policy in ("round_robin", "prefix_affinity", "cost_based"):
        assert f"| {policy} |" in report
    for png in ("sim_ttft_cdf.png", "sim_hit_rate_by_tier.png", "sim_prefill_gpu_s.png", "live_ttft_cdf.png",
                "live_ttft_by_turn.png", "live_hit_tokens_by_tier.png"):
        assert _is_png(out / png), png
        assert png in report
    # the slower neighbour shows up as a ratio > 1 against the baseline
    live_cb = results["live"]["cost_based"]["ttft_s"]["p50"]
    live_rr = results["live"]["round_robin"]["ttft_s"]["p50"]
    assert live_cb > live_rr


def test_agent_bench_max_sessions_bounds_the_sessions_started(tmp_path: Path) -> None:
    out = tmp_path / "bounded"
    with FakeOpenAIServer() as srv:
        rc = kvstack_main(["bench", "agent", "--endpoint", srv.base_url, *AGENT_SMALL, "--max-sessions", "3",
                           "--max-requests", "100", "--duration-s", "30", "--out", str(out), "--save-requests"])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0
    assert result["sessions"] == {"started": 3, "completed": 3}
    assert {r["session"] for r in result["request_log"]} == {0, 1, 2}


def test_agent_bench_sequential_variant_runs_one_session_at_a_time(tmp_path: Path) -> None:
    """``--max-concurrent-sessions 1``: sessions arriving 20 per second still run one after another — every request
    of a session is sent after the previous session's last response ended."""
    out = tmp_path / "sequential"
    with FakeOpenAIServer() as srv:
        rc = kvstack_main(["bench", "agent", "--endpoint", srv.base_url, *AGENT_SMALL, "--max-sessions", "4",
                           "--max-concurrent-sessions", "1", "--max-requests", "100", "--duration-s", "60",
                           "--out", str(out), "--save-requests"])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0
    assert result["sessions"] == {"started": 4, "completed": 4}
    assert result["config"]["max_concurrent_sessions"] == 1
    spans: dict[int, tuple[float, float]] = {}
    for r in result["request_log"]:
        lo, hi = spans.get(r["session"], (float("inf"), 0.0))
        spans[r["session"]] = (min(lo, r["sent_at_s"]), max(hi, r["sent_at_s"] + r["e2e_s"]))
    ordered = sorted(spans.values())
    assert len(ordered) == 4
    for (_, end), (start, _) in zip(ordered, ordered[1:]):
        assert start >= end - 1e-3, ordered  # no overlap
