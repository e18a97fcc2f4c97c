"""``cluster.cli_output``: with ``--json`` stdout carries exactly one JSON document, and ``kvstack serve`` keeps
Ray's and vLLM's logs in a log file (its own lines on the terminal). Real descriptors, so each case runs in a
subprocess; the quick ``kvstack … --json`` commands run end to end as ``python -m cluster.cli``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Every kind of writer that leaked onto stdout: a logging handler bound to sys.stdout before the redirection (vLLM's
# default), print, raw writes to fd 1 (C code), and a child process that inherits the descriptors (ray start,
# vLLM's engine core).
NOISE = """
import logging, os, subprocess, sys
early = logging.getLogger("early")
early.addHandler(logging.StreamHandler(sys.stdout))
early.warning("early-handler-line")

def noise():
    early.warning("logger-line")
    print("print-line")
    os.write(1, b"fd1-line\\n")
    subprocess.run([sys.executable, "-c", "print('child-line')"], check=True)
    late = logging.getLogger("late")
    late.addHandler(logging.StreamHandler(sys.stdout))
    late.warning("late-handler-line")
"""
NOISE_LINES = ["logger-line", "print-line", "fd1-line", "child-line", "late-handler-line"]


def _python(code: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_json_redirection_leaves_one_document_on_stdout() -> None:
    out = _python(NOISE + """
from cluster.cli_output import print_document, redirect_output
with redirect_output(stdout_to=2):
    noise()
    print_document('{"ok": 1}')
print("after-line")
""")
    assert out.returncode == 0, out.stderr
    assert out.stdout == 'early-handler-line\n{"ok": 1}\nafter-line\n'  # before and after: stdout again
    for line in NOISE_LINES:
        assert line in out.stderr.splitlines(), (line, out.stderr)


def test_serve_log_routing_keeps_own_lines_on_the_terminal(tmp_path: Path) -> None:
    out = _python(NOISE + f"""
from pathlib import Path
from cluster.cli_output import say, warn
from cluster.commands.serve import log_routing
with log_routing(Path({str(tmp_path)!r}) / "logs", verbose=False) as path:
    noise()
    print("stderr-print-line", file=sys.stderr)
    os.write(2, b"fd2-line\\n")
    say("[kvstack] replica r1 on 10.0.0.2: 1 engine thread(s) bound to cpus [1]")
    warn("kvstack serve: failed: boom")
print("logged-to", path)
""")
    assert out.returncode == 0, out.stderr
    (log,) = (tmp_path / "logs").glob("serve-*.log")
    lines = out.stdout.splitlines()
    assert lines == ["early-handler-line", f"[kvstack] Ray and vLLM logs: {log} (--verbose shows them here)",
                     "[kvstack] replica r1 on 10.0.0.2: 1 engine thread(s) bound to cpus [1]", f"logged-to {log}"]
    assert out.stderr == "kvstack serve: failed: boom\n"
    logged = log.read_text().splitlines()
    for line in [*NOISE_LINES, "stderr-print-line", "fd2-line"]:
        assert line in logged, (line, logged)
    assert not any("kvstack" in line for line in logged)


def test_serve_verbose_leaves_the_logs_on_the_terminal(tmp_path: Path) -> None:
    out = _python(NOISE + f"""
from pathlib import Path
from cluster.commands.serve import log_routing
with log_routing(Path({str(tmp_path)!r}) / "logs", verbose=True) as path:
    noise()
    assert path is None
""")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "logs").exists()
    for line in NOISE_LINES:
        assert line in out.stdout.splitlines() + out.stderr.splitlines(), line


def test_serve_has_verbose_and_log_dir_options() -> None:
    from cluster.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.verbose is False and args.log_dir == Path(".kvstack/logs")
    args = build_parser().parse_args(["serve", "--verbose", "--log-dir", "/tmp/l"])
    assert args.verbose is True and args.log_dir == Path("/tmp/l")


QUICK_JSON_COMMANDS = {
    "plan-breakeven": ["plan", "breakeven", "--model", "qwen3-14b", "--gpu", "h100-sxm5-80gb", "--tier",
                       "remote-block", "--json"],
    "plan-capacity": ["plan", "capacity", "--model", "qwen3-14b", "--gpu", "h200-sxm5-141gb", "--json"],
    "simulate": ["simulate", "--agent-sessions", "4", "--nodes", "2", "--policy", "cost_based", "--json"],
    "bench-router": ["bench", "router", "--replicas", "8", "--blocks", "1e3", "--prompts", "1024", "--iters", "5",
                     "--cold", "2", "--json"],
    "bench-transfer": ["bench", "transfer", "--no-ray", "--backends", "tcp", "--block-sizes", "64K", "--batches", "1",
                       "--total-mib", "4", "--repeats", "1", "--file-mib", "1", "--json"],
}


@pytest.mark.parametrize("argv", QUICK_JSON_COMMANDS.values(), ids=QUICK_JSON_COMMANDS.keys())
def test_json_commands_print_one_document(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "cluster.cli", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)  # the whole of stdout is one JSON document
    assert doc
