"""``kvstack plan`` run in-process through cluster.cli.main, against numbers worked out by hand here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main

BREAKEVEN = ["plan", "breakeven", "--model", "qwen3-14b", "--gpu", "h100-sxm5-80gb", "--tier", "remote-block",
             "--mfu", "0.4", "--bw-util", "0.7", "--json"]
CAPACITY = ["plan", "capacity", "--model", "qwen3-14b", "--gpu", "h200-sxm5-141gb", "--json"]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    rc, out, err = _run(capsys, argv)
    assert rc == 0, err
    return json.loads(out)


def test_breakeven_issue_example(capsys: pytest.CaptureFixture[str]) -> None:
    res = _json(capsys, BREAKEVEN)
    # (0.4·989e12)/(0.7·0.35e9)·8/40 − 14e9/(2·40·128·40)
    s = 0.4 * 989e12 / (0.7 * 0.35e9) * 8 / 40 - 14e9 / (2 * 40 * 128 * 40)
    assert res["breakeven_tokens"] == pytest.approx(s, rel=1e-12)
    assert res["breakeven_tokens"] == pytest.approx(288_759.088, abs=0.01)
    assert res["fetch_always_wins"] is False
    assert (res["model"], res["gpu"], res["tier"], res["mfu"], res["bw_util"], res["gpus"]) == (
        "qwen3-14b", "h100-sxm5-80gb", "remote-block", 0.4, 0.7, 1)
    assert res["kv_bytes_per_token"] == 2 * 8 * 128 * 40 * 2
    assert res["crossover_tokens"] == pytest.approx(s, rel=1e-6)  # no latency, no state: same as s*
    rows = {r["tokens"]: r for r in res["curve"]}
    # 131,072 tokens: recompute (2·s·14e9 + 4·s²·204,800)/3.956e14 = 44.85 s beats fetch s·163,840/2.45e8 = 87.65 s
    r = rows[131072]
    assert r["t_prefill_s"] == pytest.approx((2 * 131072 * 14e9 + 4 * 131072**2 * 204_800) / 3.956e14)
    assert r["t_fetch_s"] == pytest.approx(131072 * 163_840 / 2.45e8)
    assert r["fetch_wins"] is False and rows[1048576]["fetch_wins"] is True


def test_breakeven_gpus_multiplies_flops(capsys: pytest.CaptureFixture[str]) -> None:
    res = _json(capsys, BREAKEVEN + ["--gpus", "4"])
    assert res["gpus"] == 4
    assert res["breakeven_tokens"] == pytest.approx(4 * 395.6e12 / 2.45e8 * 0.2 - 34_179.6875, rel=1e-12)


def test_breakeven_fast_tier_fetch_always_wins(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a if a != "remote-block" else "cpu-dram" for a in BREAKEVEN]
    res = _json(capsys, argv)
    # 395.6e12/84e9·0.2 − 34,179.6875 = −33,237.76 (unclamped)
    assert res["breakeven_tokens"] == pytest.approx(395.6e12 / 84e9 * 0.2 - 34_179.6875)
    assert res["fetch_always_wins"] is True
    assert res["crossover_tokens"] == 0.0


def test_breakeven_hybrid_crossover_counts_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    res = _json(capsys, ["plan", "breakeven", "--model", "qwen3.5-27b", "--gpu", "h100-sxm5-80gb",
                         "--tier", "local-ssd", "--json"])  # defaults: MFU 0.4, BW util 0.7
    assert res["fetch_always_wins"] is True
    # gap(s) = t_prefill − t_fetch = a·s² + b·s − c with the 147 MiB state snapshot in c; positive root by hand
    a = 4 * 24 * 256 * 16 / 3.956e14
    b = 2 * 27e9 / 3.956e14 - 65_536 / 7e9
    c = 153_944_064 / 7e9
    root = (-b + (b * b + 4 * a * c) ** 0.5) / (2 * a)
    assert root == pytest.approx(173, abs=1)
    assert res["crossover_tokens"] == pytest.approx(root, rel=1e-6)


def test_capacity_issue_example(capsys: pytest.CaptureFixture[str]) -> None:
    res = _json(capsys, CAPACITY)
    assert res["hbm_kv_tokens"] == pytest.approx(141 * 2**30 / 163_840)
    assert res["hbm_kv_tokens"] == pytest.approx(924_057.6)
    assert res["kv_gib_per_10k_tokens"] == pytest.approx(10_000 * 163_840 / 2**30)
    assert res["kv_bytes_per_token"] == 163_840
    assert (res["model"], res["gpu"], res["kv_budget_gib"]) == ("qwen3-14b", "h200-sxm5-141gb", None)
    assert res["sequences_that_fit"]["131072"] == 7  # 141 GiB / 20 GiB


def test_capacity_budget(capsys: pytest.CaptureFixture[str]) -> None:
    res = _json(capsys, CAPACITY + ["--kv-budget-gib", "40"])
    assert res["hbm_kv_tokens"] == pytest.approx(40 * 2**30 / 163_840) == 262_144


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, BREAKEVEN[:-1])
    assert rc == 0 and "288,759 tokens" in out and "fetch wins for contexts longer" in out
    rc, out, _ = _run(capsys, CAPACITY[:-1])
    assert rc == 0 and "924,058" in out


@pytest.mark.parametrize(
    ("argv", "kind", "known"),
    [
        (["plan", "breakeven", "--model", "llama", "--gpu", "h100-sxm5-80gb", "--tier", "hbm"], "model", "qwen3-14b"),
        (["plan", "breakeven", "--model", "qwen3-14b", "--gpu", "tpu", "--tier", "hbm"], "GPU", "b200-sxm-192gb"),
        (["plan", "breakeven", "--model", "qwen3-14b", "--gpu", "h100-sxm5-80gb", "--tier", "tape"], "tier",
         "remote-block"),
        (["plan", "capacity", "--model", "llama", "--gpu", "h100-sxm5-80gb"], "model", "tiny-qwen3-next"),
        (["plan", "capacity", "--model", "qwen3-14b", "--gpu", "tpu"], "GPU", "cpu-2core"),
        (["plan", "report", "--out", "unused", "--gpu", "tpu"], "GPU", "a100-sxm4-80gb"),
        (["plan", "report", "--out", "unused", "--models", "qwen3-14b,llama"], "model", "qwen3.5-27b"),
    ],
)
def test_unknown_names_exit_2_with_known_list(
    capsys: pytest.CaptureFixture[str], argv: list[str], kind: str, known: str
) -> None:
    rc, out, err = _run(capsys, argv)
    assert rc == 2 and out == ""
    assert f"unknown {kind}" in err and f"known {kind}s:" in err and known in err


@pytest.mark.parametrize("extra", [["--mfu", "0"], ["--bw-util", "1.5"], ["--gpus", "0"]])
def test_bad_values_exit_2(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    rc, _, err = _run(capsys, BREAKEVEN + extra)
    assert rc == 2 and "must be" in err


def test_bad_budget_and_missing_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, CAPACITY + ["--kv-budget-gib", "-1"])
    assert rc == 2 and "--kv-budget-gib" in err
    rc, _, err = _run(capsys, ["plan"])
    assert rc == 2 and "breakeven" in err


def test_spec_files_override(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    models = tmp_path / "m.yaml"
    models.write_text("toy: {params: 1.0e9, layers: 2, full_attention_layers: 2, n_q: 8, n_kv: 8, head_dim: 64}\n")
    tiers = tmp_path / "t.yaml"
    tiers.write_text("slow: {bandwidth_gbps: 1.0, latency_s: 0.5}\n")
    res = _json(capsys, ["plan", "breakeven", "--model", "toy", "--gpu", "a100-sxm4-80gb", "--tier", "slow",
                         "--mfu", "0.5", "--bw-util", "1.0", "--models-file", str(models), "--tiers-file", str(tiers),
                         "--json"])
    # (0.5·312e12)/(1e9)·8·2/(2·8) − 1e9/(2·8·64·2) = 156,000 − 488,281.25
    assert res["breakeven_tokens"] == pytest.approx(156_000 - 488_281.25)
    assert res["tier_latency_s"] == 0.5
    assert res["crossover_tokens"] > 0  # the 0.5 s latency makes short fetches lose
    rc, _, err = _run(capsys, ["plan", "capacity", "--model", "qwen3-14b", "--gpu", "h100-sxm5-80gb",
                               "--models-file", str(models)])
    assert rc == 2 and "known models: toy" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("fast: {bandwidth_gbps: 1.0, speed: 3}\n")
    rc, _, err = _run(capsys, BREAKEVEN + ["--tiers-file", str(bad)])
    assert rc == 2 and str(bad) in err and "fast.speed: unknown key" in err


def test_report_writes_figures_and_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = tmp_path / "report"
    rc, out, err = _run(capsys, ["plan", "report", "--out", str(out_dir)])
    assert rc == 0, err
    names = ["kv_growth.png", "tier_breakeven.png", "phase_diagram.png", "storage_pyramid.png",
             "gpu_sensitivity.png"]
    for name in names:
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name
        assert str(out_dir / name) in out
    summary = (out_dir / "summary.md").read_text()
    for name in names:
        assert f"]({name})" in summary
    assert "288,759" in summary  # qwen3-14b on h100 from remote-block
    assert "924,058" not in summary and "524,288" in summary  # capacity on the report's GPU (h100, 80 GiB)
    # GPU table: b200 on remote-block, 2250e12·0.4/2.45e8·0.2 − 34,179.6875 = 700,514
    assert f"{0.4 * 2250e12 / 2.45e8 * 0.2 - 34_179.6875:,.0f}" in summary
