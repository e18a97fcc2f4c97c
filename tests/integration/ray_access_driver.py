"""A Ray driver in a process of its own for ``test_ray_access``:
``python -m tests.integration.ray_access_driver ADDRESS`` joins the Ray cluster at ADDRESS with this process's
environment (Ray's TLS and token, the cluster secret), starts a pool shard on every worker node, calls each (info,
reserve, lookup: proofs of the cluster secret, over Ray's channels) and prints one JSON line with what it saw. Every
call has a deadline."""

from __future__ import annotations

import json
import sys


def main(address: str) -> None:
    import ray

    from kvpool.shard.placement import PoolNode, build_pool, stop_shards
    from kvpool.shard.wire import ShardConfig
    from kvpool.store import StoreConfig

    ray.init(address=address, log_to_driver=False)
    nodes = sum(1 for n in ray.nodes() if n["Alive"])

    def config(node: PoolNode) -> ShardConfig:
        store = StoreConfig(slot_bytes=64 * 1024, dram_slots=8)
        return ShardConfig(shard_id=f"tls-{node.node_id[:8]}", store=store, backend="tcp")

    handles = build_pool(config, named=False, ready_deadline_s=120.0)
    try:
        seen = []
        for h in handles:
            client = h.client(deadline_s=30.0)
            info = client.info()
            reservation = client.reserve(2)
            found = client.lookup([b"k" * 16], "fingerprint")
            seen.append({"shard": info.shard_id, "reserved": len(reservation.reservation.offsets),
                         "prefix": found.result.prefix})
    finally:
        stop_shards(handles)
    print(json.dumps({"nodes": nodes, "shards": seen}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
