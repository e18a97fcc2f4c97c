"""``kvstack bench router``: its rows, and its replicas reporting their KV cache as live ones do."""

from __future__ import annotations

import json
import random

import pytest

from bench.router_bench import _Cluster
from cluster.cli import main as kvstack_main
from configs.loader import load_gpus, load_models
from router.cost import Hardware

HW = Hardware(load_models()["qwen3-14b"], load_gpus()["h100-sxm5-80gb"], mfu=0.5, bw_util=0.8)


def test_the_replicas_report_their_kv_cache_a_fraction_of_them_short() -> None:
    cluster = _Cluster(64, 4, HW, random.Random(0), kv_short=0.25)
    states, cols = cluster.book.view(cluster.now)
    assert all(s.kv is not None for s in states)
    short = sum(1 for f in cols.kv_free if f < 1024)
    assert 8 <= short <= 24  # about a quarter of 64
    # the rest of the cluster is the same without KV reports (the reports draw from their own generator)
    plain_states, plain_cols = _Cluster(64, 4, HW, random.Random(0), kv_short=None).book.view(0.0)
    assert all(s.kv is None for s in plain_states) and set(plain_cols.kv_free) == {float("inf")}
    assert [(s.running, s.waiting) for s in plain_states] == [(s.running, s.waiting) for s in states]


def test_rows_say_whether_the_replicas_reported_kv(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "router", "--json", "--replicas", "8", "--blocks", "2000", "--prompts", "512", "--iters", "10",
            "--cold", "1"]
    assert kvstack_main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["kv_short"] == 0.0 and row["replicas"] == 8 and sum(row["actions"].values()) == 10
    assert row["decision_p50_us"] > 0 and "CPUs" in row["host"]
    assert kvstack_main(args + ["--no-kv"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["kv_short"] is None
    assert kvstack_main(args + ["--kv-short", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["kv_short"] == 0.5
    with pytest.raises(SystemExit, match="kv-short"):
        kvstack_main(args + ["--kv-short", "2"])
