"""``prefix_affinity``: the replica with the longest prefix in HBM, with a load-imbalance guard (SGLang/Dynamo).

    holder = argmax hbm_prefix_blocks        (ties: lower load, then random)
    if holder.load − min_load > abs_threshold and holder.load > rel_threshold · min_load → least loaded
    if no replica holds a prefix                                                           → least loaded
Least loaded = minimum load (running + waiting), ties random (injected RNG). Pool-blind: never fetches.
"""

from __future__ import annotations

import random
from typing import ClassVar

from router.policies.base import (
    ClusterSnapshot,
    NoReplicasError,
    Ranking,
    ReplicaState,
    RouteRequest,
    RoutingPolicy,
)
from router.policies.pricing import Pricer, TierMap, clamp_blocks, local_candidate


class PrefixAffinity(RoutingPolicy):
    name: ClassVar[str] = "prefix_affinity"

    def __init__(
        self,
        *,
        rng: random.Random,
        tier_map: TierMap | None = None,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError(
                f"need balance_abs_threshold >= 0 and balance_rel_threshold >= 1, got "
                f"{balance_abs_threshold}, {balance_rel_threshold}"
            )
        self._rng = rng
        self._pricer = Pricer(tier_map)
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold

    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        replicas = cluster.replicas
        if not replicas:
            raise NoReplicasError("prefix_affinity: no replicas")
        best_prefix = -1
        holders: list[ReplicaState] = []
        min_load = replicas[0].load
        for r in replicas:
            p = clamp_blocks(r.hbm_prefix_blocks, request)
            if p > best_prefix:
                best_prefix, holders = p, [r]
            elif p == best_prefix:
                holders.append(r)
            if r.load < min_load:
                min_load = r.load
        least = self._pick_least([r for r in replicas if r.load == min_load])
        if best_prefix <= 0:
            c = local_candidate(self._pricer, least, request)
            return Ranking((c,), reason=f"no HBM prefix: least loaded {least.replica_id} (load {least.load})")
        hl = min(r.load for r in holders)
        holder = self._pick_least([r for r in holders if r.load == hl])
        imbalance = holder.load - min_load
        if imbalance > self.abs_threshold and holder.load > self.rel_threshold * min_load:
            chosen = local_candidate(self._pricer, least, request)
            alt = local_candidate(self._pricer, holder, request)
            reason = (
                f"imbalance guard: holder {holder.replica_id} ({best_prefix} blocks) load {holder.load} − min "
                f"{min_load} = {imbalance} > {self.abs_threshold} and > {self.rel_threshold}×min -> "
                f"least loaded {least.replica_id}"
            )
            return Ranking((chosen, alt), reason=reason)
        chosen = local_candidate(self._pricer, holder, request)
        reason = f"longest HBM prefix: {holder.replica_id} {best_prefix} blocks, load {holder.load} (min {min_load})"
        return Ranking((chosen,), reason=reason)

    def _pick_least(self, tied: list[ReplicaState]) -> ReplicaState:
        return tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
