"""``round_robin``: the next replica in turn, ignoring prefixes and load (the baseline every router beats).

The rotation starts at a random offset (injected RNG) so that two routers do not march in lock step. The pick
is priced with the cost model (HOLDER if it happens to hold a prefix in HBM — vLLM reuses it anyway — else
RECOMPUTE) so its predictions can be audited like any other policy's.
"""

from __future__ import annotations

import random
from typing import ClassVar

from router.policies.base import ClusterSnapshot, NoReplicasError, Ranking, RouteRequest, RoutingPolicy
from router.policies.pricing import Pricer, TierMap, local_candidate


class RoundRobin(RoutingPolicy):
    name: ClassVar[str] = "round_robin"

    def __init__(self, *, rng: random.Random, tier_map: TierMap | None = None) -> None:
        self._next = rng.randrange(1 << 30)
        self._pricer = Pricer(tier_map)

    def rank(self, request: RouteRequest, cluster: ClusterSnapshot) -> Ranking:
        replicas = cluster.replicas
        if not replicas:
            raise NoReplicasError("round_robin: no replicas")
        i = self._next % len(replicas)
        self._next += 1
        chosen = local_candidate(self._pricer, replicas[i], request)
        return Ranking((chosen,), reason=f"round robin: slot {i} of {len(replicas)} -> {chosen.replica_id}")
