"""``cost_based``: price HOLDER / FETCH / RECOMPUTE / SPLIT on every replica with the cost model; take the minimum,
unless it does not beat the best HBM holder by more than the model's own uncertainty (the pick, below).

For replica r (queue q_r, HBM prefix h_r blocks) and a request of P tokens (block size bs), with pool hits x
(shard, storage tier, prefix p_x blocks, shard queue q_x) priced on tier T = TierMap.tier(x.tier, same node?):
(q_r includes the replica's KV admission wait when its KV cache cannot take the request now: the time until its
running requests free the blocks of P less the leading blocks they hold themselves; ``router.kv_admission``)

    RECOMPUTE  = q_r + prefill(P, 0)
    HOLDER     = q_r + prefill(P, h_r·bs)                                                   (h_r > 0)
    FETCH(x)   = q_r + q_x + lat_T + ((p_x − h_r)·bs·kv_bytes + state)/(BW_util·BW_T) + prefill(P, p_x·bs)
    SPLIT(x,k) = q_r + max(prefill(k·bs, h_r·bs), q_x + fetch((p_x − k)·bs)) + prefill(P, p_x·bs)
                 (compute the head while the tail arrives; k = the block where the two meet)
                 With ``split_staging`` (default; what the replicas run: vLLM loads only leading prefixes) the tail
                 is pulled to the replica's node shard while the head computes, then loaded on top of the cached
                 head: + fetch_local((p_x − k)·bs), and k moves to where that sum is least
                 (``HwCoeffs.split_tail``; a hit on the replica's own node has no pull: head, then load).

Only the part of a pool prefix beyond the replica's own HBM prefix is fetched. Per replica only the useful hits are
priced: the hits on its own node and, per storage tier, the cheapest hit on another node (all remote hits of one
storage tier share T, so their order does not depend on the replica). Replicas without an HBM prefix and without a
hit on their node share their hardware group's precomputed best, so they cost one addition: O(R + H log H) per
request. SPLIT is priced on each of those fetch options and counts only when it beats the replica's best plain
action (HOLDER / FETCH / RECOMPUTE) by ``split_min_gain`` (default 15%: overlapping compute with a transfer has
costs the model does not see and needs engine support, so a near-tie goes to the plain action). The formulas are
``router.cost``'s (see ``router.policies.pricing``).

Where each line lives: ``price_replica`` is the formula above written out for one replica, one candidate per
action and hit (``pricing.local_candidate`` / ``fetch_candidate`` / ``split_candidate``: one place per formula);
it is the reference. ``rank`` gets the same numbers faster: ``_Group`` prices each hit once per request and
hardware (``FetchOption``: its FETCH cost for a replica without an HBM prefix), and ``_Group.options`` (the tight
loop, tested against ``price_replica``) turns those into the actions of one (HBM prefix, node) as ``ActionPlan``s
(what ``_candidate`` turns into a ``Candidate``): FETCH(x) at h_r is the option's cost less the HBM part it need
not move (``h_r·bs·kv_bytes/(BW_util·BW_T)``), SPLITs that cannot beat the gain even with their fixed costs are
skipped unsolved.

Ranking: the cheapest replicas (each with its best action) within ``w(best)`` of the best, ``w(t) = max(window_abs_s,
window_rel · t)``, at most ``max_candidates`` (the runner's tie window must be narrower), plus the best candidate of
every other action (the audit's alternatives), best first. Exact ties are ordered from a random rotation (injected
RNG) and ``tie_break`` lets the runner pick among near-ties, so several routers do not herd onto one replica.

The pick (``hold_back``, shared by ``rank`` and the reference test): leaving the HBM holder must pay for the
model's own uncertainty. With H the cheapest HOLDER candidate (TTFT t_H on replica r_H, queue q_H) and ε =
``uncertainty``, any other candidate c (FETCH, SPLIT, or RECOMPUTE elsewhere) is chosen only if

    t_c < t_H − max(ε · (t_H − q_H·[r_c = r_H]),  w(t_H))

(on the holder's own replica the queue is the same in both predictions, so only the work is uncertain). Otherwise c
is held back: it stays in the ranking (the audit's alternatives) after the choosable candidates, which the runner's
tie-break may not pass (``Ranking.choosable``). So a near-tie (within the window) goes to the HOLDER, which moves no
bytes, and a FETCH that reuses fewer tokens than the holder wins only when the holder's queue makes it cheaper by
more than ε. ε defaults to 0.25: the calibration's target (issue 13: after warm-up the median |predicted − actual| /
actual of the chosen action must be <= 25%), i.e. the error the model admits in a typical prediction; a FETCH also
carries costs the model does not price yet (lease and lookup round trips). ε = 0 keeps only the near-tie rule.
Without any HOLDER candidate (no replica holds a prefix) nothing is held back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import itemgetter
from typing import ClassVar, NamedTuple

from router.cost import GB
from router.kv_admission import KvAdmission, admission_waits
from router.policies.base import (
    Action,
    Candidate,
    ClusterSnapshot,
    FetchPlan,
    NoReplicasError,
    PoolHit,
    Ranking,
    ReplicaColumns,
    ReplicaState,
    RouteRequest,
    RoutingPolicy,
)
from router.policies.pricing import (
    DRAM_LOCAL,
    DRAM_REMOTE,
    SSD_LOCAL,
    SSD_REMOTE,
    HwCoeffs,
    Pricer,
    SplitTail,
    TierMap,
    beyond_hbm,
    clamp_blocks,
    fetch_candidate,
    local_candidate,
    split_candidate,
    tier_class,
)

#: The note a held-back candidate carries (``hold_back``).
HELD_BACK = "held back: does not beat the best holder by the uncertainty margin"
_HOLDER, _FETCH, _RECOMPUTE, _SPLIT = 0, 1, 2, 3  # action codes: index into _ACTIONS (and rank's per-action bests)
_ACTIONS = (Action.HOLDER, Action.FETCH, Action.RECOMPUTE, Action.SPLIT)
_INF = float("inf")
_first = itemgetter(0)


class ActionPlan(NamedTuple):
    """One priced action on a replica, before it becomes a ``Candidate`` (``_candidate``)."""

    action: int  # _HOLDER / _FETCH / _RECOMPUTE / _SPLIT
    hit: int  # index of the pool hit it fetches from in the request's hits; -1: none (HOLDER, RECOMPUTE)
    start: int  # fetch plan: first block moved (FETCH: the replica's HBM prefix; SPLIT: where the head ends)
    end: int  # fetch plan: the block after the last one moved (the hit's prefix)
    reused: int  # tokens the replica does not compute (HBM prefix + fetched blocks)


class FetchOption(NamedTuple):
    """A pool hit priced for one hardware and tier class, for a replica without an HBM prefix."""

    cost: float  # q_x + fetch(p_x·bs) + prefill(P, p_x·bs): FETCH(x) without the replica's queue, at h_r = 0
    hit: int  # index in the request's hits
    prefix_blocks: int  # p_x
    tier_class: int  # DRAM_LOCAL / DRAM_REMOTE / SSD_LOCAL / SSD_REMOTE
    suffix_prefill: float  # prefill(P, p_x·bs): what is left to compute once the prefix is in place
    node_id: str  # the shard's node
    plan: ActionPlan  # FETCH of the whole prefix (a replica without an HBM prefix; made once per hit and request)
    split_tail: SplitTail  # how a SPLIT's tail from it arrives (``HwCoeffs.split_tail``, the shard queue in it)
    split_floor: float  # what a SPLIT from it costs at least: split_tail.floor + suffix_prefill


_RECOMPUTE_PLAN = ActionPlan(_RECOMPUTE, -1, 0, 0, 0)
# The hot path builds ActionPlans / FetchOptions as ``_new(cls, (fields...))``: the same named tuple, without the
# Python-level ``__new__`` a NamedTuple call goes through (a third of the cost; a decision builds dozens).
_new = tuple.__new__
Priced = tuple[float, ActionPlan]  # (cost without the replica's queue, the action)


class _Class:
    """Replicas of one hardware without an HBM prefix on one node: same prices, they differ only by queue."""

    __slots__ = ("acts", "cost", "desc", "min_i", "min_q")

    def __init__(self, acts: list[Priced]) -> None:
        self.acts = acts
        self.cost, self.desc = min(acts, key=_first)
        self.min_q = _INF
        self.min_i = -1


class _Group:
    """Per request and hardware: the constants every replica of that hardware shares."""

    __slots__ = ("_opts", "_splits", "bs", "classes", "co", "fast", "hits", "local", "prompt", "recompute", "remote",
                 "split")

    def __init__(
        self, co: HwCoeffs, prompt: float, bs: int, hits: Sequence[tuple[PoolHit, int]], split: float,
        staged: bool = True,
    ) -> None:
        self.co = co
        self.prompt = prompt
        self.bs = bs
        self.hits = hits
        self.split = split
        self._opts: dict[tuple[int, str], list[Priced]] = {}
        self._splits: dict[tuple[int, int, int], tuple[int, float]] = {}  # (k, cost); k = -1: none
        self.recompute = co.prefill(prompt, 0.0)
        remote: tuple[list[FetchOption], list[FetchOption]] = ([], [])  # priced from another node: DRAM, SSD
        local: dict[str, list[FetchOption]] = {}  # node -> the hits on it, priced for a replica on that node
        # ``HwCoeffs.prefill`` / ``fetch`` written out (the same operations; c > 0): a decision prices every hit.
        lin, quad, kvb, state, lat, spb = co.lin, co.quad, co.kvb, co.state, co.lat, co.spb
        pp = prompt * prompt
        zero_queue = co.tails[staged]  # ``co.split_tail`` of a hit without a shard queue (most), looked up
        for hi, (hit, p) in enumerate(hits):
            c = p * bs
            pre = lin * (prompt - c) + quad * (pp - c * c)
            base = hit.queue_delay_s + pre
            moved = c * kvb + state
            dram = hit.tier == "dram"
            rc, lc = (DRAM_REMOTE, DRAM_LOCAL) if dram else (SSD_REMOTE, SSD_LOCAL)
            plan = _new(ActionPlan, (_FETCH, hi, 0, p, c))
            node = hit.node_id
            extra = hit.queue_delay_s
            tail = zero_queue[rc] if extra == 0.0 else co.split_tail(rc, extra, staged)
            remote[0 if dram else 1].append(_new(FetchOption, (
                base + (lat[rc] + moved * spb[rc]), hi, p, rc, pre, node, plan, tail, tail.floor + pre)))
            on_node = local.get(node)
            if on_node is None:
                on_node = local[node] = []
            tail = zero_queue[lc] if extra == 0.0 else co.split_tail(lc, extra, staged)
            on_node.append(_new(FetchOption, (
                base + (lat[lc] + moved * spb[lc]), hi, p, lc, pre, node, plan, tail, tail.floor + pre)))
        remote[0].sort()
        remote[1].sort()
        self.remote = remote
        self.local = local
        self.fast = _Class(self.options(0, ""))  # no HBM prefix, no hit on the node: every hit is remote
        self.classes: dict[str, _Class] = {}

    def node_class(self, node: str) -> _Class:
        c = self.classes.get(node)
        if c is None:
            c = self.classes[node] = _Class(self.options(0, node)) if node in self.local else self.fast
        return c

    def priced(self, hb: int, node: str) -> list[Priced]:
        """``options(hb, node)``, computed once per (prefix, node with a pool hit): replicas holding the same HBM
        prefix (a shared system prompt) share it. A node without a hit prices as ``""`` (every hit is remote)."""
        key = (hb, node if node in self.local else "")
        out = self._opts.get(key)
        if out is None:
            out = self._opts[key] = self.options(*key)
        return out

    def options(self, hb: int, node: str) -> list[Priced]:
        """Every priced action (without the replica's queue) for a replica holding ``hb`` blocks on ``node``: the
        tight loop of ``price_replica`` (same actions, same numbers up to float rounding; tested against it)."""
        co, bs = self.co, self.bs
        hbt = hb * bs
        out: list[Priced] = [(self.recompute, _RECOMPUTE_PLAN)]
        best = self.recompute
        if hb > 0:
            t = co.prefill(self.prompt, hbt)
            out.append((t, _new(ActionPlan, (_HOLDER, -1, 0, 0, hbt))))
            best = t if t < best else best
        # The useful hits: those on the replica's node, and per storage tier the cheapest on another node.
        here = self.local.get(node)
        opts = [e for e in here if e.prefix_blocks > hb] if here else []
        for lst in self.remote:
            for e in lst:
                if e.prefix_blocks > hb and e.node_id != node:
                    opts.append(e)
                    break
        kvb, spb = co.kvb, co.spb
        for e in opts:
            if hb:
                t = e.cost - hbt * kvb * spb[e.tier_class]  # the HBM prefix is not moved
                out.append((t, _new(ActionPlan, (_FETCH, e.hit, hb, e.prefix_blocks, e.prefix_blocks * bs))))
            else:
                t = e.cost
                out.append((t, e.plan))
            best = t if t < best else best
        if self.split and opts:
            limit = self.split * best
            splits = self._splits
            hbf = float(hbt)
            for e in opts:
                if e.split_floor > limit:  # cannot beat the limit even so: left unsolved (floor <= cost in floats)
                    continue
                key = (e.hit, e.tier_class, hbt)
                s = splits.get(key)
                if s is None:
                    s = splits[key] = co.solve_split(e.split_tail, hbf, float(e.prefix_blocks * bs), bs)
                if s[0] >= 0 and s[1] + e.suffix_prefill <= limit:
                    k = s[0]
                    plan = _new(ActionPlan, (_SPLIT, e.hit, k, e.prefix_blocks, hbt + (e.prefix_blocks - k) * bs))
                    out.append((s[1] + e.suffix_prefill, plan))
        return out


def price_replica(
    pricer: Pricer, replica: ReplicaState, request: RouteRequest, hits: Sequence[PoolHit], *,
    split_min_gain: float | None, split_staging: bool = True,
) -> list[Candidate]:
    """The module docstring's formulas for one replica, written out: RECOMPUTE, HOLDER (with an HBM prefix), FETCH
    from each useful hit (on the replica's node; per storage tier the cheapest on another node), and SPLIT on each
    of those when it beats the best plain action by ``split_min_gain`` (None: no SPLIT). The reference
    ``_Group.options`` is tested against; ``rank`` does not call it."""
    co = pricer.coeffs(replica.hw)
    q = replica.queue_delay_s
    prompt = float(max(request.prompt_tokens, 0))
    hbm = clamp_blocks(replica.hbm_prefix_blocks, request)
    out = [Candidate(Action.RECOMPUTE, replica.replica_id, q + co.prefill(prompt, 0.0), 0)]
    if hbm > 0:
        out.append(local_candidate(pricer, replica, request))
    useful = [h for h in hits if h.node_id == replica.node_id and beyond_hbm(replica, h, request) is not None]
    for storage in ("dram", "ssd"):
        remote = [(c.predicted_ttft_s, i, h) for i, h in enumerate(hits)
                  if h.tier == storage and h.node_id != replica.node_id
                  for c in [fetch_candidate(pricer, replica, h, request)] if c is not None]
        if remote:
            useful.append(min(remote, key=lambda e: (e[0], e[1]))[2])
    fetches = [c for h in useful for c in [fetch_candidate(pricer, replica, h, request)] if c is not None]
    out += fetches
    if split_min_gain is not None and fetches:
        best_plain = min(c.predicted_ttft_s for c in out) - q
        for h in useful:
            c = split_candidate(pricer, replica, h, request, staged=split_staging)
            if c is not None and c.predicted_ttft_s - q <= (1.0 - split_min_gain) * best_plain:
                out.append(c)
    return out


def hold_back(
    cands: Sequence[Candidate], queue_s: Mapping[str, float], *, uncertainty: float, window_abs_s: float,
    window_rel: float,
) -> tuple[list[Candidate], int]:
    """The pick step (module docstring): ``cands`` best-first by predicted TTFT, ``queue_s`` the queue of every
    replica with a HOLDER candidate. Returns the candidates reordered, choosable first (HOLDERs and the actions that
    beat the best HOLDER by the margin, best-first: the first is the decision), then the held-back ones (best-first,
    noted ``HELD_BACK``), and the number of choosable ones."""
    for h in cands:
        if h.action is Action.HOLDER:
            break
    else:
        return list(cands), len(cands)
    th = h.predicted_ttft_s
    near = max(window_abs_s, window_rel * th)
    need_other = th - max(uncertainty * th, near)
    need_same = th - max(uncertainty * (th - queue_s[h.replica_id]), near)
    keep: list[Candidate] = []
    held: list[Candidate] = []
    for c in cands:
        if c.action is Action.HOLDER or c.predicted_ttft_s < (need_same if c.replica_id == h.replica_id
                                                              else need_other):
            keep.append(c)
        else:
            held.append(Candidate(c.action, c.replica_id, c.predicted_ttft_s, c.reused_tokens, c.fetch, HELD_BACK))
    return keep + held, len(keep)


class CostBased(RoutingPolicy):
    name: ClassVar[str] = "cost_based"
    plans_pool_loads: ClassVar[bool] = True
    tie_break: ClassVar[bool] = True

    def __init__(
        self,
        *,
        tier_map: TierMap,
        rng: random.Random | None = None,
        max_candidates: int = 8,
        allow_split: bool = True,
        split_staging: bool = True,
        split_min_gain: float = 0.15,
        window_rel: float = 0.05,
        window_abs_s: float = 0.002,
        uncertainty: float = 0.25,
    ) -> None:
        """``uncertainty``: ε of the pick (module docstring), the relative error of a predicted TTFT that an action
        must beat the best HOLDER by before it is chosen instead (default 0.25, the calibration's target median
        |predicted − actual| / actual); in [0, 1)."""
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        if not 0 <= split_min_gain < 1:
            raise ValueError(f"split_min_gain must be in [0, 1), got {split_min_gain}")
        self._pricer = Pricer(tier_map)
        self._pricer.require_tiers(self.name)
        self._rng = rng
        self.max_candidates = max_candidates
        self.allow_split = allow_split
        self.split_staging = split_staging
        self.split_min_gain = split_min_gain
        if window_rel < 0 or window_abs_s < 0:
            raise ValueError(f"candidate window must be >= 0, got {window_rel}, {window_abs_s}")
        self.window_rel = window_rel
        self.window_abs_s = window_abs_s
        if not 0 <= uncertainty < 1:
            raise ValueError(f"uncertainty must be in [0, 1), got {uncertainty}")
        self.uncertainty = uncertainty

    def update_tier_map(self, tier_map: TierMap) -> bool:
        return self._pricer.set_tier_map(tier_map)

    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        n = len(cluster.replicas)
        if n == 0:
            raise NoReplicasError("cost_based: no replicas")
        bs = request.block_size
        if bs <= 0:
            raise ValueError(f"block_size must be positive, got {bs}")
        prompt = float(max(request.prompt_tokens, 0))
        max_blocks = min(len(request.block_keys), int(prompt) // bs)
        hits: list[tuple[PoolHit, int]] = []
        for h in cluster.pool_hits:
            p = h.prefix_blocks if h.prefix_blocks < max_blocks else max_blocks
            if p > 0:
                hits.append((h, p))
        rs = cluster.replicas
        if not isinstance(rs, (list, tuple)):
            rs = list(rs)
        # The replicas as columns (the live router's, kept by its ReplicaBook; else built here). One _Group per
        # hardware object (keyed by identity: replicas of one deployment share theirs, calibrated ones share one per
        # MFU grid point); per group, one class for the replicas without an HBM prefix and without a pool hit on
        # their node (its fast class: each such replica costs its queue plus the class's precomputed best), one per
        # node with a pool hit.
        cols = cluster.columns if cluster.columns is not None else ReplicaColumns.of(rs)
        qs, nodes, hids, hbs = cols.queues, cols.nodes, cols.hw_ids, cols.hbm
        # KV admission (``router.kv_admission``): a replica whose KV cache cannot take the prompt now adds the wait
        # until its running requests free enough to its queue (need: the whole prompt; a holder's is priced below
        # with the part of its HBM prefix that running requests hold taken off). Replicas that do not report their
        # KV cache wait for nothing. The replicas whose KV cache cannot take the prompt now are found in C (the
        # ``kv_free`` column), and the wait is priced for them alone.
        kvs: list[KvAdmission | None] | None = None
        now = cluster.now
        kv_free = cols.kv_free
        if kv_free and prompt > min(kv_free):
            waits = admission_waits(cols.kv, compress(range(n), map(prompt.__gt__, kv_free)), prompt, now)
            if waits:
                base_qs, kvs, qs = qs, cols.kv, qs[:]
                for i, w in waits:
                    qs[i] += w
        if self._rng is not None and n > 1:
            s = int(self._rng.random() * n)
            if s:
                rs = rs[s:] + rs[:s]
                qs, nodes, hids = qs[s:] + qs[:s], nodes[s:] + nodes[:s], hids[s:] + hids[:s]
                hbs = hbs[s:] + hbs[:s] if max_blocks > 0 else hbs
                if kvs is not None:
                    kvs, base_qs = kvs[s:] + kvs[:s], base_qs[s:] + base_qs[:s]
        split = 1.0 - self.split_min_gain if self.allow_split else 0.0
        pricer = self._pricer

        groups: dict[int, _Group] = {}
        for h in dict.fromkeys(hids):  # the hardware objects in rotated order; each one read from the columns
            groups[h] = _Group(pricer.coeffs(cols.hws[cols.hw_ids.index(h)]), prompt, bs, hits, split,
                               self.split_staging)
        if len(groups) == 1:
            g0 = groups[hids[0]]
            fc = g0.fast.cost
            costs = [q + fc for q in qs]
            cls_list = [g0.fast] * n
        else:
            fasts = {h: g.fast for h, g in groups.items()}
            cls_list = list(map(fasts.__getitem__, hids))
            costs = [q + c.cost for q, c in zip(qs, cls_list)]
        local = next(iter(groups.values())).local  # the nodes with a pool hit (the same for every group)
        on_local = [i for i in range(n) if nodes[i] in local] if local else []
        if max_blocks <= 0:
            hbs = ()
        holders = any(hbs)  # replicas holding a prefix in HBM (hbs[i] > 0) are priced one by one below
        # The node classes' members, and per node class its least-queued member that holds no prefix (the lowest
        # index among equal queues); ``masked``: the queues with every member of a node class masked.
        by_node: dict[_Class, tuple[float, int]] = {}
        masked: list[float] | None = None
        if on_local:
            masked = qs[:]
            for i in on_local:
                c = cls_list[i] = groups[hids[i]].node_class(nodes[i])
                q = qs[i]
                costs[i] = q + c.cost
                masked[i] = _INF
                if holders and hbs[i] > 0:
                    continue
                least = by_node.get(c)
                if least is None or q < least[0]:
                    by_node[c] = (q, i)

        act_cost = [_INF, _INF, _INF, _INF]
        act_at = [-1, -1, -1, -1]
        act_desc: list[ActionPlan] = [_RECOMPUTE_PLAN] * 4
        # Replicas holding a prefix in HBM: priced one by one.
        special: dict[int, ActionPlan] = {}
        if holders:
            for i in compress(range(n), hbs):
                hb = hbs[i]
                if hb <= 0:
                    continue
                q = qs[i]
                if kvs is not None and q != base_qs[i]:  # short of KV for the prompt: the part of its HBM prefix
                    k = kvs[i]                            # that running requests hold needs no new blocks
                    assert k is not None
                    held = k.pinned_blocks(request.block_keys, min(hb, max_blocks))
                    q = qs[i] = base_qs[i] + k.wait_s(prompt - held * bs, now)
                best, bd = _INF, _RECOMPUTE_PLAN
                for t, d in groups[hids[i]].priced(hb if hb < max_blocks else max_blocks, nodes[i]):
                    t += q
                    a = d.action
                    if t < act_cost[a]:
                        act_cost[a], act_at[a], act_desc[a] = t, i, d
                    if t < best:
                        best, bd = t, d
                costs[i] = best
                special[i] = bd
        # The best of every action among the class-priced replicas: each class's least-queued plain member (the
        # lowest index among equal queues, as min() over range(n) would pick). Fast classes: a C min over the
        # queues with every other replica masked; node classes: their few members, one by one.
        if not special and not on_local and len(groups) == 1:
            firsts = [(qs.index(min(qs)), cls_list[0])]
        else:
            if masked is None:
                masked = qs[:]
            for i in special:
                masked[i] = _INF
            firsts = [(i, c) for c, (_, i) in by_node.items()]
            for h, g in groups.items():
                own = masked if len(groups) == 1 else [q if k == h else _INF for q, k in zip(masked, hids)]
                m = min(own)
                if m < _INF:
                    firsts.append((own.index(m), g.fast))
        for i, c in firsts:
            q = qs[i]
            for t, d in c.acts:
                t += q
                a = d.action
                if t < act_cost[a]:
                    act_cost[a], act_at[a], act_desc[a] = t, i, d

        # Candidates: the cheapest replicas within the window of the best (at most max_candidates), then the best
        # of each other action.
        best = min(costs)
        first = costs.index(best)
        limit = best + max(self.window_abs_s, self.window_rel * best)
        costs[first] = _INF
        alone = n == 1 or self.max_candidates == 1 or not min(costs) <= limit  # nobody else in the window (common)
        costs[first] = best
        if alone:
            top = [first]
        else:  # everyone in the window, then a stable sort of those few
            top = [i for i in range(n) if costs[i] <= limit]
            top.sort(key=costs.__getitem__)
            del top[self.max_candidates :]

        def desc(i: int) -> ActionPlan:
            d = special.get(i)
            return d if d is not None else cls_list[i].desc

        entries = [(costs[i], i, desc(i)) for i in top]
        chosen = {(i, d.action) for _, i, d in entries}
        for a in range(4):
            i = act_at[a]
            if i >= 0 and (i, a) not in chosen:
                entries.append((act_cost[a], i, act_desc[a]))
                chosen.add((i, a))
        ih = act_at[_HOLDER]
        if ih >= 0 and (ih, special[ih].action) not in chosen:  # the holder's own best (e.g. a FETCH on top of it)
            entries.append((costs[ih], ih, special[ih]))
        entries.sort(key=_first)
        cands = [_candidate(rs[i], d, t, hits) for t, i, d in entries]
        choosable = len(cands)
        decision = entries[0]
        held: Candidate | None = None  # the cheapest prediction, when it was held back
        if ih >= 0:
            queues = {rs[i].replica_id: qs[i] for _, i, d in entries if d.action == _HOLDER}
            picked, choosable = hold_back(cands, queues, uncertainty=self.uncertainty, window_abs_s=self.window_abs_s,
                                          window_rel=self.window_rel)
            if picked[0] is not cands[0]:
                decision = entries[cands.index(picked[0])]
                held = picked[choosable]
            cands = picked
        t, i, d = decision
        args = (rs[i], d, t, groups[hids[i]], prompt, bs, hits, pricer.require_tiers(self.name), self.split_staging,
                qs[i] - rs[i].queue_delay_s)
        return Ranking(cands, explain=lambda: _with_held_back(_formula(*args), held),  # formatted only when read
                       choosable=choosable)


def _candidate(r: ReplicaState, d: ActionPlan, cost: float, hits: Sequence[tuple[PoolHit, int]]) -> Candidate:
    if d.hit < 0:
        return Candidate(_ACTIONS[d.action], r.replica_id, cost, d.reused)
    h = hits[d.hit][0]
    plan = FetchPlan(h.shard_id, h.node_id, h.tier, d.start, d.end)
    return Candidate(_ACTIONS[d.action], r.replica_id, cost, d.reused, plan)


def _with_held_back(explained: tuple[str, dict[str, float]], held: Candidate | None) -> tuple[str, dict[str, float]]:
    """The chosen candidate's formula with its values, plus the cheaper prediction held back in its favour
    (``hold_back``), if any."""
    text, values = explained
    if held is None:
        return text, values
    values["held_back_ttft_s"] = held.predicted_ttft_s
    return (f"{text}; {held.action} on {held.replica_id} ({held.predicted_ttft_s:.4f}s) held back: it does not beat "
            f"the holder by the uncertainty margin", values)


def _formula(
    r: ReplicaState,
    d: ActionPlan,
    total: float,
    g: _Group,
    prompt: float,
    bs: int,
    hits: Sequence[tuple[PoolHit, int]],
    tiers: TierMap,
    staged: bool,
    kv_wait: float = 0.0,
) -> tuple[str, dict[str, float]]:
    """The chosen candidate's formula with its values (Dynamo-selector style). ``kv_wait``: the KV admission wait
    its queue includes (shown as a term of the queue)."""
    co = g.co
    a, hi, start, end = d.action, d.hit, d.start, d.end
    q = r.queue_delay_s
    queue = f"queue {q:.4f}" + (f" + kv admission {kv_wait:.4f}" if kv_wait > 0 else "")
    kv = {"kv_wait_s": kv_wait} if kv_wait > 0 else {}
    if a == _RECOMPUTE:
        pre = co.prefill(prompt, 0.0)
        return (
            f"recompute on {r.replica_id}: ttft = {queue} + prefill({prompt:.0f} tok) {pre:.4f} = {total:.4f}s",
            {"queue_s": q, **kv, "prefill_s": pre, "ttft_s": total},
        )
    if a == _HOLDER:
        cached = float(d.reused)
        pre = co.prefill(prompt, cached)
        return (
            (
                f"holder {r.replica_id}: ttft = {queue} + prefill({prompt:.0f}−{cached:.0f} cached tok) "
                f"{pre:.4f} = {total:.4f}s"
            ),
            {"queue_s": q, **kv, "prefill_s": pre, "ttft_s": total},
        )
    hit = hits[hi][0]
    same = hit.node_id == r.node_id
    cls_index = tier_class(hit.tier, same)
    tier = tiers.by_class(cls_index)
    c = float(end * bs)
    pre = co.prefill(prompt, c)
    bw = 1.0 / co.spb[cls_index] / GB
    where = f"{hit.shard_id}/{hit.tier} ({tier.name}, {'same' if same else 'other'} node)"
    if a == _FETCH:
        moved = float((end - start) * bs)
        fetch = co.fetch(cls_index, moved)
        mb = (moved * co.kvb + co.state) / 1e6
        return (
            (
                f"fetch blocks [{start},{end}) from {where} onto {r.replica_id}: ttft = {queue} + shard "
                f"queue {hit.queue_delay_s:.4f} + fetch({co.lat[cls_index]:.4f} + {mb:.1f} MB / {bw:.1f} GB/s) "
                f"{fetch:.4f} + prefill({prompt:.0f}−{c:.0f} cached tok) {pre:.4f} = {total:.4f}s"
            ),
            {"queue_s": q, **kv, "shard_queue_s": hit.queue_delay_s, "fetch_s": fetch, "prefill_s": pre,
             "ttft_s": total},
        )
    hbm_tokens = float(d.reused - (end - start) * bs)
    head_end = float(start * bs)
    head = co.prefill(head_end, hbm_tokens)
    tail = co.split_tail(cls_index, hit.queue_delay_s, staged)  # the terms the solver priced it with
    tail_bytes = (c - head_end) * co.kvb + co.state
    arrive = tail.l_lat + tail_bytes * tail.l_spb  # staged: the load from the node's shard; else the fetch
    if staged:
        pull = tail.p_lat + tail_bytes * tail.p_spb if tail.pull else 0.0
        leg = (f"pull blocks [{start},{end}) from {where} to the node's shard {pull:.4f}" if tail.pull
               else f"nothing to pull ({where}) 0")
        return (
            (
                f"split on {r.replica_id}: ttft = {queue} + max(compute [{hbm_tokens:.0f},{head_end:.0f}) "
                f"{head:.4f}, {leg}) + load blocks [{start},{end}) from the node's shard {arrive:.4f} + "
                f"prefill({prompt:.0f}−{c:.0f} cached tok) {pre:.4f} = {total:.4f}s"
            ),
            {"queue_s": q, **kv, "head_s": head, "fetch_s": pull, "load_s": arrive, "prefill_s": pre, "ttft_s": total},
        )
    return (
        (
            f"split on {r.replica_id}: ttft = {queue} + max(compute [{hbm_tokens:.0f},{head_end:.0f}) "
            f"{head:.4f}, shard queue + fetch blocks [{start},{end}) from {where} {arrive:.4f}) + "
            f"prefill({prompt:.0f}−{c:.0f} cached tok) {pre:.4f} = {total:.4f}s"
        ),
        {"queue_s": q, **kv, "head_s": head, "fetch_s": arrive, "prefill_s": pre, "ttft_s": total},
    )
