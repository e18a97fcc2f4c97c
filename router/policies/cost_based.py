"""``cost_based``: price HOLDER / FETCH / RECOMPUTE / SPLIT on every replica with the cost model; take the minimum.

For replica r (queue q_r, HBM prefix h_r blocks) and a request of P tokens (block size bs), with pool hits x
(shard, storage tier, prefix p_x blocks, shard queue q_x) priced on tier T = TierMap.tier(x.tier, same node?):

    RECOMPUTE  = q_r + prefill(P, 0)
    HOLDER     = q_r + prefill(P, h_r·bs)                                                   (h_r > 0)
    FETCH(x)   = q_r + q_x + lat_T + ((p_x − h_r)·bs·kv_bytes + state)/(BW_util·BW_T) + prefill(P, p_x·bs)
    SPLIT(x,k) = q_r + max(prefill(k·bs, h_r·bs), q_x + fetch((p_x − k)·bs)) + prefill(P, p_x·bs)
                 (compute the head while the tail arrives; k = the block where the two meet)

Only the part of a pool prefix beyond the replica's own HBM prefix is fetched. Per replica only the useful hits are
priced: the hits on its own node and, per storage tier, the cheapest hit on another node (all remote hits of one
storage tier share T, so their order does not depend on the replica). Replicas without an HBM prefix and without a
hit on their node share their hardware group's precomputed best, so they cost one addition: O(R + H log H) per
request. SPLIT is priced on each of those fetch options and counts only when it beats that FETCH by
``split_min_gain`` (default 10%: overlapping compute with a transfer has costs the model does not see, so a
near-tie goes to the simpler FETCH). The formulas are ``router.cost``'s (see ``router.policies.pricing``).

Ranking: the ``max_candidates`` cheapest replicas (each with its best action), plus the best candidate of every
other action (the audit's alternatives), best first. Exact ties are ordered from a random rotation (injected RNG)
and ``tie_break`` lets the runner pick among near-ties, so several routers do not herd onto one replica.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from operator import attrgetter
from typing import ClassVar

from router.cost import GB
from router.policies.base import (
    Action,
    Candidate,
    ClusterSnapshot,
    FetchPlan,
    NoReplicasError,
    PoolHit,
    Ranking,
    ReplicaState,
    RouteRequest,
    RoutingPolicy,
)
from router.policies.pricing import DRAM_LOCAL, DRAM_REMOTE, SSD_LOCAL, SSD_REMOTE, HwCoeffs, Pricer, TierMap

_HOLDER, _FETCH, _RECOMPUTE, _SPLIT = 0, 1, 2, 3
_ACTIONS = (Action.HOLDER, Action.FETCH, Action.RECOMPUTE, Action.SPLIT)
_INF = float("inf")
_RECOMPUTE_DESC = (_RECOMPUTE, -1, 0, 0, 0)
_by_ttft = attrgetter("predicted_ttft_s")

# desc = (action code, hit index or -1, fetch start block, fetch end block, reused tokens)
Desc = tuple[int, int, int, int, int]
# option = (cost without q_r at h_r = 0, hit index, prefix blocks, tier class, prefill(P, prefix), shard node)
Option = tuple[float, int, int, int, float, str]


class _Group:
    """Per request and hardware: the constants every replica of that hardware shares."""

    __slots__ = ("co", "recompute", "remote", "local", "fast_cost", "fast_desc", "fast_act", "min_q", "min_q_i")

    def __init__(
        self, co: HwCoeffs, prompt: float, bs: int, hits: Sequence[tuple[PoolHit, int]], split: float
    ) -> None:
        self.co = co
        self.recompute = co.prefill(prompt, 0.0)
        remote: tuple[list[Option], list[Option]] = ([], [])
        local: dict[str, list[Option]] = {}
        for hi, (hit, p) in enumerate(hits):
            c = p * bs
            pre = co.prefill(prompt, c)
            base = hit.queue_delay_s + pre
            rc, lc = (DRAM_REMOTE, DRAM_LOCAL) if hit.tier == "dram" else (SSD_REMOTE, SSD_LOCAL)
            remote[0 if hit.tier == "dram" else 1].append((base + co.fetch(rc, c), hi, p, rc, pre, hit.node_id))
            local.setdefault(hit.node_id, []).append((base + co.fetch(lc, c), hi, p, lc, pre, hit.node_id))
        remote[0].sort()
        remote[1].sort()
        self.remote = remote
        self.local = local
        # The fast path: no HBM prefix, no hit on the replica's node -> every hit is remote; best of each kind.
        act: list[float] = [_INF, _INF, self.recompute, _INF]
        descs: list[Desc] = [_RECOMPUTE_DESC] * 4
        for lst in remote:
            if not lst:
                continue
            e = lst[0]
            if e[0] < act[_FETCH]:
                act[_FETCH], descs[_FETCH] = e[0], (_FETCH, e[1], 0, e[2], e[2] * bs)
            if split:
                s = co.split(e[3], hbm_tokens=0, prefix_tokens=e[2] * bs, block_size=bs,
                             extra_latency_s=hits[e[1]][0].queue_delay_s)
                if s is not None and s[1] + e[4] <= split * e[0] and s[1] + e[4] < act[_SPLIT]:
                    act[_SPLIT], descs[_SPLIT] = s[1] + e[4], (_SPLIT, e[1], s[0], e[2], (e[2] - s[0]) * bs)
        best = min(range(4), key=act.__getitem__)
        self.fast_cost = act[best]
        self.fast_desc = descs[best]
        self.fast_act = [(act[a], descs[a]) for a in range(4) if act[a] < _INF]
        self.min_q = _INF
        self.min_q_i = -1


class CostBased(RoutingPolicy):
    name: ClassVar[str] = "cost_based"
    tie_break: ClassVar[bool] = True

    def __init__(
        self,
        *,
        tier_map: TierMap,
        rng: random.Random | None = None,
        max_candidates: int = 8,
        allow_split: bool = True,
        split_min_gain: float = 0.1,
    ) -> None:
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        if not 0 <= split_min_gain < 1:
            raise ValueError(f"split_min_gain must be in [0, 1), got {split_min_gain}")
        self._pricer = Pricer(tier_map)
        self._pricer.require_tiers(self.name)
        self._rng = rng
        self.max_candidates = max_candidates
        self.allow_split = allow_split
        self.split_min_gain = split_min_gain

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
        hit_nodes = {h.node_id for h, _ in hits}
        rs = list(cluster.replicas)
        if self._rng is not None and n > 1:
            s = self._rng.randrange(n)
            rs = rs[s:] + rs[:s]

        split = 1.0 - self.split_min_gain if self.allow_split else 0.0
        pricer = self._pricer
        groups: dict[int, _Group] = {}
        costs = [0.0] * n
        descs: list[Desc] = [_RECOMPUTE_DESC] * n
        act_cost = [_INF, _INF, _INF, _INF]
        act_at = [-1, -1, -1, -1]
        act_desc: list[Desc] = [_RECOMPUTE_DESC] * 4
        last_hw = rs[0].hw
        g = groups[id(last_hw)] = _Group(pricer.coeffs(last_hw), prompt, bs, hits, split)
        for i in range(n):
            r = rs[i]
            hw = r.hw
            if hw is not last_hw:
                g = groups.get(id(hw))
                if g is None:
                    g = groups[id(hw)] = _Group(pricer.coeffs(hw), prompt, bs, hits, split)
                last_hw = hw
            hb = r.hbm_prefix_blocks
            q = r.queue_delay_s
            if hb <= 0 and r.node_id not in hit_nodes:
                costs[i] = q + g.fast_cost
                descs[i] = g.fast_desc
                if q < g.min_q:
                    g.min_q, g.min_q_i = q, i
                continue
            # Slow path: this replica holds a prefix in HBM or shares a node with a hit.
            if hb > max_blocks:
                hb = max_blocks
            co = g.co
            hbt = hb * bs
            best = q + g.recompute
            bd: Desc = _RECOMPUTE_DESC
            if best < act_cost[_RECOMPUTE]:
                act_cost[_RECOMPUTE], act_at[_RECOMPUTE], act_desc[_RECOMPUTE] = best, i, bd
            if hb > 0:
                t = q + co.prefill(prompt, hbt)
                d: Desc = (_HOLDER, -1, 0, 0, hbt)
                if t < act_cost[_HOLDER]:
                    act_cost[_HOLDER], act_at[_HOLDER], act_desc[_HOLDER] = t, i, d
                if t < best:
                    best, bd = t, d
            node = r.node_id
            options: list[Option] = [e for e in g.local.get(node, ()) if e[2] > hb]
            for lst in g.remote:
                for e in lst:
                    if e[2] > hb and e[5] != node:
                        options.append(e)
                        break
            for e in options:
                t = q + e[0] - hbt * co.kvb * co.spb[e[3]]
                d = (_FETCH, e[1], hb, e[2], e[2] * bs)
                if t < act_cost[_FETCH]:
                    act_cost[_FETCH], act_at[_FETCH], act_desc[_FETCH] = t, i, d
                if t < best:
                    best, bd = t, d
                if split:
                    s = co.split(e[3], hbm_tokens=hbt, prefix_tokens=e[2] * bs, block_size=bs,
                                 extra_latency_s=hits[e[1]][0].queue_delay_s)
                    if s is not None and s[1] + e[4] <= split * (t - q):
                        t = q + s[1] + e[4]
                        d = (_SPLIT, e[1], s[0], e[2], hbt + (e[2] - s[0]) * bs)
                        if t < act_cost[_SPLIT]:
                            act_cost[_SPLIT], act_at[_SPLIT], act_desc[_SPLIT] = t, i, d
                        if t < best:
                            best, bd = t, d
            costs[i] = best
            descs[i] = bd
        for g in groups.values():
            if g.min_q_i < 0:
                continue
            for c, d in g.fast_act:
                t = g.min_q + c
                if t < act_cost[d[0]]:
                    act_cost[d[0]], act_at[d[0]], act_desc[d[0]] = t, g.min_q_i, d

        top = sorted(range(n), key=costs.__getitem__)[: self.max_candidates]
        chosen = {(i, descs[i][0]) for i in top}
        cands = [_candidate(rs[i], descs[i], costs[i], hits) for i in top]
        for a in range(4):
            i = act_at[a]
            if i >= 0 and (i, a) not in chosen:
                cands.append(_candidate(rs[i], act_desc[a], act_cost[a], hits))
        cands.sort(key=_by_ttft)
        first = top[0]
        reason, extra = _explain(rs[first], descs[first], costs[first], groups[id(rs[first].hw)], prompt, bs, hits,
                                 pricer.require_tiers(self.name))
        alts = ", ".join(f"{_ACTIONS[a]} {rs[act_at[a]].replica_id} {act_cost[a]:.4f}s" for a in range(4)
                         if act_at[a] >= 0)
        return Ranking(cands, reason=f"{reason}; best per action: {alts}", extra=extra)


def _candidate(r: ReplicaState, d: Desc, cost: float, hits: Sequence[tuple[PoolHit, int]]) -> Candidate:
    a, hi, start, end, reused = d
    if hi < 0:
        return Candidate(_ACTIONS[a], r.replica_id, cost, reused)
    h = hits[hi][0]
    return Candidate(_ACTIONS[a], r.replica_id, cost, reused, FetchPlan(h.shard_id, h.node_id, h.tier, start, end))


def _explain(
    r: ReplicaState,
    d: Desc,
    total: float,
    g: _Group,
    prompt: float,
    bs: int,
    hits: Sequence[tuple[PoolHit, int]],
    tiers: TierMap,
) -> tuple[str, dict[str, float]]:
    """The chosen candidate's formula with its values (Dynamo-selector style)."""
    co = g.co
    a, hi, start, end, _ = d
    q = r.queue_delay_s
    if a == _RECOMPUTE:
        pre = co.prefill(prompt, 0.0)
        return (
            f"recompute on {r.replica_id}: ttft = queue {q:.4f} + prefill({prompt:.0f} tok) {pre:.4f} = {total:.4f}s",
            {"queue_s": q, "prefill_s": pre, "ttft_s": total},
        )
    if a == _HOLDER:
        cached = float(d[4])
        pre = co.prefill(prompt, cached)
        return (
            f"holder {r.replica_id}: ttft = queue {q:.4f} + prefill({prompt:.0f}−{cached:.0f} cached tok) "
            f"{pre:.4f} = {total:.4f}s",
            {"queue_s": q, "prefill_s": pre, "ttft_s": total},
        )
    hit = hits[hi][0]
    same = hit.node_id == r.node_id
    cls_index = (DRAM_LOCAL if same else DRAM_REMOTE) if hit.tier == "dram" else (SSD_LOCAL if same else SSD_REMOTE)
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
            f"fetch blocks [{start},{end}) from {where} onto {r.replica_id}: ttft = queue {q:.4f} + shard queue "
            f"{hit.queue_delay_s:.4f} + fetch({co.lat[cls_index]:.4f} + {mb:.1f} MB / {bw:.1f} GB/s) {fetch:.4f} "
            f"+ prefill({prompt:.0f}−{c:.0f} cached tok) {pre:.4f} = {total:.4f}s",
            {"queue_s": q, "shard_queue_s": hit.queue_delay_s, "fetch_s": fetch, "prefill_s": pre, "ttft_s": total},
        )
    hbm_tokens = float(d[4] - (end - start) * bs)
    head_end = float(start * bs)
    head = co.prefill(head_end, hbm_tokens)
    tail = hit.queue_delay_s + co.fetch(cls_index, c - head_end)
    return (
        f"split on {r.replica_id}: ttft = queue {q:.4f} + max(compute [{hbm_tokens:.0f},{head_end:.0f}) {head:.4f}, "
        f"shard queue + fetch blocks [{start},{end}) from {where} {tail:.4f}) + prefill({prompt:.0f}−{c:.0f} "
        f"cached tok) {pre:.4f} = {total:.4f}s",
        {"queue_s": q, "head_s": head, "fetch_s": tail, "prefill_s": pre, "ttft_s": total},
    )
