"""Finding pool shards: one named actor per node, ``kvstack-pool-<node id>`` in the ``kvstack`` namespace.

Who calls what: whoever starts the pool (``deployments.pool_setup.start_pool``) names each shard with
``shard_actor_name``; the vLLM connector finds its own node's shard with ``local_shard`` and a remote one with
``shard_by_id``; the router lists them all with ``list_shards`` (status, directory sync). Names make shards
discoverable from any process of the cluster without passing handles around; a restarted shard keeps its name
(and gets a new transfer epoch, so peers re-add it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

SHARD_NAMESPACE = "kvstack"
SHARD_PREFIX = "kvstack-pool-"


def shard_actor_name(node_id: str) -> str:
    return f"{SHARD_PREFIX}{node_id}"


@dataclass(frozen=True)
class ShardRef:
    shard_id: str
    node_id: str
    actor: Any

    async def stats_async(self, deadline_s: float = 5.0) -> dict[str, Any]:
        """Blocks per tier, lease count and the store's counters (hits, evictions, pulls, touches, ...), for
        ``kvstack status``."""
        from kvpool.store import StoreStats

        raw = await asyncio.wait_for(self.actor.stats.remote(), timeout=deadline_s)
        stats = msgspec.msgpack.decode(raw, type=StoreStats)
        return {"dram_blocks": stats.dram.blocks, "ssd_blocks": stats.ssd.blocks, "leases": stats.leases,
                "slot_bytes": stats.slot_bytes, "counters": dict(stats.counters)}


def list_shards(namespace: str = SHARD_NAMESPACE) -> list[ShardRef]:
    """Every live named shard actor of the cluster (the caller must be connected to Ray)."""
    import ray

    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = entry["name"], entry["namespace"]
        if ns != namespace or not name.startswith(SHARD_PREFIX):
            continue
        try:
            actor = ray.get_actor(name, namespace=ns)
        except ValueError:  # died between listing and lookup
            continue
        node_id = name[len(SHARD_PREFIX):]
        out.append(ShardRef(shard_id=node_id[:12], node_id=node_id, actor=actor))
    return out


def local_shard(namespace: str = SHARD_NAMESPACE) -> ShardRef | None:
    """The shard on the caller's node, or None if that node runs none."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(shard_actor_name(node_id), namespace=namespace)
    except ValueError:
        return None
    return ShardRef(shard_id=node_id[:12], node_id=node_id, actor=actor)
