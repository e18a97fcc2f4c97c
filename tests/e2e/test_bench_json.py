"""``kvstack bench reuse --json`` prints exactly one JSON document on stdout although it starts Ray and vLLM (whose
loggers write to stdout by default): the whole of stdout parses. Tiny settings (tiny dense model, 256-token prompt,
one repeat). Run under the machine-wide lock:
``flock /tmp/kvstack-heavy.lock .venv/bin/pytest tests/e2e/test_bench_json.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_bench_reuse_json_is_one_document() -> None:
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "reuse", "--preset", "tiny", "--tokens", "256",
                          "--reps", "1", "--max-tokens", "2", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)  # the whole of stdout: nothing but the document
    assert {"ttft_recompute_s", "ttft_fetch_dram_s", "token_identical"} <= set(doc), sorted(doc)
    assert "INFO" in out.stderr  # vLLM's and Ray's logs went to stderr, they were not silenced
