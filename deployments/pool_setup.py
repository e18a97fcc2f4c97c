"""Start the KV pool: one named ``PoolShard`` per worker node, sized from the app config.

Who calls it: ``kvstack serve`` after the cluster is up (and the k8s head's startup hook via the same function).
Shard names come from ``kvpool.shard_registry`` so connectors and routers find them by node. The slot size is one
KV block of the model's layout (all full-attention layers of ``block_size`` tokens, plus the linear-state page for
hybrids), derived from the model's config.json; the connector refuses a pool whose slot size does not match the
layout it registered.
"""

from __future__ import annotations

from pathlib import Path

from deployments.app_config import AppConfig
from kvpool.shard import ShardConfig, ShardHandle, start_shards
from kvpool.shard_registry import SHARD_NAMESPACE, shard_actor_name
from kvpool.store import StoreConfig


def block_slot_bytes(cfg: AppConfig) -> int:
    from deployments.engine_settings import kv_bytes_per_token_from_model

    per_token = cfg.engine.kv_bytes_per_token or kv_bytes_per_token_from_model(cfg.engine.model_path)
    return per_token * cfg.engine.block_size


def start_pool(cfg: AppConfig, *, ready_deadline_s: float = 120.0) -> list[ShardHandle]:
    pool = cfg.pool
    slot = block_slot_bytes(cfg)
    dram_slots = max(1, pool.dram_bytes // slot)
    ssd_slots = pool.ssd_bytes // slot if pool.ssd_dir else 0

    def config_for(node_id: str, node_ip: str) -> ShardConfig:
        ssd_dir = str(Path(pool.ssd_dir).resolve() / node_id[:12]) if ssd_slots else ""
        return ShardConfig(
            shard_id=node_id[:12],
            store=StoreConfig(slot_bytes=slot, dram_slots=dram_slots, ssd_dir=ssd_dir, ssd_slots=ssd_slots),
            backend=pool.transfer_backend,
            metrics_port=pool.metrics_port or 0,
        )

    return start_shards(
        config_for,
        actor_name=shard_actor_name,
        namespace=SHARD_NAMESPACE,
        ready_deadline_s=ready_deadline_s,
    )
