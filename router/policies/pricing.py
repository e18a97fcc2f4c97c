"""Fast pricing for the routing hot path: ``router.cost``'s formulas with per-hardware constants precomputed.

Who calls what: the policies in ``router/policies/`` build one ``Pricer`` at construction (with the ``TierMap``
the entrypoint parsed from ``configs``) and price candidates through it; the simulator and the ingress build the
``TierMap`` once (``TierMap.from_tiers(configs.load_tiers())``) and pass it to ``make_policy``. The per-action
candidates at the end (``local_candidate``, ``fetch_candidate``, ``split_candidate``) are the formulas below for one
replica and hit; the simple policies rank with them and ``cost_based.price_replica`` (its readable reference) is
built from them.

Why not call ``router.cost`` directly: ``cost.ttft`` re-derives model and GPU constants on every call and
``cost.ttft_split`` bisects 48 times; a decision over 64 replicas has a budget of ~100 µs. Here each replica
costs a few float operations. The formulas are the same (``tests/unit/test_policies.py`` checks every function
against its ``router.cost`` counterpart):

    prefill(P, c)  = lin·(P − c) + quad·(P² − c²)           lin = 2N/F, quad = 4·n_q·d·L_attn/F, F = MFU·peak·gpus
    fetch(n)       = latency + (n·kv_bytes_per_token + state_bytes) / (BW_util·BW_tier)      (n > 0, else 0)
    HOLDER         = queue + prefill(P, hbm)
    FETCH          = queue + shard_queue + fetch(pool − hbm) + prefill(P, pool)   (only the part beyond HBM moves)
    RECOMPUTE      = queue + prefill(P, 0)
    SPLIT          = queue + max(prefill(h, hbm), shard_queue + fetch(pool − h)) + prefill(P, pool)
                     (the ideal overlap; as the replicas run it, staged, the tail is pulled to the replica's node
                     while the head computes and then loaded: + fetch_local(pool − h); ``HwCoeffs.split``)

SPLIT's meeting point ``h`` (head compute == tail fetch) is the positive root of a quadratic (the closed form of
``cost.split_point``'s bisection, generalised to a replica that already holds ``hbm`` tokens), then rounded to a
block boundary because a fetch plan moves whole blocks. The two solvers (``solve_overlap``, ``solve_staged``) are
plain functions of floats: where the process opted into numba (``kvpool.keys.enable_jit``, the router's ingress)
``HwCoeffs`` calls them compiled (``router.policies.split_jit``), elsewhere as they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from configs.schema import TierSpec
from kvpool import keys
from router.cost import GB, TERA, Hardware, kv_bytes_per_token
from router.policies.base import Action, Candidate, FetchPlan, PoolHit, ReplicaState, RouteRequest, StorageTier

log = logging.getLogger(__name__)

# Tier classes: index into HwCoeffs.lat / HwCoeffs.spb.
DRAM_LOCAL, DRAM_REMOTE, SSD_LOCAL, SSD_REMOTE = 0, 1, 2, 3
REMOTE_CLASSES = (DRAM_REMOTE, SSD_REMOTE)  # a shard on another node than the replica's


@dataclass(frozen=True, slots=True)
class TierMap:
    """Which ``TierSpec`` prices a fetch from a pool storage tier, by whether the shard shares the replica's node."""

    dram_local: TierSpec
    dram_remote: TierSpec
    ssd_local: TierSpec
    ssd_remote: TierSpec

    @classmethod
    def from_tiers(
        cls,
        tiers: Mapping[str, TierSpec],
        *,
        dram_local: str = "cpu-dram",
        dram_remote: str = "rdma-pool",
        ssd_local: str = "local-ssd",
        ssd_remote: str | None = None,
    ) -> TierMap:
        """Map the reference tiers: DRAM same node → cpu-dram, DRAM other node → rdma-pool, SSD same node →
        local-ssd, SSD other node → the slower (lower bandwidth) of local-ssd and rdma-pool unless named."""

        def get(name: str) -> TierSpec:
            try:
                return tiers[name]
            except KeyError:
                raise KeyError(f"tier {name!r} not in the tier specs; known: {', '.join(sorted(tiers))}") from None

        if ssd_remote is None:
            a, b = get(ssd_local), get(dram_remote)
            remote_ssd = min((a, b), key=lambda t: (t.bandwidth_gbps, -t.latency_s))
        else:
            remote_ssd = get(ssd_remote)
        return cls(get(dram_local), get(dram_remote), get(ssd_local), remote_ssd)

    def tier(self, storage: StorageTier, same_node: bool) -> TierSpec:
        return self.by_class(tier_class(storage, same_node))

    def by_class(self, cls_index: int) -> TierSpec:
        return (self.dram_local, self.dram_remote, self.ssd_local, self.ssd_remote)[cls_index]


def tier_class(storage: StorageTier, same_node: bool) -> int:
    if storage == "dram":
        return DRAM_LOCAL if same_node else DRAM_REMOTE
    if storage == "ssd":
        return SSD_LOCAL if same_node else SSD_REMOTE
    raise ValueError(f"unknown storage tier {storage!r}; expected 'dram' or 'ssd'")


class HwCoeffs:
    """Per-hardware constants of the cost model (seconds per token, bytes per token, per tier class)."""

    __slots__ = ("kvb", "lat", "lin", "quad", "solve_overlap", "solve_staged", "spb", "state", "tails", "tiers")

    def __init__(self, hw: Hardware, tier_map: TierMap | None) -> None:
        model = hw.model
        if not 0 < hw.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {hw.mfu}")
        if not 0 < hw.bw_util <= 1:
            raise ValueError(f"bw_util must be in (0, 1], got {hw.bw_util}")
        if hw.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {hw.gpus}")
        flops = hw.mfu * hw.gpu.bf16_tflops * TERA * hw.gpus
        self.lin = 2.0 * model.params / flops
        self.quad = hw.attn_scale * 4.0 * model.n_q * model.head_dim * model.full_attention_layers / flops
        self.kvb = float(kv_bytes_per_token(model))
        self.state = float(model.linear_state_bytes())
        self.tiers = tier_map
        if tier_map is None:
            self.lat: tuple[float, ...] = ()
            self.spb: tuple[float, ...] = ()
        else:
            specs = (tier_map.dram_local, tier_map.dram_remote, tier_map.ssd_local, tier_map.ssd_remote)
            self.lat = tuple(t.latency_s for t in specs)
            self.spb = tuple(1.0 / (hw.bw_util * t.bandwidth_gbps * GB) for t in specs)
        # ``split_tail`` without a shard queue (the common case), per (staged, tier class): made once per hardware
        self.tails: tuple[tuple[SplitTail, ...], ...] = (
            tuple(self._split_tail(c, 0.0, False) for c in range(len(self.lat))),
            tuple(self._split_tail(c, 0.0, True) for c in range(len(self.lat))),
        )
        self.solve_overlap, self.solve_staged = _split_solvers()

    def prefill(self, tokens: float, cached: float) -> float:
        return self.lin * (tokens - cached) + self.quad * (tokens * tokens - cached * cached)

    def fetch(self, cls_index: int, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        return self.lat[cls_index] + (tokens * self.kvb + self.state) * self.spb[cls_index]

    def split_tail(self, cls_index: int, extra_latency_s: float, staged: bool = True) -> SplitTail:
        """How the tail of a SPLIT from a hit of tier class ``cls_index`` (shard queue ``extra_latency_s``) arrives:
        the one place that turns a hit into the solvers' tier arguments (``split``, ``router.policies.cost_based``).

        Staged (``staged``; as the replicas run it, ``deployments.split_staging``): the replica computes the head
        [hbm, k·bs) as a request of its own while its node's shard pulls the tail [k·bs, prefix) from the hit's shard
        (a hit of another node: class ``cls_index`` with the shard queue; a hit on the replica's node has nothing to
        pull), then the request loads the tail from the node's shard (``DRAM_LOCAL`` after a pull, else the hit's
        own class with the shard queue) on top of the cached head. Not staged: the ideal overlap of computing the
        head while fetching the tail from the hit (class ``cls_index`` with the shard queue)."""
        if extra_latency_s == 0.0:
            return self.tails[staged][cls_index]
        return self._split_tail(cls_index, extra_latency_s, staged)

    def _split_tail(self, cls_index: int, extra_latency_s: float, staged: bool) -> SplitTail:
        lat, spb, state = self.lat, self.spb, self.state
        if not staged:
            l_lat, l_spb = lat[cls_index] + extra_latency_s, spb[cls_index]
            return SplitTail(False, False, 0.0, 0.0, l_lat, l_spb, l_lat + state * l_spb)
        if cls_index in REMOTE_CLASSES:  # pulled to the replica's node shard, then loaded from it
            p_lat, p_spb = lat[cls_index] + extra_latency_s, spb[cls_index]
            l_lat, l_spb = lat[DRAM_LOCAL], spb[DRAM_LOCAL]
            # the solver's total at least (its additions in its order; each rounds monotonically): max(head, pull)
            # + load, with the pull and the load of the state bytes alone
            return SplitTail(True, True, p_lat, p_spb, l_lat, l_spb, p_lat + state * p_spb + l_lat + state * l_spb)
        l_lat, l_spb = lat[cls_index] + extra_latency_s, spb[cls_index]
        return SplitTail(True, False, 0.0, 0.0, l_lat, l_spb, l_lat + state * l_spb)

    def solve_split(self, tail: SplitTail, hbm_tokens: float, prefix_tokens: float, block_size: int
                    ) -> tuple[int, float]:
        """The best block boundary and the SPLIT's cost without the suffix prefill (``solve_staged`` or
        ``solve_overlap`` as ``tail`` says); (-1, 0.0) when no interior boundary exists."""
        if tail.staged:
            return self.solve_staged(self.lin, self.quad, self.kvb, self.state, tail.p_lat, tail.p_spb, tail.l_lat,
                                     tail.l_spb, tail.pull, hbm_tokens, prefix_tokens, block_size)
        return self.solve_overlap(self.lin, self.quad, self.kvb, self.state, tail.l_lat, tail.l_spb, hbm_tokens,
                                  prefix_tokens, block_size)

    def split(
        self, cls_index: int, hbm_tokens: float, prefix_tokens: float, block_size: int, extra_latency_s: float, *,
        staged: bool = True,
    ) -> tuple[int, float] | None:
        """SPLIT of a hit of tier class ``cls_index`` for a replica holding ``hbm_tokens``: the best block boundary
        ``k`` (in blocks; the head [hbm, k·bs) is computed, the tail [k·bs, prefix) arrives as ``split_tail`` says)
        and its cost without the suffix prefill; ``None`` when no interior boundary (between FETCH at k = hbm/bs and
        no fetch at k = prefix/bs) exists."""
        k, total = self.solve_split(self.split_tail(cls_index, extra_latency_s, staged), float(hbm_tokens),
                                    float(prefix_tokens), block_size)
        return (k, total) if k >= 0 else None


class SplitTail(NamedTuple):
    """The tier terms of a SPLIT's tail, as the solvers take them (``HwCoeffs.split_tail``)."""

    staged: bool  # solve_staged (the head, then the load) or solve_overlap (the ideal overlap)
    pull: bool  # staged: the tail is pulled to the replica's node shard first, overlapping the head
    p_lat: float  # the pull's latency (the hit's shard queue in it); 0 without a pull
    p_spb: float  # the pull's seconds per byte; 0 without a pull
    l_lat: float  # the load's latency (overlap: the fetch's), the shard queue in it where it reads the hit's shard
    l_spb: float  # the load's (overlap: the fetch's) seconds per byte
    floor: float  # the least the tail adds to a SPLIT's cost: its fixed parts (latencies, the state's bytes)


# ---- the SPLIT solvers: plain functions of floats, so numba can compile them as they are (``_split_solvers``) ------

def meeting_point(lin: float, quad: float, kvb: float, state: float, lat: float, spb: float, h0: float,
                  c: float) -> float:
    """Tokens t where computing [h0, t) takes as long as fetching [t, c) at (lat, spb): the positive root of
    lin·(t − h0) + quad·(t² − h0²) = lat + ((c − t)·kvb + state)·spb."""
    b = lin + kvb * spb
    cc = lin * h0 + quad * h0 * h0 + lat + (c * kvb + state) * spb
    return 2.0 * cc / (b + math.sqrt(b * b + 4.0 * quad * cc)) if b > 0 else c


def solve_overlap(lin: float, quad: float, kvb: float, state: float, lat: float, spb: float, h0: float, c: float,
                  block_size: int) -> tuple[int, float]:
    """``HwCoeffs.split`` unstaged: the ideal overlap of computing [h0, t) and fetching [t, c) (latency ``lat``, the
    hit's shard queue included), at the block boundary next to the meeting point that overlaps best. Returns
    (k, overlap), k = -1 when neither boundary around the meeting point is interior (k0 < k < k_end)."""
    h = meeting_point(lin, quad, kvb, state, lat, spb, h0, c)
    k0 = int(h0) // block_size
    k_end = int(c) // block_size
    k = int(h // block_size)
    hh = h0 * h0
    best_k, best = -1, 0.0
    # The two block boundaries around h (k0: that is FETCH; k_end: no fetch, that is HOLDER/RECOMPUTE).
    for kk in (k, k + 1):
        if k0 < kk < k_end:
            t = kk * block_size
            head = lin * (t - h0) + quad * (t * t - hh)
            tail = lat + ((c - t) * kvb + state) * spb
            overlap = head if head > tail else tail
            if best_k < 0 or overlap < best:
                best_k, best = kk, overlap
    return best_k, best


def solve_staged(lin: float, quad: float, kvb: float, state: float, p_lat: float, p_spb: float, l_lat: float,
                 l_spb: float, pull: bool, h0: float, c: float, block_size: int) -> tuple[int, float]:
    """``HwCoeffs.split`` staged: with the tail pulled at (p_lat, p_spb) when ``pull`` and then loaded at
    (l_lat, l_spb),

        f(t) = max(H(t), T(t)) + R(t)      H = prefill(t, h0), T = pull of the tail, R = load of the tail

    (without a pull: f = H + R, the head computed and the tail loaded one after the other). For t below the
    meeting point t* of H and T, f = T + R falls; above it f = H + R is convex with its minimum where
    H'(t) = −R'(t), i.e. t_m = (kvb·l_spb − lin) / (2·quad). The best t is max(t*, t_m); f is unimodal, so the best
    interior block boundary is one of the two around it (clamped to the interior). Returns (k, f) without the
    suffix prefill, k = -1 when no interior boundary exists."""
    k0 = int(h0) // block_size
    k_end = int(c) // block_size
    if k_end - k0 < 2:
        return -1, 0.0
    meet = meeting_point(lin, quad, kvb, state, p_lat, p_spb, h0, c) if pull else h0
    if quad > 0:
        t_m = (kvb * l_spb - lin) / (2.0 * quad)
    else:
        t_m = c if kvb * l_spb > lin else h0
    hh = h0 * h0
    # f falls up to t* and is convex after it: unimodal, so the best block boundary is next to the optimum.
    t_opt = meet if meet > t_m else t_m
    k = int(t_opt // block_size)
    k = k0 + 1 if k <= k0 else k_end - 1 if k >= k_end else k  # interior (k + 1 too, unless it is k_end)
    best_k, best = -1, 0.0
    for kk in (k, k + 1):
        if kk >= k_end:
            break
        t = kk * block_size
        tail_bytes = (c - t) * kvb + state
        head = lin * (t - h0) + quad * (t * t - hh)
        pulled = p_lat + tail_bytes * p_spb if pull else 0.0
        total = (head if head > pulled else pulled) + l_lat + tail_bytes * l_spb
        if best_k < 0 or total < best:
            best_k, best = kk, total
    return best_k, best


def _split_solvers() -> tuple[Any, Any]:
    """(``solve_overlap``, ``solve_staged``) as ``HwCoeffs`` calls them: numba-compiled (``router.policies.split_jit``,
    ~3x faster: a decision solves a few SPLITs) in a process that opted into numba with ``kvpool.keys.enable_jit``
    (the router's ingress; never a vLLM engine process, see ``kvpool.keys``), these Python functions elsewhere and
    where compiling fails (logged once). Both give the same floats (``tests/unit/test_split_jit.py``)."""
    global _compiled_solvers
    if not keys.use_jit:
        return solve_overlap, solve_staged
    if _compiled_solvers is None:
        try:
            from router.policies import split_jit

            _compiled_solvers = split_jit.compile_solvers(meeting_point, solve_overlap, solve_staged)
        except Exception as exc:  # numba missing or failing to compile: the Python solvers, for good
            log.warning("router.policies.pricing: numba SPLIT solvers unavailable (%r); solving in Python", exc)
            _compiled_solvers = (solve_overlap, solve_staged)
    return _compiled_solvers


_compiled_solvers: tuple[Any, Any] | None = None


def warm_up() -> bool:
    """Compile the SPLIT solvers now (process start, ~0.4 s) where this process opted into numba, so no decision
    pays it; True if decisions will use the compiled ones."""
    return _split_solvers()[0] is not solve_overlap


class Pricer:
    """Caches ``HwCoeffs`` per ``Hardware`` object (by identity: replicas of one deployment share the object)."""

    __slots__ = ("_cache", "tier_map")

    MAX_CACHED = 4096

    def __init__(self, tier_map: TierMap | None = None) -> None:
        self.tier_map = tier_map
        self._cache: dict[int, tuple[Hardware, HwCoeffs]] = {}

    def set_tier_map(self, tier_map: TierMap) -> bool:
        """Price with ``tier_map`` from now on (calibrated tiers); False if it equals the current one."""
        if tier_map == self.tier_map:
            return False
        self.tier_map = tier_map
        self._cache.clear()
        return True

    def coeffs(self, hw: Hardware) -> HwCoeffs:
        entry = self._cache.get(id(hw))
        if entry is not None and entry[0] is hw:
            return entry[1]
        if len(self._cache) >= self.MAX_CACHED:
            self._cache.clear()
        co = HwCoeffs(hw, self.tier_map)
        self._cache[id(hw)] = (hw, co)
        return co

    def require_tiers(self, policy: str) -> TierMap:
        if self.tier_map is None:
            raise ValueError(
                f"policy {policy!r} prices pool fetches and needs a tier_map (router.policies.pricing.TierMap)"
            )
        return self.tier_map


def clamp_blocks(blocks: int, request: RouteRequest) -> int:
    """A prefix can be no longer than the request's full blocks (nor negative)."""
    limit = min(len(request.block_keys), max(request.prompt_tokens, 0) // request.block_size)
    return max(0, min(blocks, limit))


def local_candidate(pricer: Pricer, replica: ReplicaState, request: RouteRequest) -> Candidate:
    """HOLDER when the replica holds a prefix in HBM, else RECOMPUTE, priced on that replica."""
    co = pricer.coeffs(replica.hw)
    prompt = float(max(request.prompt_tokens, 0))
    cached = clamp_blocks(replica.hbm_prefix_blocks, request) * request.block_size
    if cached > 0:
        return Candidate(Action.HOLDER, replica.replica_id, replica.queue_delay_s + co.prefill(prompt, cached), cached)
    return Candidate(Action.RECOMPUTE, replica.replica_id, replica.queue_delay_s + co.prefill(prompt, 0.0), 0)


def beyond_hbm(replica: ReplicaState, hit: PoolHit, request: RouteRequest) -> tuple[int, int] | None:
    """The blocks ``[hbm, end)`` of ``hit``'s prefix the replica does not hold in HBM (both clamped to the request's
    full blocks); ``None`` when the hit adds nothing to the replica's own prefix. FETCH and SPLIT move only these."""
    hbm = clamp_blocks(replica.hbm_prefix_blocks, request)
    end = clamp_blocks(hit.prefix_blocks, request)
    return (hbm, end) if end > hbm else None


def fetch_candidate(pricer: Pricer, replica: ReplicaState, hit: PoolHit, request: RouteRequest) -> Candidate | None:
    """FETCH of ``hit``'s prefix beyond the replica's own HBM prefix; ``None`` if the hit adds nothing."""
    span = beyond_hbm(replica, hit, request)
    if span is None:
        return None
    hbm, end = span
    bs = request.block_size
    co = pricer.coeffs(replica.hw)
    cls_index = tier_class(hit.tier, hit.node_id == replica.node_id)
    prompt = float(max(request.prompt_tokens, 0))
    t = (
        replica.queue_delay_s
        + hit.queue_delay_s
        + co.fetch(cls_index, (end - hbm) * bs)
        + co.prefill(prompt, end * bs)
    )
    plan = FetchPlan(hit.shard_id, hit.node_id, hit.tier, hbm, end)
    return Candidate(Action.FETCH, replica.replica_id, t, end * bs, plan)


def split_candidate(
    pricer: Pricer, replica: ReplicaState, hit: PoolHit, request: RouteRequest, *, staged: bool = True
) -> Candidate | None:
    """SPLIT of ``hit``'s prefix on the replica: compute the head [hbm, k) while the tail [k, prefix) arrives, at the
    best block boundary k (``HwCoeffs.split``: staged as the replicas run it, pulled to the replica's node shard
    and loaded, or the ideal overlap); ``None`` when no interior boundary exists."""
    span = beyond_hbm(replica, hit, request)
    if span is None:
        return None
    hbm, end = span
    bs = request.block_size
    co = pricer.coeffs(replica.hw)
    s = co.split(tier_class(hit.tier, hit.node_id == replica.node_id), hbm * bs, end * bs, bs, hit.queue_delay_s,
                 staged=staged)
    if s is None:
        return None
    k, overlap = s
    prompt = float(max(request.prompt_tokens, 0))
    t = replica.queue_delay_s + overlap + co.prefill(prompt, end * bs)
    plan = FetchPlan(hit.shard_id, hit.node_id, hit.tier, k, end)
    return Candidate(Action.SPLIT, replica.replica_id, t, hbm * bs + (end - k) * bs, plan)
