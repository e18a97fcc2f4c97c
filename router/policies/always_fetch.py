"""``always_fetch``: the least-loaded replica, fetching the best pool prefix whenever one exists (a baseline).

    replica = min load (ties random)
    hit     = the pool hit with the longest prefix beyond the replica's HBM prefix (ties: the cheaper tier for
              that replica, i.e. same node and DRAM first); FETCH it, else HOLDER / RECOMPUTE.
Shows what a KV pool without a fetch-vs-recompute price does: it moves bytes even when recomputing is faster.
"""

from __future__ import annotations

import random
from typing import ClassVar

from router.policies.base import (
    Candidate,
    ClusterSnapshot,
    FetchPlan,
    NoReplicasError,
    Ranking,
    RouteRequest,
    RoutingPolicy,
)
from router.policies.pricing import Pricer, TierMap, fetch_candidate, local_candidate


class AlwaysFetch(RoutingPolicy):
    name: ClassVar[str] = "always_fetch"
    plans_pool_loads: ClassVar[bool] = True

    def __init__(self, *, rng: random.Random, tier_map: TierMap) -> None:
        self._rng = rng
        self._pricer = Pricer(tier_map)

    def update_tier_map(self, tier_map: TierMap) -> bool:
        return self._pricer.set_tier_map(tier_map)

    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        replicas = cluster.replicas
        if not replicas:
            raise NoReplicasError("always_fetch: no replicas")
        min_load = min(r.load for r in replicas)
        tied = [r for r in replicas if r.load == min_load]
        replica = tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
        best: Candidate | None = None
        best_plan: FetchPlan | None = None
        for hit in cluster.pool_hits:
            c = fetch_candidate(self._pricer, replica, hit, request)
            if c is None or c.fetch is None:
                continue
            if best is None or best_plan is None or (c.fetch.end_block, -c.predicted_ttft_s) > (
                best_plan.end_block,
                -best.predicted_ttft_s,
            ):
                best, best_plan = c, c.fetch
        local = local_candidate(self._pricer, replica, request)
        if best is None or best_plan is None:
            return Ranking((local,), reason=f"no pool prefix beyond HBM: {local.action} on {replica.replica_id}")
        reason = (
            f"fetch {best_plan.blocks} blocks [{best_plan.start_block},{best_plan.end_block}) from "
            f"{best_plan.shard_id}/{best_plan.tier} onto least loaded {replica.replica_id} (load {replica.load})"
        )
        return Ranking((best, local), reason=reason)
