"""Summary statistics shared by the simulator, the load generators and the live comparison: one place per statistic.

Pure functions over lists of floats; ``summarize`` returns the JSON-ready dict every bench result uses
(``{"n", "mean", "p50", "p90", "p99", "max"}``, ``None`` values when there are no samples); ``ratio_with_ci`` is
the ratio of two samples' percentiles with a bootstrap 95% interval (``bench.live_compare``'s policy ratios).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 99)
BOOTSTRAP_ITERS = 2000


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


def ratio_with_ci(a: list[float], b: list[float], q: float, *, iters: int = BOOTSTRAP_ITERS,
                  seed: int = 0) -> dict[str, float | None]:
    """``percentile(a, q) / percentile(b, q)`` and a bootstrap 95% interval (each sample resampled on its own)."""
    if not a or not b:
        return {"ratio": None, "ci_low": None, "ci_high": None}
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    pb = float(np.percentile(xb, q))
    if pb <= 0:
        return {"ratio": None, "ci_low": None, "ci_high": None}
    rng = np.random.default_rng(seed)
    ra = np.percentile(xa[rng.integers(0, xa.size, (iters, xa.size))], q, axis=1)
    rb = np.percentile(xb[rng.integers(0, xb.size, (iters, xb.size))], q, axis=1)
    boot = ra / np.maximum(rb, 1e-12)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": float(np.percentile(xa, q)) / pb, "ci_low": float(lo), "ci_high": float(hi)}
