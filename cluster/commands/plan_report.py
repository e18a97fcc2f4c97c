"""The planner's report: the design notes' figures as PNG files plus a markdown summary, all from ``router.cost``.

Lives next to its only caller, ``cluster/commands/plan.py`` (``kvstack plan report --out DIR``), which parses the specs
and passes a ``ReportInputs``; ``write_report`` writes the files and returns their paths. The pure helpers
(``crossover_tokens``, ``bandwidth_threshold_gbps``, ``fmt_tokens``) are also used by ``kvstack plan breakeven``.

Imports only ``configs`` and ``router.cost`` (and numpy) at module level; matplotlib is imported inside
``_pyplot()`` with the Agg backend, so importing this module is cheap and needs no display.

Figures (file names are part of the contract; tests and the summary refer to them):
    kv_growth.png         KV (+ linear state) per sequence vs context, per model, against GPU HBM sizes
    tier_breakeven.png    t_prefill vs t_fetch per tier, per model, with the crossover lengths
    phase_diagram.png     context x tier bandwidth: where fetch wins and where recompute wins, at one MFU
    storage_pyramid.png   the tiers fastest to slowest with each model's break-even on each
    gpu_sensitivity.png   s* per GPU generation x tier, per model (also a markdown table in summary.md)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from configs.schema import GpuProfile, ModelSpec, TierSpec
from router.cost import (
    GIB,
    breakeven_tokens,
    effective_bandwidth,
    effective_flops,
    fetch_bytes,
    hbm_kv_capacity_tokens,
    kv_bytes_per_token,
    kv_gib_per_tokens,
    t_fetch,
    t_prefill,
)

FIGURES: tuple[str, ...] = (
    "kv_growth.png",
    "tier_breakeven.png",
    "phase_diagram.png",
    "storage_pyramid.png",
    "gpu_sensitivity.png",
)
SUMMARY = "summary.md"

_CONTEXT_RANGE = (1e2, 1e7)  # tokens, x axis of the curve and phase figures
_BW_RANGE_GBPS = (0.05, 2e4)  # y axis of the phase diagram
_DPI = 130


@dataclass(frozen=True, slots=True)
class ReportInputs:
    """What the report is drawn for. ``gpu`` (x ``gpus`` per replica) prices the curve, phase and pyramid figures;
    ``gpu_table`` lists the GPU generations of the sensitivity table. ``tiers`` in any order (sorted here)."""

    models: Sequence[ModelSpec]
    gpu: GpuProfile
    gpu_table: Sequence[GpuProfile]
    tiers: Sequence[TierSpec]
    mfu: float
    bw_util: float
    gpus: int = 1

    def __post_init__(self) -> None:
        if not self.models or not self.gpu_table or not self.tiers:
            raise ValueError("the report needs at least one model, one GPU in the table and one tier")
        effective_flops(self.gpu, self.mfu, self.gpus)  # raises ValueError on a bad MFU / GPU count
        effective_bandwidth(self.tiers[0], self.bw_util)  # raises ValueError on a bad BW_util

    @property
    def tiers_fast_first(self) -> list[TierSpec]:
        return sorted(self.tiers, key=lambda t: -t.bandwidth_gbps)

    @property
    def setting(self) -> str:
        return f"{self.gpus}x {self.gpu.name}, MFU {self.mfu:g}, BW util {self.bw_util:g}"


# --------------------------------------------------------------------------------------------- pure helpers


def crossover_tokens(
    model: ModelSpec, gpu: GpuProfile, tier: TierSpec, *, mfu: float, bw_util: float, gpus: int = 1
) -> float:
    """Shortest context from which fetching the prefix beats recomputing it, with the tier's latency and the
    hybrid's linear-state snapshot included (what the closed-form s* leaves out). 0.0: fetch wins at every length.

    gap(s) = t_prefill(s) − t_fetch(s) = A·s² + B·s − C with A ≥ 0, C ≥ 0 and, when A = 0, B > 0 (the 2·N term),
    so gap is negative up to one crossing and positive after it; bisection finds it. Without latency and state,
    the result equals max(s*, 0).
    """

    def gap(s: float) -> float:
        return t_prefill(model, gpu, s, mfu=mfu, gpus=gpus) - t_fetch(model, tier, s, bw_util=bw_util)

    if gap(1e-6) >= 0:
        return 0.0
    lo, hi = 1e-6, 1.0
    while gap(hi) < 0:
        lo, hi = hi, hi * 2
        if hi > 1e18:
            raise ValueError(f"no crossover below 1e18 tokens for {model.name} on {tier.name}")
    for _ in range(200):
        mid = (lo + hi) / 2
        if gap(mid) < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


def bandwidth_threshold_gbps(
    model: ModelSpec, gpu: GpuProfile, tokens: float, *, mfu: float, bw_util: float, gpus: int = 1
) -> float:
    """Nominal tier bandwidth (GB/s) above which fetching a ``tokens``-long prefix beats recomputing it
    (zero latency): fetch_bytes(s) / (BW_util · t_prefill(s))."""
    return fetch_bytes(model, tokens) / (bw_util * t_prefill(model, gpu, tokens, mfu=mfu, gpus=gpus)) / 1e9


def fmt_tokens(tokens: float) -> str:
    """Compact token count: 950, 12.3k, 289k, 1.25M (signed)."""
    mag = abs(tokens)
    if mag >= 1e6:
        return f"{tokens / 1e6:.3g}M"
    if mag >= 1e4:
        return f"{tokens / 1e3:.0f}k"
    if mag >= 1e3:
        return f"{tokens / 1e3:.1f}k"
    return f"{tokens:.0f}"


def _fmt_breakeven(s: float) -> str:
    return f"{s:,.0f}" if s > 0 else f"{s:,.0f} (fetch always wins)"


# --------------------------------------------------------------------------------------------- figures


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # the `report` extra is optional
        raise RuntimeError("kvstack plan report needs matplotlib: pip install 'kvstack[report]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _colors(plt: Any, n: int) -> list[Any]:
    cmap = plt.get_cmap("tab10")
    return [cmap(i % 10) for i in range(n)]


def fig_kv_growth(inp: ReportInputs, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ctx = np.logspace(3, 7, 200)
    for color, model in zip(_colors(plt, len(inp.models)), inp.models):
        gib = [fetch_bytes(model, s) / GIB for s in ctx]
        label = f"{model.name}: {kv_bytes_per_token(model) / 1024:.0f} KiB/token"
        if model.linear_state_bytes():
            label += f" + {model.linear_state_bytes() / 2**20:.0f} MiB linear state"
        ax.plot(ctx, gib, color=color, lw=2, label=label)
        at = 131072
        y = fetch_bytes(model, at) / GIB
        ax.plot([at], [y], "o", color=color)
        ax.annotate(f"{y:.1f} GiB @128k", (at, y), textcoords="offset points", xytext=(-8, 8), ha="right",
                    color=color, fontsize=9)
    hbm = sorted({g.hbm_gib for g in inp.gpu_table})
    for k, gib in enumerate(hbm):
        names = ", ".join(g.name for g in inp.gpu_table if g.hbm_gib == gib)
        ax.axhline(gib, color="grey", ls=":", lw=1)
        above = k == len(hbm) - 1  # the largest label above its line, the others below theirs
        ax.text(ctx[0] * 1.1, gib * (1.08 if above else 0.93), f"HBM {gib:g} GiB ({names})", color="dimgrey",
                fontsize=8, va="bottom" if above else "top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache per sequence (GiB)")
    ax.set_title("KV cache grows linearly with context (only full-attention layers grow)")
    ax.legend(loc="lower right")
    return _save(plt, fig, path)


def fig_tier_breakeven(inp: ReportInputs, path: Path) -> Path:
    plt = _pyplot()
    tiers = inp.tiers_fast_first
    n = len(inp.models)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 5.5), squeeze=False, sharey=True)
    ctx = np.logspace(math.log10(_CONTEXT_RANGE[0]), math.log10(_CONTEXT_RANGE[1]), 160)
    colors = _colors(plt, len(tiers))
    for ax, model in zip(axes[0], inp.models):
        prefill = [t_prefill(model, inp.gpu, s, mfu=inp.mfu, gpus=inp.gpus) for s in ctx]
        ax.plot(ctx, prefill, color="black", lw=2.5, label="recompute: t_prefill")
        for color, tier in zip(colors, tiers):
            fetch = [t_fetch(model, tier, s, bw_util=inp.bw_util) for s in ctx]
            x = crossover_tokens(model, inp.gpu, tier, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            where = "fetch wins at every length" if x <= 1 else f"fetch wins > {fmt_tokens(x)} tok"
            ax.plot(ctx, fetch, color=color, lw=1.6, label=f"fetch {tier.name} ({tier.bandwidth_gbps:g} GB/s): {where}")
            if _CONTEXT_RANGE[0] <= x <= _CONTEXT_RANGE[1]:
                y = t_fetch(model, tier, x, bw_util=inp.bw_util)
                ax.plot([x], [y], "o", color=color, ms=8, mec="black")
                ax.annotate(fmt_tokens(x), (x, y), textcoords="offset points", xytext=(6, -14), color=color,
                            fontweight="bold")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("context length s (tokens)")
        ax.set_title(model.name + (" (hybrid: fetch includes the linear state)" if model.is_hybrid else ""))
        ax.legend(loc="upper left", fontsize=8)
    axes[0][0].set_ylabel("time to get the prefix's KV (s)")
    fig.suptitle(f"Fetch vs recompute per tier — {inp.setting}; dots = crossover")
    fig.tight_layout()
    return _save(plt, fig, path)


def fig_phase_diagram(inp: ReportInputs, path: Path) -> Path:
    plt = _pyplot()
    from matplotlib.patches import Patch

    fetch_color, recompute_color = "#a9cce3", "#f6c89f"
    n = len(inp.models)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 5.5), squeeze=False, sharey=True)
    ctx = np.logspace(math.log10(_CONTEXT_RANGE[0]), math.log10(_CONTEXT_RANGE[1]), 400)
    bws = np.logspace(math.log10(_BW_RANGE_GBPS[0]), math.log10(_BW_RANGE_GBPS[1]), 400)
    for ax, model in zip(axes[0], inp.models):
        # Fetch wins above the boundary BW*(s) = fetch_bytes(s) / (BW_util * t_prefill(s)) (zero latency).
        edge = [bandwidth_threshold_gbps(model, inp.gpu, s, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
                for s in ctx]
        ax.fill_between(ctx, _BW_RANGE_GBPS[0], edge, color=recompute_color, lw=0)
        ax.fill_between(ctx, edge, _BW_RANGE_GBPS[1], color=fetch_color, lw=0)
        ax.plot(ctx, edge, color="black", lw=1.5)
        star = [
            (breakeven_tokens(model, inp.gpu, TierSpec(name="sweep", bandwidth_gbps=float(bw)),
                              mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus), bw)
            for bw in bws
        ]
        pos = [(s, bw) for s, bw in star if s >= _CONTEXT_RANGE[0]]
        handles = [Patch(color=fetch_color, label="fetch wins"), Patch(color=recompute_color, label="recompute wins")]
        handles += ax.plot([], [], color="black", lw=1.5, label="t_fetch = t_prefill")
        if pos:
            handles += ax.plot([p[0] for p in pos], [p[1] for p in pos], color="white", ls="--", lw=1.5,
                               label="closed-form s*(BW), no state" if model.is_hybrid else "closed-form s*(BW)")
        for tier in inp.tiers_fast_first:
            ax.axhline(tier.bandwidth_gbps, color="dimgrey", lw=0.8)
            ax.text(ctx[0] * 1.15, tier.bandwidth_gbps * 1.12, f"{tier.name} {tier.bandwidth_gbps:g} GB/s",
                    fontsize=8, color="black")
            x = crossover_tokens(model, inp.gpu, tier, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            if _CONTEXT_RANGE[0] <= x <= _CONTEXT_RANGE[1]:
                ax.plot([x], [tier.bandwidth_gbps], "o", color="black", ms=6)
                ax.annotate(fmt_tokens(x), (x, tier.bandwidth_gbps), textcoords="offset points", xytext=(5, -13),
                            fontsize=9, fontweight="bold")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(*_CONTEXT_RANGE)
        ax.set_ylim(*_BW_RANGE_GBPS)
        ax.set_xlabel("context length s (tokens)")
        ax.set_title(model.name)
        ax.legend(handles=handles, loc="upper right", fontsize=9)
    axes[0][0].set_ylabel("tier bandwidth, nominal (GB/s)")
    fig.suptitle(f"Where fetching cached KV beats recomputing it — {inp.setting}, zero latency; dots = named tiers")
    fig.tight_layout()
    return _save(plt, fig, path)


def fig_storage_pyramid(inp: ReportInputs, path: Path) -> Path:
    plt = _pyplot()
    from matplotlib.patches import Polygon

    tiers = inp.tiers_fast_first
    n = len(tiers)
    col_w = 4.2
    fig, ax = plt.subplots(figsize=(6 + col_w * 0.9 * len(inp.models), 1.0 + 0.9 * n))
    colors = plt.get_cmap("Blues")(np.linspace(0.85, 0.25, n))

    def half(level: int) -> float:  # half width of the pyramid at a level boundary (0 = top)
        return 1.2 + 3.8 * level / n

    for i, tier in enumerate(tiers):
        top, bottom = n - i, n - i - 1
        poly = [(5 - half(i), top), (5 + half(i), top), (5 + half(i + 1), bottom), (5 - half(i + 1), bottom)]
        ax.add_patch(Polygon(poly, closed=True, facecolor=colors[i], edgecolor="white", lw=2))
        ax.text(5, bottom + 0.5, f"{tier.name}\n{tier.bandwidth_gbps:g} GB/s", ha="center", va="center",
                fontsize=9, color="white" if i < n / 2 else "black", fontweight="bold")
        for k, model in enumerate(inp.models):
            s = breakeven_tokens(model, inp.gpu, tier, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            x = crossover_tokens(model, inp.gpu, tier, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            text = f"s* = {fmt_tokens(s)} tokens" if s > 0 else "s* ≤ 0: fetch always wins"
            if abs(x - max(s, 0.0)) > max(1.0, 0.01 * s):  # latency / linear state move the crossover
                text += f"\nwith state/latency: fetch wins > {fmt_tokens(x)} tok"
            ax.text(10.6 + col_w * k, bottom + 0.5, text, va="center", fontsize=9,
                    color="darkred" if s > 0 else "navy")
    for k, model in enumerate(inp.models):
        ax.text(10.6 + col_w * k, n + 0.25, model.name, fontsize=10, fontweight="bold")
    ax.set_xlim(0, 10.6 + col_w * len(inp.models))
    ax.set_ylim(0, n + 0.6)
    ax.axis("off")
    ax.set_title(f"Storage pyramid (fastest on top) and each model's break-even — {inp.setting}\n"
                 "fetch from a tier wins for contexts longer than s*", fontsize=10)
    return _save(plt, fig, path)


def sensitivity_table(inp: ReportInputs) -> dict[str, dict[str, dict[str, float]]]:
    """s* (unclamped) per model -> GPU -> tier, at the report's MFU, BW util and GPUs per replica."""
    return {
        m.name: {
            g.name: {
                t.name: breakeven_tokens(m, g, t, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
                for t in inp.tiers_fast_first
            }
            for g in inp.gpu_table
        }
        for m in inp.models
    }


def fig_gpu_sensitivity(inp: ReportInputs, path: Path) -> Path:
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    table = sensitivity_table(inp)
    tiers = inp.tiers_fast_first
    gpus = list(inp.gpu_table)
    n = len(inp.models)
    fig, axes = plt.subplots(n, 1, figsize=(1.5 * len(tiers) + 3.5, (0.5 * len(gpus) + 1.3) * n), squeeze=False)
    for ax, model in zip(axes[:, 0], inp.models):
        vals = np.array([[table[model.name][g.name][t.name] for t in tiers] for g in gpus])
        shade = np.where(vals > 0, np.log10(np.maximum(vals, 1.0)), np.nan)
        ax.imshow(np.zeros_like(vals), cmap=ListedColormap(["#d6eaf8"]), aspect="auto")  # fetch always wins
        ax.imshow(shade, cmap="Oranges", vmin=3, vmax=7, aspect="auto")  # fetch wins above s*
        for r in range(len(gpus)):
            for c in range(len(tiers)):
                v = vals[r, c]
                ax.text(c, r, fmt_tokens(v), ha="center", va="center", fontsize=9,
                        color="black" if v > 0 else "navy", fontweight="bold" if v > 0 else "normal")
        ax.set_xticks(range(len(tiers)), [f"{t.name}\n{t.bandwidth_gbps:g} GB/s" for t in tiers], fontsize=8)
        ax.set_yticks(range(len(gpus)), [f"{g.name}\n{g.bf16_tflops:g} TFLOPS" for g in gpus], fontsize=8)
        ax.set_title(f"{model.name}: break-even s* (tokens)")
        ax.grid(False)
    fig.suptitle(f"s* per GPU generation x tier — MFU {inp.mfu:g}, BW util {inp.bw_util:g}, {inp.gpus} GPU(s)/replica\n"
                 "orange: fetch wins above s*; blue (s* <= 0): fetch always wins", fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


# --------------------------------------------------------------------------------------------- summary


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def summary_markdown(inp: ReportInputs) -> str:
    tiers = inp.tiers_fast_first
    out = [
        "# kvstack plan report",
        "",
        f"Setting: **{inp.setting}**. Formulas: DESIGN.md \"Why\"; every number comes from `router.cost`.",
        "s* = (MFU·F)/(BW_util·BW)·(n_kv·bytes)/(2·n_q) − N/(2·n_q·d·L_attn); fetch wins for contexts longer "
        "than s* (s* ≤ 0: at every length). The crossover column adds the tier latency and the hybrid "
        "linear-state snapshot, which the closed form leaves out.",
        "",
        "## KV growth per model",
        "",
        "![KV growth](kv_growth.png)",
        "",
    ]
    rows = []
    for m in inp.models:
        rows.append([
            m.name,
            f"{kv_bytes_per_token(m):,}",
            f"{m.linear_state_bytes() / 2**20:.1f}",
            f"{kv_gib_per_tokens(m, 10_000):.3f}",
            f"{fetch_bytes(m, 131072) / GIB:.2f}",
            f"{hbm_kv_capacity_tokens(m, inp.gpu):,.0f}",
        ])
    out.append(_md_table(
        ["model", "KV bytes/token", "linear state MiB/seq", "GiB per 10k tokens", "GiB @128k (incl. state)",
         f"tokens in {inp.gpu.name} HBM ({inp.gpu.hbm_gib:g} GiB)"],
        rows,
    ))
    out += ["", "## Tier break-even", "", "![tier break-even](tier_breakeven.png)", ""]
    rows = []
    for m in inp.models:
        for t in tiers:
            s = breakeven_tokens(m, inp.gpu, t, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            x = crossover_tokens(m, inp.gpu, t, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            rows.append([m.name, t.name, f"{t.bandwidth_gbps:g}", _fmt_breakeven(s), f"{x:,.0f}"])
    out.append(_md_table(["model", "tier", "GB/s", "s* closed form (tokens)", "crossover incl. state/latency"],
                         rows))
    out += [
        "",
        "## Context x bandwidth phase diagram",
        "",
        "![phase diagram](phase_diagram.png)",
        "",
        "Tier bandwidth (nominal, zero latency) above which fetching beats recomputing a prefix of this length:",
        "",
    ]
    lengths = (1024, 8192, 32768, 131072, 1048576)
    rows = [
        [m.name] + [f"{bandwidth_threshold_gbps(m, inp.gpu, s, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus):.3g}"
                    for s in lengths]
        for m in inp.models
    ]
    out.append(_md_table(["model"] + [f"{fmt_tokens(s)} tok (GB/s)" for s in lengths], rows))
    out += ["", "## Storage pyramid", "", "![storage pyramid](storage_pyramid.png)", ""]
    for m in inp.models:
        always, above = [], []
        for t in tiers:
            s = breakeven_tokens(m, inp.gpu, t, mfu=inp.mfu, bw_util=inp.bw_util, gpus=inp.gpus)
            (always if s <= 0 else above).append(t.name if s <= 0 else f"{t.name} above {fmt_tokens(s)} tokens")
        out.append(f"- **{m.name}**: fetch always wins from {', '.join(always) or 'no tier'}; "
                   f"fetch wins from {', '.join(above) or 'no other tier'}.")
    out += [
        "",
        "## GPU-generation sensitivity",
        "",
        "![GPU sensitivity](gpu_sensitivity.png)",
        "",
    ]
    table = sensitivity_table(inp)
    for m in inp.models:
        out += [f"**{m.name}**: s* in tokens (≤ 0: fetch always wins)", ""]
        rows = [
            [f"{g.name} ({g.bf16_tflops:g} TFLOPS)"] + [f"{table[m.name][g.name][t.name]:,.0f}" for t in tiers]
            for g in inp.gpu_table
        ]
        out += [_md_table(["GPU"] + [f"{t.name} ({t.bandwidth_gbps:g} GB/s)" for t in tiers], rows), ""]
    return "\n".join(out) + "\n"


def write_report(out_dir: Path, inp: ReportInputs) -> list[Path]:
    """Write the five PNGs and summary.md into ``out_dir`` (created); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    draw: list[tuple[str, Callable[[ReportInputs, Path], Path]]] = [
        ("kv_growth.png", fig_kv_growth),
        ("tier_breakeven.png", fig_tier_breakeven),
        ("phase_diagram.png", fig_phase_diagram),
        ("storage_pyramid.png", fig_storage_pyramid),
        ("gpu_sensitivity.png", fig_gpu_sensitivity),
    ]
    paths = [fn(inp, out_dir / name) for name, fn in draw]
    summary = out_dir / SUMMARY
    summary.write_text(summary_markdown(inp))
    return [*paths, summary]
