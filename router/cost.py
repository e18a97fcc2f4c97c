"""The cost model: pure functions over typed model / GPU / tier specs.

Used by the planner CLI (``kvstack plan``), the live ``cost_based`` policy, the simulator and the calibration
loop; all call these same functions. Units: seconds, bytes, FLOPs, tokens. Bandwidths in the specs are GB/s
(1e9 B/s); TFLOPS are 1e12 FLOP/s.

Formulas (DESIGN.md, "Why"):
    prefill FLOPs(s)   = 2·s·N + 4·s²·n_q·d·L_attn               (only full-attention layers are quadratic)
    kv_bytes_per_token = 2·n_kv·d·L_attn·bytes_per_elem
    t_prefill(s)       = (2·s·N + a·4·s²·n_q·d·L_attn) / (MFU·FLOPS_peak·gpus)   (a = ``attn_scale``, 1 by default)
    t_fetch(s)         = latency + s·kv_bytes_per_token / (BW_util·BW_tier)
    s*                 = (MFU·F)/(BW_util·BW) · (n_kv·bytes_per_elem)/(2·n_q) − N/(2·n_q·d·L_attn)
For BF16 (2 bytes) the break-even reduces to the design note's (MFU·F)/(BW_util·BW)·n_kv/n_q − N/(2·n_q·d·L_attn).
Prefill of the uncached suffix when ``c`` tokens are already cached: FLOPs(s) − FLOPs(c).
``attn_scale`` is the attention FLOPs' cost per FLOP relative to the matrix products' at the same MFU: what an engine
measured apart from them (``router.calibration.MfuEstimator``; vLLM's CPU build on an AVX2 box ran its attention at
~0.3 of its matrix products' cost per FLOP, ``bench/reports/live_agent_overflow``); 1 prices every FLOP alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.schema import GpuProfile, ModelSpec, TierSpec

GB = 1e9
TERA = 1e12
GIB = 2**30


def kv_bytes_per_token(model: ModelSpec) -> int:
    """KV bytes one token adds to the cache (K and V of every full-attention layer)."""
    return model.kv_bytes_per_token()


def prefill_flops(model: ModelSpec, tokens: float, cached_tokens: float = 0.0, attn_scale: float = 1.0) -> float:
    """FLOPs to prefill positions [cached_tokens, tokens): linear term plus full-attention quadratic term (its FLOPs
    weighed by ``attn_scale``: module docstring)."""
    if cached_tokens < 0 or tokens < cached_tokens:
        raise ValueError(f"need 0 <= cached_tokens <= tokens, got cached={cached_tokens} tokens={tokens}")
    return work_flops(model, tokens - cached_tokens, tokens**2 - cached_tokens**2, attn_scale)


def prefill_terms(model: ModelSpec, tokens: float, cached_tokens: float = 0.0) -> tuple[float, float]:
    """The FLOPs of ``prefill_flops`` as its two terms, (matrix products, attention), the attention unweighed:
    what a fit of the attention's own rate is fed (``router.calibration.MfuEstimator``)."""
    linear = work_flops(model, tokens - cached_tokens, 0.0)
    return linear, prefill_flops(model, tokens, cached_tokens) - linear


def work_flops(model: ModelSpec, tokens: float, tokens_sq: float, attn_scale: float = 1.0) -> float:
    """FLOPs of several prefills at once from their sums: ``tokens`` = Σ (P − c), ``tokens_sq`` = Σ (P² − c²)
    (the prefill formula is linear in both, so a queue of prefills is priced from two numbers); the attention term
    weighed by ``attn_scale``."""
    return 2.0 * tokens * model.params + attn_scale * 4.0 * tokens_sq * model.n_q * model.head_dim * \
        model.full_attention_layers


def effective_flops(gpu: GpuProfile, mfu: float, gpus: int = 1) -> float:
    """Sustained FLOP/s of one replica: MFU x dense BF16 peak x GPU count."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    return mfu * gpu.bf16_tflops * TERA * gpus


def effective_bandwidth(tier: TierSpec, bw_util: float) -> float:
    """Sustained bytes/s of a tier: BW_util x nominal bandwidth."""
    if not 0 < bw_util <= 1:
        raise ValueError(f"bw_util must be in (0, 1], got {bw_util}")
    return bw_util * tier.bandwidth_gbps * GB


def t_prefill(
    model: ModelSpec, gpu: GpuProfile, tokens: float, *, mfu: float, gpus: int = 1, cached_tokens: float = 0.0,
    attn_scale: float = 1.0,
) -> float:
    """Seconds to prefill ``tokens`` when the first ``cached_tokens`` already have KV."""
    return prefill_flops(model, tokens, cached_tokens, attn_scale) / effective_flops(gpu, mfu, gpus)


def fetch_bytes(model: ModelSpec, tokens: float) -> float:
    """Bytes moved to reuse a ``tokens``-long prefix: KV of every token plus, for hybrids, one state snapshot."""
    if tokens <= 0:
        return 0.0
    return tokens * kv_bytes_per_token(model) + model.linear_state_bytes()


def t_fetch(
    model: ModelSpec, tier: TierSpec, tokens: float, *, bw_util: float, latency_s: float | None = None
) -> float:
    """Seconds to move a ``tokens``-long prefix's KV from ``tier``: latency + bytes / sustained bandwidth.

    ``latency_s`` overrides the tier's own latency (e.g. a calibrated or queue-inflated value). Zero tokens cost 0.
    """
    if tokens <= 0:
        return 0.0
    latency = tier.latency_s if latency_s is None else latency_s
    return latency + fetch_bytes(model, tokens) / effective_bandwidth(tier, bw_util)


def breakeven_tokens(
    model: ModelSpec, gpu: GpuProfile, tier: TierSpec, *, mfu: float, bw_util: float, gpus: int = 1
) -> float:
    """Closed-form s* where t_fetch == t_prefill (bandwidth terms only; not clamped: s* <= 0 => fetch always wins).

    Fetch wins for contexts longer than s*. Derivation: equate s·b_kv/B = (2·s·N + 4·s²·n_q·d·L)/F, divide by s.
    """
    ratio = effective_flops(gpu, mfu, gpus) / effective_bandwidth(tier, bw_util)
    attn = model.n_q * model.head_dim * model.full_attention_layers
    if attn == 0:
        raise ValueError(f"model {model.name!r} has no full-attention layers: KV does not grow with context")
    return ratio * model.n_kv * model.bytes_per_elem / (2 * model.n_q) - model.params / (2 * attn)


def hbm_kv_capacity_tokens(model: ModelSpec, gpu: GpuProfile, kv_budget_gib: float | None = None) -> float:
    """Tokens of KV that fit in the GPU's HBM (or in ``kv_budget_gib``), GiB = 2^30 bytes."""
    budget = gpu.hbm_gib if kv_budget_gib is None else kv_budget_gib
    if budget <= 0:
        raise ValueError(f"KV budget must be positive, got {budget} GiB")
    return budget * GIB / kv_bytes_per_token(model)


def kv_gib_per_tokens(model: ModelSpec, tokens: float = 10_000) -> float:
    """GiB of KV held by ``tokens`` tokens of context."""
    return tokens * kv_bytes_per_token(model) / GIB


@dataclass(frozen=True, slots=True)
class Hardware:
    """Calibratable performance of one replica and the pool: what the live policy and simulator price with."""

    model: ModelSpec
    gpu: GpuProfile
    mfu: float
    bw_util: float
    gpus: int = 1
    attn_scale: float = 1.0  # the attention FLOPs' cost relative to the matrix products' (module docstring)

    def __post_init__(self) -> None:
        if not (self.attn_scale > 0 and math.isfinite(self.attn_scale)):
            raise ValueError(f"attn_scale must be a finite number > 0, got {self.attn_scale}")


def ttft(
    hw: Hardware,
    *,
    prompt_tokens: float,
    cached_tokens: float = 0.0,
    tier: TierSpec | None = None,
    queue_delay_s: float = 0.0,
    transfer_latency_s: float | None = None,
) -> float:
    """Predicted time to first token: queue + fetch of the cached prefix from ``tier`` + prefill of the rest.

    ``tier=None`` means the cached prefix is already in the replica's HBM (no transfer). Decode of the first
    token is folded into the prefill (one more forward pass of one token is negligible next to a prefill).
    """
    if queue_delay_s < 0:
        raise ValueError(f"queue_delay_s must be >= 0, got {queue_delay_s}")
    cached = min(cached_tokens, prompt_tokens)
    fetch = 0.0
    if tier is not None and cached > 0:
        fetch = t_fetch(hw.model, tier, cached, bw_util=hw.bw_util, latency_s=transfer_latency_s)
    compute = t_prefill(hw.model, hw.gpu, prompt_tokens, mfu=hw.mfu, gpus=hw.gpus, cached_tokens=cached,
                        attn_scale=hw.attn_scale)
    return queue_delay_s + fetch + compute


def split_point(
    hw: Hardware,
    *,
    cached_tokens: float,
    tier: TierSpec,
    transfer_latency_s: float | None = None,
    resolution: int = 48,
) -> tuple[float, float]:
    """SPLIT: compute the head [0, h) while fetching the tail [h, cached) in parallel; returns (h, overlap time).

    The overlap time max(t_prefill(h), t_fetch(cached - h)) is minimised where the two meet; prefill time grows
    and fetch time shrinks monotonically in h, so a bisection finds the meeting point.
    """

    def head(h: float) -> float:
        return t_prefill(hw.model, hw.gpu, h, mfu=hw.mfu, gpus=hw.gpus, attn_scale=hw.attn_scale)

    def tail(h: float) -> float:
        return t_fetch(hw.model, tier, cached_tokens - h, bw_util=hw.bw_util, latency_s=transfer_latency_s)

    lo, hi = 0.0, float(cached_tokens)
    for _ in range(resolution):
        mid = (lo + hi) / 2
        if head(mid) < tail(mid):
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda h: max(head(h), tail(h)))
    return best, max(head(best), tail(best))


def ttft_split(
    hw: Hardware,
    *,
    prompt_tokens: float,
    cached_tokens: float,
    tier: TierSpec,
    queue_delay_s: float = 0.0,
    transfer_latency_s: float | None = None,
) -> tuple[float, float]:
    """Predicted TTFT of SPLIT and its head length h: queue + overlap(head compute, tail fetch) + suffix prefill."""
    cached = min(cached_tokens, prompt_tokens)
    h, overlap = split_point(hw, cached_tokens=cached, tier=tier, transfer_latency_s=transfer_latency_s)
    suffix = t_prefill(hw.model, hw.gpu, prompt_tokens, mfu=hw.mfu, gpus=hw.gpus, cached_tokens=cached,
                       attn_scale=hw.attn_scale)
    return queue_delay_s + overlap + suffix, h
