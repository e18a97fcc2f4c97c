"""Summary statistics shared by the simulator, the load generators and the live comparison: one place per statistic.

Pure functions over lists of floats; ``summarize`` returns the JSON-ready dict every bench result uses
(``{"n", "mean", "p50", "p90", "p99", "max"}``, ``None`` values when there are no samples); ``ratio_with_ci`` is
the ratio of two samples' percentiles with a bootstrap 95% interval over samples or over groups of them
(``bench.live_compare``'s policy ratios, sessions resampled).
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


def _resample(x: np.ndarray, groups: Sequence[object] | None, rng: np.random.Generator, iters: int,
              q: float) -> np.ndarray:
    """``iters`` bootstrap replicates of the ``q``-th percentile of ``x``: samples drawn with replacement, or, with
    ``groups`` (one label per sample), whole groups drawn with replacement and their samples pooled."""
    if groups is None:
        return np.percentile(x[rng.integers(0, x.size, (iters, x.size))], q, axis=1)
    labels, inverse = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)
    members = [np.flatnonzero(inverse == k) for k in range(labels.size)]
    out = np.empty(iters)
    for i, picks in enumerate(rng.integers(0, labels.size, (iters, labels.size))):
        out[i] = np.percentile(x[np.concatenate([members[k] for k in picks])], q)
    return out


def ratio_with_ci(a: list[float], b: list[float], q: float, *, iters: int = BOOTSTRAP_ITERS, seed: int = 0,
                  groups_a: Sequence[object] | None = None, groups_b: Sequence[object] | None = None,
                  ) -> dict[str, float | None]:
    """``percentile(a, q) / percentile(b, q)`` and a bootstrap 95% interval, each sample resampled on its own.

    ``groups_a`` / ``groups_b`` (one label per sample, e.g. the session a request belongs to): resample whole groups
    instead of single samples (a cluster bootstrap: the requests of one session are not independent — they share a
    prefix, a replica and a queue — so resampling requests makes the interval too narrow)."""
    if not a or not b:
        return {"ratio": None, "ci_low": None, "ci_high": None}
    for name, x, g in (("groups_a", a, groups_a), ("groups_b", b, groups_b)):
        if g is not None and len(g) != len(x):
            raise ValueError(f"{name} needs one label per sample: {len(g)} labels, {len(x)} samples")
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    pb = float(np.percentile(xb, q))
    if pb <= 0:
        return {"ratio": None, "ci_low": None, "ci_high": None}
    rng = np.random.default_rng(seed)
    ra = _resample(xa, groups_a, rng, iters, q)
    rb = _resample(xb, groups_b, rng, iters, q)
    boot = ra / np.maximum(rb, 1e-12)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": float(np.percentile(xa, q)) / pb, "ci_low": float(lo), "ci_high": float(hi)}
