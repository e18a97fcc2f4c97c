"""Summary statistics shared by the simulator and the load generators: percentiles of latency samples.

Pure functions over lists of floats; ``summarize`` returns the JSON-ready dict every bench result uses
(``{"n", "mean", "p50", "p90", "p99", "max"}``, ``None`` values when there are no samples).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 99)


def percentile(samples: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), or None without samples."""
    arr = np.asarray(samples, dtype=float)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q))


def summarize(samples: Sequence[float] | np.ndarray) -> dict[str, float | int | None]:
    arr = np.asarray(samples, dtype=float)
    out: dict[str, float | int | None] = {"n": int(arr.size)}
    if arr.size == 0:
        out.update({"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None})
        return out
    out["mean"] = float(arr.mean())
    for q, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{q}"] = float(v)
    out["max"] = float(arr.max())
    return out
