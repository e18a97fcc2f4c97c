"""``least_loaded``: power of two choices on load (running + waiting), like Ray Serve's default router.

Samples two distinct replicas with the injected RNG and picks the one with the lower load (then the lower queue
delay). Prefix-blind; the pick is priced with the cost model (HOLDER if it holds a prefix in HBM, else RECOMPUTE).
"""

from __future__ import annotations

import random
from typing import ClassVar

from router.policies.base import ClusterSnapshot, NoReplicasError, Ranking, RouteRequest, RoutingPolicy
from router.policies.pricing import Pricer, TierMap, local_candidate


class LeastLoaded(RoutingPolicy):
    name: ClassVar[str] = "least_loaded"

    def __init__(self, *, rng: random.Random, tier_map: TierMap | None = None) -> None:
        self._rng = rng
        self._pricer = Pricer(tier_map)

    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        replicas = cluster.replicas
        n = len(replicas)
        if n == 0:
            raise NoReplicasError("least_loaded: no replicas")
        if n == 1:
            only = local_candidate(self._pricer, replicas[0], request)
            return Ranking((only,), reason=f"single replica {only.replica_id}")
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = replicas[i], replicas[j]
        if (b.load, b.queue_delay_s) < (a.load, a.queue_delay_s):
            a, b = b, a
        first = local_candidate(self._pricer, a, request)
        second = local_candidate(self._pricer, b, request)
        reason = (
            f"pow2: {a.replica_id} load {a.load} queue {a.queue_delay_s:.4f}s <= "
            f"{b.replica_id} load {b.load} queue {b.queue_delay_s:.4f}s"
        )
        return Ranking((first, second), reason=reason)
