"""Router inputs for policy, index and calibration tests: real ``ReplicaState`` / ``RouteRequest`` /
``ClusterSnapshot`` objects on the reference hardware from configs/, deterministic block keys (stand-ins for
``kvpool.keys`` output: the router never looks inside a key), and a manual clock (``RouterClock``) to inject.

Used by tests/unit/test_policies.py, test_decision.py, test_index.py, test_calibration.py, test_live_calibration.py.
"""

from __future__ import annotations

import functools
import hashlib

from configs import loader
from router.cost import Hardware
from router.kv_admission import KvAdmission
from router.policies.base import ClusterSnapshot, PoolHit, ReplicaState, RouteRequest
from router.policies.pricing import TierMap


@functools.cache
def router_hw(
    model: str = "qwen3-14b", gpu: str = "h100-sxm5-80gb", mfu: float = 0.5, bw_util: float = 0.8, gpus: int = 1
) -> Hardware:
    """Reference hardware (one shared object per argument set, as replicas of one deployment share theirs)."""
    return Hardware(
        model=loader.load_models()[model], gpu=loader.load_gpus()[gpu], mfu=mfu, bw_util=bw_util, gpus=gpus
    )


@functools.cache
def router_tier_map() -> TierMap:
    return TierMap.from_tiers(loader.load_tiers())


def router_keys(n: int, salt: str = "") -> list[bytes]:
    """``n`` deterministic 16-byte chained keys (stand-ins for kvpool.keys output; the router never looks inside)."""
    out: list[bytes] = []
    prev = hashlib.blake2b(b"fake-root" + salt.encode(), digest_size=16).digest()
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(prev)
    return out


def router_request(
    prompt_tokens: int, *, block_size: int = 16, request_id: str = "req-0", salt: str = ""
) -> RouteRequest:
    n = max(prompt_tokens, 0) // block_size
    return RouteRequest(request_id, prompt_tokens, block_size, router_keys(n, salt))


def router_replica(
    replica_id: str,
    node_id: str = "node-0",
    *,
    running: int = 0,
    waiting: int = 0,
    queue_delay_s: float = 0.0,
    hbm_prefix_blocks: int = 0,
    hw: Hardware | None = None,
    kv: KvAdmission | None = None,
) -> ReplicaState:
    return ReplicaState(
        replica_id, node_id, running, waiting, queue_delay_s, hbm_prefix_blocks, hw or router_hw(), kv
    )


def router_cluster(
    n_replicas: int, *, replicas_per_node: int = 1, hits: tuple[PoolHit, ...] = (), **replica_kwargs: object
) -> ClusterSnapshot:
    """``n_replicas`` identical idle replicas ``r0..`` on nodes ``node-0..`` plus the given pool hits."""
    reps = [
        router_replica(f"r{i}", f"node-{i // replicas_per_node}", **replica_kwargs)  # type: ignore[arg-type]
        for i in range(n_replicas)
    ]
    return ClusterSnapshot(reps, hits)


class RouterClock:
    """A manual clock (seconds) for the index, the runner and calibration."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
