"""Start the KV pool: one named ``PoolShard`` per worker node, sized from the app config.

Who calls it: ``kvstack serve`` after the cluster is up (``start_pool``: every worker node at once) and every replica
before its engine starts (``ensure_local_shard``: its own node; this is how nodes that KubeRay's autoscaler adds get a
shard). Shards are detached named actors: they outlive any one replica and are stopped by whoever tears the pool down
(``kvstack serve`` on exit; on Kubernetes, the node going away). The pool is built by
``kvpool.shard.placement.build_pool`` (named in the default namespace, so connectors and routers find the shards by node
through ``kvpool.shard.registry``); this module only sizes the shards. The slot size is one KV block of the model's
layout (all full-attention layers of ``block_size`` tokens, plus the linear-state page for hybrids), derived from the
model's config.json; the connector refuses a pool whose slot size does not match the layout it registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deployments.app_config import AppConfig, PoolSettings
from deployments.engine_settings import EngineSettings, pool_slot_bytes_from_model
from kvpool.shard.client import ShardHandle
from kvpool.shard.placement import PoolNode, build_pool, default_shard_id
from kvpool.shard.wire import ShardConfig
from kvpool.store import StoreConfig


def block_slot_bytes(engine: EngineSettings) -> int:
    if engine.kv_bytes_per_token is not None:
        return engine.kv_bytes_per_token * engine.block_size
    return pool_slot_bytes_from_model(engine.model_path, engine.block_size, *engine.kv_dtypes())


def shard_config(engines: Sequence[EngineSettings], pool: PoolSettings, node: PoolNode) -> ShardConfig:
    """The shard of ``node``: a DRAM arena of ``pool.dram_bytes``, an SSD slab under ``pool.ssd_dir/<shard id>``,
    slots of the largest block of the app's models (``engines``; the keys of each model are its own namespace)."""
    slot = max(block_slot_bytes(engine) for engine in engines)
    shard_id = default_shard_id(node)
    ssd_slots = pool.ssd_bytes // slot if pool.ssd_dir else 0
    ssd_dir = str(Path(pool.ssd_dir).resolve() / shard_id) if ssd_slots else ""
    return ShardConfig(
        shard_id=shard_id,
        store=StoreConfig(slot_bytes=slot, dram_slots=max(1, pool.dram_bytes // slot), ssd_dir=ssd_dir,
                          ssd_slots=ssd_slots, shared_arena=pool.shared_memory),
        backend=pool.transfer_backend,
        metrics_port=pool.metrics_port or 0,
    )


def start_pool(cfg: AppConfig, *, ready_deadline_s: float = 120.0) -> list[ShardHandle]:
    """One shard per worker node (nodes with CPUs; a 0-CPU head gets none), named for discovery."""
    engines = [m.engine for m in cfg.entries()]
    return build_pool(lambda node: shard_config(engines, cfg.pool, node), detached=True,
                      ready_deadline_s=ready_deadline_s)


def ensure_local_shard(engines: Sequence[EngineSettings], pool: PoolSettings, *, ready_deadline_s: float = 120.0
                       ) -> ShardHandle:
    """The shard of the caller's node, started if this node has none yet (a replica calls this before its engine
    starts, so nodes added later by the autoscaler — KubeRay — get their shard with their first replica)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    (handle,) = build_pool(lambda node: shard_config(engines, pool, node), nodes=[node_id], detached=True,
                           ready_deadline_s=ready_deadline_s)
    return handle
