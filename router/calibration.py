"""Online calibration: fit MFU per replica and bandwidth/latency per tier from what the cluster actually did.

Who calls what: the ingress (live) or the simulator feeds ``Calibrator.observe_prefill`` with each finished
prefill — (prompt tokens, tokens that were cached, seconds spent computing) — and ``observe_transfer`` with each
finished pool transfer — (tier class, bytes, seconds). Every few seconds it asks ``hardware(replica_id, hw)`` and
``tier_map(base)`` for updated ``Hardware`` / ``TierMap`` objects and puts them into the snapshots the policies
price with. Pure: no clocks, no I/O; the fits depend only on the observation sequence.

The fits are the cost model's own lines (``router.cost``):
    prefill seconds  ≈ overhead + FLOPs(tokens, cached) / (MFU · peak · gpus)   → slope gives MFU
    transfer seconds ≈ latency  + bytes / (BW_util · BW_tier)                   → slope gives BW, intercept latency
fitted by exponentially weighted least squares (``OnlineLine``, half-life in observations) with outlier rejection
(a residual beyond ``outlier_k`` × the EW mean absolute residual is dropped, unless several in a row are: then the
hardware really changed and the fit follows). Until ``min_obs`` observations arrive, the configured values stand;
when the observations cannot separate the intercept from the slope (similar sizes), the configured latency stands
and only the bandwidth is fitted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from configs.schema import TierSpec
from router.cost import GB, TERA, Hardware, prefill_flops
from router.policies.pricing import TierMap

TIER_CLASSES = ("dram_local", "dram_remote", "ssd_local", "ssd_remote")


class OnlineLine:
    """Exponentially weighted least squares for ``y ≈ a + b·x`` with robust outlier rejection."""

    __slots__ = (
        "_rejects_in_row",
        "_res_s",
        "_res_w",
        "decay",
        "fallback_intercept",
        "max_rejects",
        "min_obs",
        "n",
        "outlier_k",
        "rejected",
        "sx",
        "sxx",
        "sxy",
        "sy",
        "w",
    )

    def __init__(self, *, halflife: float = 50.0, min_obs: int = 5, outlier_k: float = 4.0, max_rejects: int = 3,
                 fallback_intercept: float = 0.0):
        if halflife <= 0 or min_obs < 2 or outlier_k <= 0 or max_rejects < 1:
            raise ValueError(
                f"need halflife > 0, min_obs >= 2, outlier_k > 0, max_rejects >= 1; got {halflife}, {min_obs}, "
                f"{outlier_k}, {max_rejects}"
            )
        if fallback_intercept < 0 or not math.isfinite(fallback_intercept):
            raise ValueError(f"fallback_intercept must be finite and >= 0, got {fallback_intercept}")
        self.fallback_intercept = fallback_intercept
        self.decay = 0.5 ** (1.0 / halflife)
        self.min_obs = min_obs
        self.outlier_k = outlier_k
        self.max_rejects = max_rejects
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n = 0
        self.rejected = 0
        self._res_s = 0.0  # EW sum of absolute residuals (against the fit before each point)
        self._res_w = 0.0
        self._rejects_in_row = 0

    @property
    def ready(self) -> bool:
        return self.n >= self.min_obs

    def observe(self, x: float, y: float) -> bool:
        """Add one point; ``False`` if it was rejected as an outlier."""
        if not (math.isfinite(x) and math.isfinite(y)):
            raise ValueError(f"observation must be finite, got x={x} y={y}")
        d = self.decay
        fit = self.fit() if self.n >= 2 else None
        if fit is not None:
            residual = abs(y - (fit[0] + fit[1] * x))
            if self.ready:
                scale = max(self._res_s / self._res_w, 1e-3 * abs(y), 1e-15)
                if residual > self.outlier_k * scale and self._rejects_in_row < self.max_rejects:
                    self._rejects_in_row += 1
                    self.rejected += 1
                    return False
            self._res_s = d * self._res_s + residual
            self._res_w = d * self._res_w + 1.0
        self._rejects_in_row = 0
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y
        self.n += 1
        return True

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``. With (nearly) constant x, or when the free fit is not a line with a >= 0 and b > 0, the
        intercept is held at ``fallback_intercept`` (the configured value: x alone cannot tell it from the slope) and only
        the slope is fitted; through the origin if even that leaves no positive slope. ``None`` if no data."""
        if self.w <= 0 or self.sx == 0:
            return None
        den = self.w * self.sxx - self.sx * self.sx
        if den > 1e-9 * self.w * self.sxx:
            b = (self.w * self.sxy - self.sx * self.sy) / den
            a = (self.sy - b * self.sx) / self.w
            if a >= 0 and b > 0:
                return a, b
        a = self.fallback_intercept
        if a > 0:
            b = (self.sxy - a * self.sx) / self.sxx
            if b > 0:
                return a, b
        b = self.sxy / self.sxx
        return (0.0, b) if b > 0 else None


class MfuEstimator:
    """MFU of one replica from its prefills: seconds ≈ overhead + FLOPs / (MFU · peak · gpus)."""

    def __init__(self, hw: Hardware, *, halflife: float = 50.0, min_obs: int = 5, outlier_k: float = 4.0,
                 min_mfu: float = 1e-3) -> None:
        self.base = hw
        self.min_mfu = min_mfu
        self.line = OnlineLine(halflife=halflife, min_obs=min_obs, outlier_k=outlier_k)
        self._hw = hw

    def observe(self, tokens: int, cached_tokens: int, seconds: float) -> bool:
        """One finished prefill of ``tokens`` prompt tokens of which ``cached_tokens`` were reused."""
        if seconds <= 0:
            raise ValueError(f"prefill seconds must be positive, got {seconds}")
        flops = prefill_flops(self.base.model, tokens, cached_tokens)
        if flops <= 0:
            return False
        return self.line.observe(flops, seconds)

    @property
    def mfu(self) -> float:
        fit = self.line.fit() if self.line.ready else None
        if fit is None:
            return self.base.mfu
        peak = self.base.gpu.bf16_tflops * TERA * self.base.gpus
        return min(1.0, max(self.min_mfu, 1.0 / (fit[1] * peak)))

    @property
    def overhead_s(self) -> float:
        fit = self.line.fit() if self.line.ready else None
        return 0.0 if fit is None else fit[0]

    def hardware(self) -> Hardware:
        """The base hardware with the fitted MFU (the same object while the MFU has not moved by 0.1%)."""
        mfu = self.mfu
        if abs(mfu - self._hw.mfu) > 1e-3 * self._hw.mfu:
            self._hw = dataclasses.replace(self.base, mfu=mfu)
        return self._hw


class TierEstimator:
    """Bandwidth and latency of one tier class from transfers: seconds ≈ latency + bytes / (BW_util · BW)."""

    def __init__(self, tier: TierSpec, *, bw_util: float, halflife: float = 50.0, min_obs: int = 5,
                 outlier_k: float = 4.0) -> None:
        if not 0 < bw_util <= 1:
            raise ValueError(f"bw_util must be in (0, 1], got {bw_util}")
        self.base = tier
        self.bw_util = bw_util
        # Fetches of similar sizes cannot separate latency from bandwidth: then the configured latency stands.
        self.line = OnlineLine(halflife=halflife, min_obs=min_obs, outlier_k=outlier_k,
                               fallback_intercept=tier.latency_s)
        self._tier = tier

    def observe(self, nbytes: float, seconds: float) -> bool:
        if nbytes <= 0 or seconds <= 0:
            raise ValueError(f"transfer bytes and seconds must be positive, got {nbytes}, {seconds}")
        return self.line.observe(nbytes, seconds)

    @property
    def effective_bandwidth_bps(self) -> float:
        fit = self.line.fit() if self.line.ready else None
        if fit is None:
            return self.bw_util * self.base.bandwidth_gbps * GB
        return 1.0 / fit[1]

    @property
    def latency_s(self) -> float:
        fit = self.line.fit() if self.line.ready else None
        return self.base.latency_s if fit is None else fit[0]

    def tier_spec(self) -> TierSpec:
        """A ``TierSpec`` that, priced with the same ``bw_util``, reproduces the fitted line."""
        if not self.line.ready:
            return self.base
        gbps = self.effective_bandwidth_bps / (self.bw_util * GB)
        lat = self.latency_s
        cur = self._tier
        if abs(gbps - cur.bandwidth_gbps) > 1e-3 * cur.bandwidth_gbps or abs(lat - cur.latency_s) > 1e-6:
            self._tier = TierSpec(
                name=self.base.name,
                bandwidth_gbps=gbps,
                latency_s=lat,
                description=f"{self.base.description} (calibrated from {self.line.n} transfers)".strip(),
            )
        return self._tier


class Calibrator:
    """Per-replica MFU and per-tier-class bandwidth/latency fits for one router."""

    def __init__(self, *, bw_util: float, halflife: float = 50.0, min_obs: int = 5, outlier_k: float = 4.0) -> None:
        self.bw_util = bw_util
        self._opts = {"halflife": halflife, "min_obs": min_obs, "outlier_k": outlier_k}
        self._mfu: dict[str, MfuEstimator] = {}
        self._tiers: dict[str, TierEstimator] = {}

    def observe_prefill(self, replica_id: str, hw: Hardware, tokens: int, cached_tokens: int, seconds: float) -> bool:
        est = self._mfu.get(replica_id)
        if est is None or est.base.model != hw.model or est.base.gpu != hw.gpu or est.base.gpus != hw.gpus:
            est = self._mfu[replica_id] = MfuEstimator(hw, **self._opts)  # type: ignore[arg-type]
        return est.observe(tokens, cached_tokens, seconds)

    def observe_transfer(self, tier_class: str, base: TierMap, nbytes: float, seconds: float) -> bool:
        """A finished fetch from ``tier_class`` (one of ``TIER_CLASSES``, the ``TierMap`` field that priced it)."""
        if tier_class not in TIER_CLASSES:
            raise ValueError(f"unknown tier class {tier_class!r}; expected one of {', '.join(TIER_CLASSES)}")
        est = self._tiers.get(tier_class)
        if est is None:
            est = self._tiers[tier_class] = TierEstimator(
                getattr(base, tier_class), bw_util=self.bw_util, **self._opts  # type: ignore[arg-type]
            )
        return est.observe(nbytes, seconds)

    def hardware(self, replica_id: str, hw: Hardware) -> Hardware:
        """``hw`` with the replica's fitted MFU (``hw`` itself until the replica has enough prefills)."""
        est = self._mfu.get(replica_id)
        if est is None or not est.line.ready:
            return hw
        return est.hardware()

    def overhead_s(self, replica_id: str) -> float:
        """The replica's fitted fixed per-request seconds (the prefill line's intercept; 0 until fitted)."""
        est = self._mfu.get(replica_id)
        return 0.0 if est is None or not est.line.ready else max(0.0, est.overhead_s)

    def tier_map(self, base: TierMap) -> TierMap:
        """``base`` with every tier class that has enough transfers replaced by its fitted spec."""
        updates: Mapping[str, TierSpec] = {
            name: est.tier_spec() for name, est in self._tiers.items() if est.line.ready
        }
        return dataclasses.replace(base, **updates) if updates else base

    def transfer_counts(self) -> dict[str, int]:
        """Accepted transfer observations per tier class."""
        return {name: est.line.n for name, est in self._tiers.items()}

    def forget_replica(self, replica_id: str) -> None:
        self._mfu.pop(replica_id, None)
