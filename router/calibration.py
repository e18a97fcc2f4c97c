"""Online calibration: fit MFU per replica and bandwidth/latency per tier from what the cluster actually did.

Who calls what: the ingress (live) or the simulator feeds ``Calibrator.observe_prefill`` with each finished
prefill — (prompt tokens, tokens that were cached, seconds spent computing) — and ``observe_transfer`` with each
finished pool transfer — (tier class, bytes, seconds). Every few seconds it asks ``hardware(replica_id, hw)`` and
``tier_map(base)`` for updated ``Hardware`` / ``TierMap`` objects and puts them into the snapshots the policies
price with. Pure: no clocks, no I/O; the fits depend only on the observation sequence.

The fits are the cost model's own lines (``router.cost``):
    prefill seconds  ≈ overhead + FLOPs(tokens, cached) / (MFU · peak · gpus)   → slope gives MFU
    transfer seconds ≈ latency  + bytes / (BW_util · BW_tier)                   → slope gives BW, intercept latency
(a transfer reported with its read alone: the line is the read's, and the latency adds the median of the recent
waits before the reads, ``TierEstimator``)
fitted by exponentially weighted least squares (``OnlineLine``, half-life in observations; the prefill line for
relative error, each sample weighing 1/seconds², since a prediction is judged by its relative error) with outlier
rejection (a residual beyond ``outlier_k`` × the EW mean absolute residual is dropped, unless several in a row are:
then the hardware really changed and the fit follows). Until ``min_obs`` observations arrive, the configured values
stand; when the observations cannot separate the intercept from the slope (similar sizes), the configured latency
stands and only the bandwidth is fitted.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Mapping

from configs.schema import TierSpec
from router.cost import GB, TERA, Hardware, prefill_terms
from router.policies.pricing import TierMap

TIER_CLASSES = ("dram_local", "dram_remote", "ssd_local", "ssd_remote")


#: ``OnlineLine`` fits its intercept only when its x values' weighted coefficient of variation reaches this. Below
#: it the intercept is noise: five same-size prefills (x within 2%) whose seconds vary by ±5% put 0.1 s of a 0.2 s
#: prefill into it (``tests/unit/test_calibration.py``).
MIN_SPREAD = 0.25


class OnlineLine:
    """Exponentially weighted least squares for ``y ≈ a + b·x`` with robust outlier rejection.

    ``relative``: each sample weighs 1/y², so the fit minimises the squared *relative* residuals, the error the
    decision audit measures (issue 13: |predicted − actual| / actual). Plain least squares lets the largest and
    noisiest samples set the line: in a live run where the same-size first turns took 0.17–1.0 s (2 engines, 2
    shards, Ray and the load generator on 2 cores; interference only ever slows a prefill), the line passed well
    above the short prefills (HOLDERs of ~165 new tokens predicted 0.054 s, taking 0.03 s). Replayed over the
    prefills of 16 live runs of the overflow and the sequential workloads (``bench.calibration_replay``), the median
    relative error of the prefill prediction went 0.16 → 0.12, on the sequential one 0.46–0.79 → 0.20–0.36
    (``bench/reports/live_agent_sequential``)."""

    __slots__ = (
        "_rejects_in_row",
        "_res_s",
        "_res_w",
        "decay",
        "fallback_intercept",
        "max_rejects",
        "min_obs",
        "min_spread",
        "n",
        "outlier_k",
        "rejected",
        "relative",
        "sx",
        "sxx",
        "sxy",
        "sy",
        "w",
    )

    def __init__(self, *, halflife: float = 50.0, min_obs: int = 5, outlier_k: float = 4.0, max_rejects: int = 3,
                 fallback_intercept: float = 0.0, min_spread: float = MIN_SPREAD, relative: bool = False):
        if halflife <= 0 or min_obs < 2 or outlier_k <= 0 or max_rejects < 1 or min_spread < 0:
            raise ValueError(
                f"need halflife > 0, min_obs >= 2, outlier_k > 0, max_rejects >= 1, min_spread >= 0; got {halflife}, "
                f"{min_obs}, {outlier_k}, {max_rejects}, {min_spread}"
            )
        self.min_spread = min_spread
        self.relative = relative
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
        om = 1.0 / (y * y) if self.relative and y > 0 else 1.0  # the sample's weight
        self.w = d * self.w + om
        self.sx = d * self.sx + om * x
        self.sy = d * self.sy + om * y
        self.sxx = d * self.sxx + om * x * x
        self.sxy = d * self.sxy + om * x * y
        self.n += 1
        return True

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``. When the x values spread too little to tell the intercept from the slope (their weighted
        coefficient of variation below ``min_spread``), or when the free fit is not a line with a >= 0 and b > 0, the
        intercept is held at ``fallback_intercept`` (the configured value) and only the slope is fitted; through the
        origin if even that leaves no positive slope. ``None`` if no data."""
        if self.w <= 0 or self.sx == 0:
            return None
        den = self.w * self.sxx - self.sx * self.sx  # w² · variance of x
        if den > 1e-9 * self.w * self.sxx and den >= self.min_spread * self.min_spread * self.sx * self.sx:
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


#: ``OnlinePlane`` separates the attention term only when 1 − ρ² of its two regressors (their weighted correlation)
#: reaches this: prefills that all have the same shape (one length, no cached prefix) cannot tell the two rates apart.
MIN_PLANE_SPREAD = 0.01
#: A fitted attention scale outside these bounds is taken for noise (a handful of noisy samples, e.g. the start-up
#: probe's) and the one-slope line prices the replica instead.
ATTN_SCALE_BOUNDS = (0.01, 100.0)


class OnlinePlane:
    """Exponentially weighted relative least squares (each sample weighs 1/y², as ``OnlineLine(relative=True)``) for
    ``y ≈ a + b₁·x₁ + b₂·x₂``: a prefill's seconds from its matrix-product FLOPs (x₁) and its attention FLOPs (x₂).

    It rejects nothing itself: ``MfuEstimator`` feeds it the samples its line accepted. ``fit`` answers only when the
    two regressors are told apart (``MIN_PLANE_SPREAD``) and the fit is physical (a ≥ 0, both slopes > 0; a negative
    intercept is refitted at 0); else None and the caller keeps the one-slope line."""

    __slots__ = ("decay", "min_obs", "n", "s")

    def __init__(self, *, halflife: float = 50.0, min_obs: int = 5) -> None:
        if halflife <= 0 or min_obs < 3:
            raise ValueError(f"need halflife > 0 and min_obs >= 3, got {halflife}, {min_obs}")
        self.decay = 0.5 ** (1.0 / halflife)
        self.min_obs = min_obs
        self.n = 0
        # weighted sums: w, x1, x2, x1², x1·x2, x2², y, x1·y, x2·y
        self.s = [0.0] * 9

    def observe(self, x1: float, x2: float, y: float) -> None:
        if not (math.isfinite(x1) and math.isfinite(x2) and y > 0 and math.isfinite(y)):
            raise ValueError(f"observation must be finite with y > 0, got x1={x1} x2={x2} y={y}")
        d, om = self.decay, 1.0 / (y * y)
        for i, v in enumerate((1.0, x1, x2, x1 * x1, x1 * x2, x2 * x2, y, x1 * y, x2 * y)):
            self.s[i] = d * self.s[i] + om * v
        self.n += 1

    def mean(self) -> tuple[float, float]:
        """The samples' weighted mean (x₁, x₂); (0, 0) without samples."""
        w, s1, s2 = self.s[0], self.s[1], self.s[2]
        return (s1 / w, s2 / w) if w > 0 else (0.0, 0.0)

    def fit(self) -> tuple[float, float, float] | None:
        """``(a, b₁, b₂)``, or None (class docstring)."""
        if self.n < self.min_obs:
            return None
        w, s1, s2, s11, s12, s22, sy, s1y, s2y = self.s
        if w <= 0:
            return None
        v11, v22, v12 = s11 * w - s1 * s1, s22 * w - s2 * s2, s12 * w - s1 * s2  # w² · (co)variances
        if v11 <= 0 or v22 <= 0 or 1.0 - v12 * v12 / (v11 * v22) < MIN_PLANE_SPREAD:
            return None
        det = v11 * v22 - v12 * v12
        c1, c2 = s1y * w - s1 * sy, s2y * w - s2 * sy
        b1, b2 = (c1 * v22 - c2 * v12) / det, (c2 * v11 - c1 * v12) / det
        a = (sy - b1 * s1 - b2 * s2) / w
        if a < 0:  # through the origin
            det0 = s11 * s22 - s12 * s12
            if det0 <= 0:
                return None
            a, b1, b2 = 0.0, (s1y * s22 - s2y * s12) / det0, (s2y * s11 - s1y * s12) / det0
        return (a, b1, b2) if b1 > 0 and b2 > 0 else None


#: Fitted MFUs are snapped to a geometric grid of this relative step before anything prices with them: replicas
#: whose fits agree within it share one ``Hardware`` object (``Calibrator.hardware``), and ``cost_based`` prices each
#: hardware object once per request (issue 13, decision latency). 2% is far inside the model's own uncertainty (25%).
MFU_GRID_STEP = 0.02
_LOG_STEP = math.log1p(MFU_GRID_STEP)


def snap_ratio(x: float) -> float:
    """``x`` (> 0) on the grid: the nearest (1 + MFU_GRID_STEP)^k."""
    return math.exp(round(math.log(x) / _LOG_STEP) * _LOG_STEP)


def snap_mfu(mfu: float) -> float:
    """``mfu`` on the grid, at most 1."""
    return min(1.0, snap_ratio(mfu))


class MfuEstimator:
    """MFU of one replica from its prefills: seconds ≈ overhead + FLOPs / (MFU · peak · gpus), and once its prefills
    tell them apart, the attention FLOPs at a rate of their own (``Hardware.attn_scale``, ``OnlinePlane``): seconds
    ≈ overhead + (matrix-product FLOPs + attn_scale · attention FLOPs) / (MFU · peak · gpus).

    Why two rates: one MFU for both terms did not fit vLLM's CPU engine (issue 13). Over the live comparisons of the
    tiny heavy model on a 2-core AVX2 box, its attention cost ~0.3 of what its matrix products cost per FLOP, so the
    one-MFU line priced a FETCH's short suffix over a long cached prefix far too slow (predicted 4.2 s, took 2.4 s)
    and the cold prefills too fast; replayed over those runs' prefills (``bench.calibration_replay``), the median
    relative error of the holders' prefill predictions went 0.13-0.22 → 0.11-0.13 in the three cost_based runs, over
    all prefills 0.12-0.18 → 0.10-0.19 (better in 4 of 8 runs, worse by 0.01 in 2).

    The replica's start-up probe (``probe=True``: cold prefills of five lengths, timed while the other engines may
    be starting too) seeds the fit, so a replica is priced with what its engine measured before it served anything
    (unless a replica of the same hardware is proven already: ``Calibrator._priced_by``). Once ``min_obs`` prefills
    of real requests came, they alone are fitted (``proven``). In a live run (issue 13,
    ``bench/reports/live_overflow_vs_round_robin``) one replica's fixed cost (this line's intercept plus the request
    path) was priced at 0.12-0.19 s on half of its decisions, while its real prefills (0.03-0.29 s) alone fit a line
    through 0-0.004 s. The probe's samples, timed under start-up load, were one source; the request path's cold
    start (``Calibrator.observe_path``, now started from its least first sample) was the other."""

    def __init__(self, hw: Hardware, *, halflife: float = 50.0, min_obs: int = 5, outlier_k: float = 4.0,
                 min_mfu: float = 1e-3) -> None:
        self.base = hw
        self.min_mfu = min_mfu
        # relative least squares (``OnlineLine``): a prediction is judged by its relative error
        self.line = OnlineLine(halflife=halflife, min_obs=min_obs, outlier_k=outlier_k, relative=True)  # probe + real
        self.served = OnlineLine(halflife=halflife, min_obs=min_obs, outlier_k=outlier_k, relative=True)  # real only
        # the same samples (those each line accepted) with the attention term apart
        self.plane = OnlinePlane(halflife=halflife, min_obs=min_obs)
        self.served_plane = OnlinePlane(halflife=halflife, min_obs=min_obs)
        self._hw = hw

    def observe(self, tokens: int, cached_tokens: int, seconds: float, *, probe: bool = False) -> bool:
        """One finished prefill of ``tokens`` prompt tokens of which ``cached_tokens`` were reused (``probe``: one
        of the start-up probe's)."""
        if seconds <= 0:
            raise ValueError(f"prefill seconds must be positive, got {seconds}")
        linear, attention = prefill_terms(self.base.model, tokens, cached_tokens)
        flops = linear + attention
        if flops <= 0:
            return False
        if self.served.ready:  # the real prefills price the replica now: the seeded line is not read again
            if probe:
                return False
            return self._feed(self.served, self.served_plane, linear, flops, seconds)
        accepted = self._feed(self.line, self.plane, linear, flops, seconds)
        if not probe:
            self._feed(self.served, self.served_plane, linear, flops, seconds)
        return accepted

    @staticmethod
    def _feed(line: OnlineLine, plane: OnlinePlane, linear: float, flops: float, seconds: float) -> bool:
        if not line.observe(flops, seconds):
            return False
        plane.observe(linear, flops - linear, seconds)
        return True

    @property
    def ready(self) -> bool:
        return self.line.ready or self.served.ready

    @property
    def proven(self) -> bool:
        """Whether ``min_obs`` real prefills price the replica (its probe no longer does)."""
        return self.served.ready

    def fit(self) -> tuple[float, float] | None:
        """The fitted (overhead s, s per FLOP) line, both terms alike: of the real prefills once there are enough,
        else of every sample."""
        if self.served.ready:
            return self.served.fit()
        return self.line.fit() if self.line.ready else None

    def priced(self) -> tuple[float, float, float] | None:
        """What prices the replica: (overhead s, s per matrix-product FLOP, attn_scale), from the plane of the same
        samples as ``fit`` when it tells the two terms apart (and the scale is within ``ATTN_SCALE_BOUNDS``), else
        from ``fit`` with attn_scale 1; None until fitted."""
        if self.served.ready or self.line.ready:
            split = (self.served_plane if self.served.ready else self.plane).fit()
            if split is not None and ATTN_SCALE_BOUNDS[0] <= split[2] / split[1] <= ATTN_SCALE_BOUNDS[1]:
                return split[0], split[1], split[2] / split[1]
        fit = self.fit()
        return None if fit is None else (fit[0], fit[1], 1.0)

    def predict(self, linear: float, attention: float) -> float | None:
        """Seconds of a prefill of these matrix-product and attention FLOPs, as ``priced`` says (None: unfitted)."""
        p = self.priced()
        return None if p is None else p[0] + p[1] * (linear + p[2] * attention)

    @property
    def mfu(self) -> float:
        p = self.priced()
        if p is None:
            return self.base.mfu
        peak = self.base.gpu.bf16_tflops * TERA * self.base.gpus
        return min(1.0, max(self.min_mfu, 1.0 / (p[1] * peak)))

    @property
    def attn_scale(self) -> float:
        p = self.priced()
        return 1.0 if p is None else p[2]

    @property
    def overhead_s(self) -> float:
        p = self.priced()
        return 0.0 if p is None else p[0]

    def hardware(self) -> Hardware:
        """The base hardware with the fitted MFU snapped to the grid (``snap_mfu``; the base itself until fitted),
        the same object while the snapped values do not move. A replica measured faster than its profile's peak
        (the profile is a placeholder, e.g. ``cpu-2core``, or wrong) gets the profile's peak raised to what it
        sustains, at MFU 1: capping the MFU at 1 would keep every prediction for it too slow. ``attn_scale`` is
        snapped to the same grid."""
        p = self.priced()
        if p is None:
            return self.base
        gpu = self.base.gpu
        ratio = max(self.min_mfu, 1.0 / (p[1] * gpu.bf16_tflops * TERA * self.base.gpus))
        if ratio <= 1.0:
            mfu, tflops = snap_mfu(ratio), gpu.bf16_tflops
        else:
            mfu, tflops = 1.0, gpu.bf16_tflops * snap_ratio(ratio)
        attn_scale = 1.0 if p[2] == 1.0 else snap_ratio(p[2])
        cur = self._hw
        if mfu != cur.mfu or tflops != cur.gpu.bf16_tflops or attn_scale != cur.attn_scale:
            if tflops != gpu.bf16_tflops:
                gpu = gpu.model_copy(update={
                    "bf16_tflops": tflops,
                    "description": f"{gpu.description} (peak raised to the {tflops:.3g} TFLOPS measured)".strip()})
            self._hw = dataclasses.replace(self.base, gpu=gpu, mfu=mfu, attn_scale=attn_scale)
        return self._hw


def _speed(est: MfuEstimator) -> float:
    """The FLOP rate ``est``'s fit prices its replica at (peak × MFU)."""
    hw = est.hardware()
    return hw.gpu.bf16_tflops * hw.mfu


def _speed_ratio(est: MfuEstimator, other: MfuEstimator) -> float:
    """``est``'s fit's seconds over ``other``'s for ``est``'s own prefills (at their weighted mean FLOPs): > 1 when
    ``est`` is the slower; 1 when either cannot say."""
    if est.served_plane.n == 0:
        return 1.0
    point = est.served_plane.mean()
    mine, theirs = est.predict(*point), other.predict(*point)
    return mine / theirs if mine is not None and theirs is not None and theirs > 0 else 1.0


def _median_speed(fleet: list[MfuEstimator]) -> MfuEstimator:
    """The median estimator of ``fleet`` by fitted speed (peak × MFU)."""
    return sorted(fleet, key=_speed)[len(fleet) // 2]


class TierEstimator:
    """Bandwidth and latency of one tier class from transfers: seconds ≈ latency + bytes / (BW_util · BW).

    A transfer reported with its read alone (``read_s``; the rest of its seconds is its wait before the read: the
    lookup's and the lease's round trips and the engine step they end in) is fitted in two parts: the line over the
    reads gives the bandwidth and the read's own latency, and the median of the last ``WAIT_WINDOW`` waits is added
    to that latency. The waits do not grow with the bytes, but a line over whole seconds took them for bytes when
    the longer waits fell on the larger fetches (live: 4-5 MB fetches priced at 0.2-1.4 s, "0.0 GB/s", whose whole
    TTFT was 0.5-2.4 s; issue 13). A transfer without its read (None) is fitted whole, as before."""

    WAIT_WINDOW = 64

    def __init__(self, tier: TierSpec, *, bw_util: float, halflife: float = 50.0, min_obs: int = 5,
                 outlier_k: float = 4.0) -> None:
        if not 0 < bw_util <= 1:
            raise ValueError(f"bw_util must be in (0, 1], got {bw_util}")
        self.base = tier
        self.bw_util = bw_util
        # Fetches of similar sizes cannot separate latency from bandwidth: then the configured latency stands.
        self.line = OnlineLine(halflife=halflife, min_obs=min_obs, outlier_k=outlier_k,
                               fallback_intercept=tier.latency_s)
        self._waits: deque[float] = deque(maxlen=self.WAIT_WINDOW)
        self._tier = tier

    def observe(self, nbytes: float, seconds: float, read_s: float | None = None) -> bool:
        """One transfer: ``seconds`` end to end, ``read_s`` the read alone within them (None: not reported)."""
        if nbytes <= 0 or seconds <= 0:
            raise ValueError(f"transfer bytes and seconds must be positive, got {nbytes}, {seconds}")
        if read_s is None:
            return self.line.observe(nbytes, seconds)
        if not 0 < read_s <= seconds:
            raise ValueError(f"a transfer's read takes (0, {seconds}] of its seconds, got {read_s}")
        self._waits.append(seconds - read_s)
        return self.line.observe(nbytes, read_s)

    @property
    def wait_s(self) -> float:
        """The median of the recent waits before a read (0 without any)."""
        return statistics.median(self._waits) if self._waits else 0.0

    @property
    def effective_bandwidth_bps(self) -> float:
        fit = self.line.fit() if self.line.ready else None
        if fit is None:
            return self.bw_util * self.base.bandwidth_gbps * GB
        return 1.0 / fit[1]

    @property
    def latency_s(self) -> float:
        fit = self.line.fit() if self.line.ready else None
        return self.base.latency_s if fit is None else fit[0] + self.wait_s

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


#: Weights of a new sample in the request path's fixed-seconds EWMA (``Calibrator.observe_path``): a sample below
#: the estimate pulls it down by ``PATH_EWMA_DOWN``, one above it up by ``PATH_EWMA``. The path's seconds are a fixed
#: cost plus waits that only add (a busy event loop, a GC pause, a cold first request), so the estimate leans to the
#: low side of the samples: with samples spread evenly around their median it settles below the median.
PATH_EWMA = 0.2
PATH_EWMA_DOWN = 0.5
#: The estimate starts from the least of the first ``PATH_MIN_OBS`` samples, not their median: an engine's first
#: requests (warm-up, cold caches, a cold ingress) carry seconds of one-off cost (issue 13: a median of cold samples
#: priced the path at 0.19 s while the warm path took 0.03 s). A sample past ``PATH_OUTLIER_X`` times the estimate is
#: clipped to it.
#:
#: The path is the router's, one estimate for every replica: the ingress, the hops and the first chunk's way back
#: cost the same whichever replica serves. Estimated per replica, it was noise that decided: only a chosen replica
#: is measured, so a replica priced on a cold or stalled sample was not chosen again (issue 13: 40 of 42 requests on
#: one replica of two), and between idle replicas a few ms of estimate noise (two replicas' estimates crossed from
#: 0.026 / 0.033 s to 0.036 / 0.034 s within a minute) chose the same replica for every fresh prompt of a burst, from
#: both routers (13 of 16 on one replica of two, the two-router e2e test in CI).
PATH_MIN_OBS = 5
PATH_OUTLIER_X = 4.0
#: ``Calibrator.trust_obs`` defaults to this many times ``min_obs``: a replica's own MFU fit prices it on its own
#: only after that many real prefills; before, not slower than its fleet's (``Calibrator._priced_by``).
TRUST_OBS_X = 4
#: Replicas of one hardware whose fits predict a replica's own prefills within this fraction of each other are priced
#: alike, with their fleet's median fit (``Calibrator._priced_by``): the calibration's own error (issue 13's target:
#: after warm-up the median |predicted - actual| / actual <= 25%, the ``uncertainty`` of ``cost_based``'s pick), so a
#: difference the fits cannot tell from noise does not decide. Priced each by its own fit, two identical CPU replicas
#: fitted 0.111 and 0.1005 MFU; every fresh prompt cost ~1 ms less on the first, so both routers sent it 14-15 of a
#: burst of 16 (``tests/e2e/shared_serve``'s two-router test, probed over 12 bursts). A replica slower or faster than
#: its fleet by more than this is priced by its own fit, once trusted (slower) or proven (faster).
SAME_SPEED_BAND = 0.25


class Calibrator:
    """Per-replica MFU and per-tier-class bandwidth/latency fits for one router.

    What the live router feeds it (``router.live_view``): per request, the engine's own prefill seconds (vLLM's
    scheduled → first token: no queueing, no pool load wait in it) against the prefill's FLOPs — the MFU line, whose
    intercept is the engine's fixed cost of a prefill — and the path's fixed seconds (``observe_path``); per pool
    fetch, bytes and seconds per tier class. Fitting the MFU to whole TTFTs instead put every queue, load wait and
    cold start of the first requests into the intercept (issue 13: 0.1 s of "overhead" on requests whose path took
    0.025 s, all predictions of a tiny model off by ~100%)."""

    def __init__(self, *, bw_util: float, halflife: float = 50.0, min_obs: int = 5, outlier_k: float = 4.0,
                 trust_obs: int | None = None, same_speed_band: float = SAME_SPEED_BAND) -> None:
        """``same_speed_band``: see ``SAME_SPEED_BAND`` (0: every replica trusted or proven faster is priced by its own
        fit)."""
        if same_speed_band < 0:
            raise ValueError(f"same_speed_band must be >= 0, got {same_speed_band}")
        self.bw_util = bw_util
        self.same_speed_band = same_speed_band
        #: real prefills after which a replica's own fit prices it even when its fleet's is faster (``_priced_by``)
        self.trust_obs = TRUST_OBS_X * min_obs if trust_obs is None else trust_obs
        if self.trust_obs < min_obs:
            raise ValueError(f"trust_obs must be >= min_obs ({min_obs}), got {self.trust_obs}")
        self._opts = {"halflife": halflife, "min_obs": min_obs, "outlier_k": outlier_k}
        self._mfu: dict[str, MfuEstimator] = {}
        self._tiers: dict[str, TierEstimator] = {}
        # (id(base), mfu, peak TFLOPS, attn_scale) -> (base, hardware): one object per grid point
        self._shared: dict[tuple[int, float, float, float], tuple[Hardware, Hardware]] = {}
        self._path_s = 0.0  # EWMA of the request path's fixed seconds, every replica's (0 before any sample)
        self._path_n = 0  # samples in it
        # kept until the next observation (``_fleet_medians``): id(base) -> (base, proven, ready)
        self._fleets: dict[int, tuple[Hardware | None, MfuEstimator | None, MfuEstimator | None]] = {}

    def observe_prefill(self, replica_id: str, hw: Hardware, tokens: int, cached_tokens: int, seconds: float, *,
                        probe: bool = False) -> bool:
        """One prefill of ``replica_id`` (``probe``: of its start-up probe, which only seeds the fit; see
        ``MfuEstimator``)."""
        est = self._mfu.get(replica_id)
        if est is None or est.base.model != hw.model or est.base.gpu != hw.gpu or est.base.gpus != hw.gpus:
            est = self._mfu[replica_id] = MfuEstimator(hw, **self._opts)  # type: ignore[arg-type]
        self._fleets.clear()
        return est.observe(tokens, cached_tokens, seconds, probe=probe)

    def observe_transfer(self, tier_class: str, base: TierMap, nbytes: float, seconds: float,
                         read_s: float | None = None) -> bool:
        """A finished fetch from ``tier_class`` (one of ``TIER_CLASSES``, the ``TierMap`` field that priced it):
        ``seconds`` end to end, ``read_s`` its read alone (None: not reported; ``TierEstimator``)."""
        if tier_class not in TIER_CLASSES:
            raise ValueError(f"unknown tier class {tier_class!r}; expected one of {', '.join(TIER_CLASSES)}")
        est = self._tiers.get(tier_class)
        if est is None:
            est = self._tiers[tier_class] = TierEstimator(
                getattr(base, tier_class), bw_util=self.bw_util, **self._opts  # type: ignore[arg-type]
            )
        return est.observe(nbytes, seconds, read_s)

    def fitted(self, replica_id: str) -> bool:
        """Whether the replica has a fit of its own real prefills (``MfuEstimator.proven``; before, its fleet's or
        its probe's prices it, see ``_priced_by``)."""
        est = self._mfu.get(replica_id)
        return est is not None and est.proven

    def trusted(self, replica_id: str) -> bool:
        """Whether the replica has ``trust_obs`` real prefills of its own: its own fit prices it, also when its fleet's
        is faster, unless the fleet's median fits it within ``SAME_SPEED_BAND`` (``_priced_by``)."""
        return self._trusts(self._mfu.get(replica_id))

    def priced_by_own_fit(self, replica_id: str) -> bool:
        """Whether the replica is priced by its own fit (``_priced_by``): a sibling's prefill cannot move its price.
        Otherwise (its fleet's median fits it within ``SAME_SPEED_BAND``, or it is not trusted yet) it must be
        re-priced when its siblings' fits move."""
        est = self._mfu.get(replica_id)
        return est is not None and self._priced_by(replica_id, None) is est

    def _trusts(self, est: MfuEstimator | None) -> bool:
        return est is not None and est.served.n >= self.trust_obs

    def _priced_by(self, replica_id: str, base: Hardware | None) -> MfuEstimator | None:
        """The estimator whose fit prices the replica (None: the configured prior):
        1. its own, once ``trust_obs`` real prefills are fitted, unless its fleet's median proven replica's fit is
           within ``SAME_SPEED_BAND`` of it (then the median's: every such replica is priced alike);
        2. once ``min_obs`` are (``MfuEstimator.proven``), its own when it is faster than its fleet's median proven
           replica by more than ``SAME_SPEED_BAND``, else the median's (the fleet: the same base hardware; ``base``
           None: the replica's own base, else every replica);
        3. before that, the fleet's median proven replica, when one is proven;
        4. else its own probe-seeded line, else the median of its fleet's.
        So a replica is not priced worse than its fleet on fewer than ``trust_obs`` requests of its own. Priced by the
        configured prior, then by its probe (timed under start-up load) or its first cold requests while a sibling
        was proven, it looked slower, so it was never chosen and never proven (issue 13: 42 of 42 requests on one
        replica; in the live sequential runs, 25-27 of 30, the other replica priced on one 0.93 s first request).
        Proven on ``min_obs`` noisy samples (two warm-ups, a 0.74 s cold first turn), it was still priced slower than
        its sibling and got 4 of 30 (``bench/reports/live_agent_sequential``): only a replica that is chosen is
        measured, so until ``trust_obs`` samples it gets the benefit of the doubt, and the sibling's price."""
        est = self._mfu.get(replica_id)
        if base is None and est is not None:
            base = est.base
        proven, ready = self._fleet_medians(base)
        if self._trusts(est):
            same = proven is not None and abs(_speed_ratio(est, proven) - 1.0) <= self.same_speed_band
            return proven if same else est
        if proven is not None:  # its own only when faster than the median by more than the band
            faster = est is not None and est.proven and _speed_ratio(est, proven) < 1.0 - self.same_speed_band
            return est if faster else proven
        if est is not None and est.ready:
            return est
        return ready

    def _fleet_medians(self, base: Hardware | None) -> tuple[MfuEstimator | None, MfuEstimator | None]:
        """The median proven and the median ready estimator (``_median_speed``) of the fleet of ``base`` (None: every
        replica), kept until the next prefill observation. Each observation re-prices every replica not yet trusted
        (``router.live_view``): scanning and sorting the fleet for each, one observation cost ~25 ms of the ingress's
        event loop at 64 replicas of 5-15 prefills each, 0.5 ms with the medians kept."""
        hit = self._fleets.get(id(base))
        if hit is not None and hit[0] is base:
            return hit[1], hit[2]
        fleet = [e for e in self._mfu.values() if base is None or e.base is base]
        proven = [e for e in fleet if e.proven]
        ready = [e for e in fleet if e.ready]
        medians = (_median_speed(proven) if proven else None, _median_speed(ready) if ready else None)
        self._fleets[id(base)] = (base, *medians)
        return medians

    def hardware(self, replica_id: str, hw: Hardware) -> Hardware:
        """``hw`` with the MFU of the fit that prices the replica (``_priced_by``) on the grid; ``hw`` itself while
        nothing is fitted. Replicas of one base hardware whose MFUs snap to the same grid point get the same object."""
        est = self._priced_by(replica_id, hw)
        if est is None:
            return hw
        own = est.hardware()
        key = (id(est.base), own.mfu, own.gpu.bf16_tflops, own.attn_scale)
        shared = self._shared.get(key)
        if shared is None or shared[0] is not est.base:
            if len(self._shared) >= 4096:
                self._shared.clear()
            shared = self._shared[key] = (est.base, own)
        return shared[1]

    def observe_path(self, seconds: float) -> None:
        """One request's fixed path seconds outside the engine's queue and prefill: the ingress, both hops, the
        replica's preparation and the first chunk's way back (TTFT less the engine's queued → first token). One
        estimate for every replica (see ``PATH_MIN_OBS``)."""
        if seconds < 0 or seconds != seconds:
            return
        n, prev = self._path_n, self._path_s
        self._path_n = n + 1
        if n < PATH_MIN_OBS:  # the first samples: their least starts the EWMA
            self._path_s = seconds if n == 0 else min(prev, seconds)
            return
        seconds = min(seconds, PATH_OUTLIER_X * prev)
        weight = PATH_EWMA_DOWN if seconds < prev else PATH_EWMA
        self._path_s = (1 - weight) * prev + weight * seconds

    def overhead_s(self, replica_id: str) -> float:
        """The replica's fixed per-request seconds: the intercept of the fit that prices it (``_priced_by``) plus the
        request path's (``observe_path``, the same for every replica)."""
        est = self._priced_by(replica_id, None)  # the fit ``hardware`` prices it with
        return (0.0 if est is None else max(0.0, est.overhead_s)) + self._path_s

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
        self._fleets.clear()
