"""``bench.host.describe_host``: the machine line of the bench reports."""

from __future__ import annotations

import os

from bench.host import describe_host

INTEL = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
AMD = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_the_line_names_the_cpu_and_its_vector_extensions() -> None:
    n = os.cpu_count()
    assert describe_host(INTEL) == (f"{n} CPUs, Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, AMX-BF16, "
                                    "AVX512-BF16, AVX-512, AVX2")
    assert describe_host(AMD) == f"{n} CPUs, AMD EPYC, AVX2 (no AVX-512)"
    assert describe_host("flags : fpu sse2\n") == f"{n} CPUs, no AVX2 (no AVX-512)"
    assert describe_host("") == f"{n} CPUs"  # no /proc/cpuinfo: the count alone
    assert describe_host().startswith(f"{n} CPUs")  # this machine's
