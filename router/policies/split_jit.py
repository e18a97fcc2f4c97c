"""The SPLIT solvers of ``router.policies.pricing`` compiled with numba: the same Python functions, not a second copy.

Contract: ``compile_solvers(meeting_point, solve_overlap, solve_staged)`` returns (overlap, staged) callables with the
signatures and results of the two solvers (the same floats: numba compiles the same operations in the same order, no
fastmath), compiled now for the one signature the policies call them with (floats, a bool, an int block size) so no
request pays the compile (~0.5 s once per process; nothing is cached on disk).

Why: ``cost_based`` solves a few SPLITs per decision; in Python each solve costs ~1 µs in a hot loop and 2-3 µs inside
a decision, compiled ~0.3 µs (issue 13: decision p99 <= 100 µs at 64 replicas). Who calls it: only
``pricing._split_solvers``, and only in a process that opted into numba (``kvpool.keys.enable_jit``: the router's
ingress, ``kvstack bench router``), never in a process that builds a vLLM engine (``kvpool.keys`` says why).
The solvers call ``meeting_point`` by its global name; each is compiled from a copy of itself whose globals point that
name at the compiled ``meeting_point`` (numba calls compiled functions only), so pricing keeps one source of each.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from numba import njit


def _compiled(fn: Callable[..., Any], **globals_: Any) -> Any:
    """``fn`` compiled, with ``globals_`` in place of its module's globals of those names."""
    clone = types.FunctionType(fn.__code__, {**fn.__globals__, **globals_}, fn.__name__, fn.__defaults__,
                               fn.__closure__)
    clone.__qualname__ = fn.__qualname__
    return njit(cache=False)(clone)


def compile_solvers(meeting_point: Callable[..., float], solve_overlap: Callable[..., tuple[int, float]],
                    solve_staged: Callable[..., tuple[int, float]]) -> tuple[Any, Any]:
    meet = _compiled(meeting_point)
    overlap = _compiled(solve_overlap, meeting_point=meet)
    staged = _compiled(solve_staged, meeting_point=meet)
    # One call each compiles the signature the policies use (float64 everywhere but ``pull`` and ``block_size``).
    overlap(1e-9, 1e-14, 1e5, 0.0, 1e-3, 1e-10, 0.0, 1024.0, 16)
    staged(1e-9, 1e-14, 1e5, 0.0, 1e-3, 1e-10, 1e-4, 1e-11, True, 0.0, 1024.0, 16)
    return overlap, staged
