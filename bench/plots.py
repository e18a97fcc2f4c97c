"""PNG plots for bench results (matplotlib, Agg backend; imported only by the CLIs' ``run``).

Each function takes plain data keyed by a series label (a policy, an endpoint) and writes one PNG; none reads
files or result JSON itself. Called by ``bench.agent_cli``, ``bench.trace_cli``, ``bench.compare_cli`` and
``bench.simulate_cli`` and ``bench.live_compare``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: Path, *, grid_axis: str = "both") -> Path:
    """The common finish of every plot: light grid, a legend when anything is labelled, tight layout, PNG."""
    ax.grid(True, axis=grid_axis, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_cdf(series: Mapping[str, Sequence[float]], path: Path, *, title: str = "TTFT CDF") -> Path:
    """One empirical CDF line per label (x: TTFT seconds, log scale when the range is wide)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lo, hi = np.inf, 0.0
    for label, samples in series.items():
        arr = np.sort(np.asarray([s for s in samples if s is not None and s > 0], dtype=float))
        if arr.size == 0:
            continue
        lo, hi = min(lo, arr[0]), max(hi, arr[-1])
        ax.step(arr, np.arange(1, arr.size + 1) / arr.size, where="post", label=f"{label} (n={arr.size})")
    if hi > 0 and hi / max(lo, 1e-12) > 50:
        ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    return _save(plt, fig, ax, path)


def ttft_by_turn(series: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> Path:
    """p50 TTFT per turn index, one line per label (rows as in a result's ``per_turn``), p90 as a band."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, rows in series.items():
        rows = [r for r in rows if r.get("ttft_p50_s") is not None]
        if not rows:
            continue
        turns = [r["turn"] for r in rows]
        p50 = [r["ttft_p50_s"] for r in rows]
        p90 = [r.get("ttft_p90_s") or r["ttft_p50_s"] for r in rows]
        (line,) = ax.plot(turns, p50, marker="o", label=label)
        ax.fill_between(turns, p50, p90, alpha=0.15, color=line.get_color())
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (band to p90), s")
    ax.set_title("TTFT by turn")
    return _save(plt, fig, ax, path)


def ttft_timeline(series: Mapping[str, Sequence[tuple[float, float]]], path: Path) -> Path:
    """TTFT against send time, one marker series per label: shows queues building up during a run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in series.items():
        if pts:
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=0.8, label=label)
    ax.set_xlabel("request sent at (s from run start)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT over the run")
    return _save(plt, fig, ax, path)


def grouped_bars(
    series: Mapping[str, Mapping[str, float]], path: Path, *, title: str, ylabel: str
) -> Path:
    """Grouped bars: one group per label, one bar per key (e.g. hit tokens by tier, decisions by action)."""
    plt = _plt()
    labels = list(series)
    keys = sorted({k for v in series.values() for k in v})
    fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(labels) + 2), 4.2))
    width = 0.8 / max(len(keys), 1)
    x = np.arange(len(labels))
    for i, key in enumerate(keys):
        ax.bar(x + i * width - 0.4 + width / 2, [series[l].get(key, 0.0) for l in labels], width, label=key)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save(plt, fig, ax, path, grid_axis="y")


def hit_tokens_by_tier(series: Mapping[str, Mapping[str, float]], path: Path) -> Path:
    return grouped_bars(series, path, title="prefix hit tokens by tier", ylabel="tokens")
