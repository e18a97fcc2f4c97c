"""What machine a bench ran on, in one line for its report: CPUs, CPU model and the vector extensions vLLM's CPU
kernels depend on (AVX-512, AMX: an AVX2-only machine runs the same engine ~10× slower; see
``bench/reports/live_agent_overflow/overloaded_avx2_box_at_ef7569b``). Who calls it: the live and ``vllm bench
serve`` comparisons (their report's "Run ... on HOST" line) and ``kvstack bench router`` (each row's ``host``).
Reads ``/proc/cpuinfo`` where there is one; elsewhere the CPU count alone.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The flags worth naming, in this order (``/proc/cpuinfo`` names -> how the line writes them).
VECTOR_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def describe_host(cpuinfo: str | None = None) -> str:
    """``"2 CPUs, AMD EPYC, AVX2 (no AVX-512)"``; ``cpuinfo``: the text of ``/proc/cpuinfo`` (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    parts = [f"{os.cpu_count()} CPUs"]
    if model:
        parts.append(model)
    if flags:
        named = [name for flag, name in VECTOR_FLAGS if flag in flags]
        isa = ", ".join(named) if named else "no AVX2"
        if "avx512f" not in flags:
            isa += " (no AVX-512)"
        parts.append(isa)
    return ", ".join(parts)
