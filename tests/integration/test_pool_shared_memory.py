"""The own node's shard through shared memory, on a real Ray cluster: a shard with a shared arena exports it
(``shm_metadata``), and the connector's peer record (``kvpool.connector.pool.KnownPeers``) moves that shard's
bytes through it — a save (reserve → write → commit with checksums) and a load (lease → read → verify) — while a
shard that does not export is reached through NIXL. Blocks written through shared memory are read back through
NIXL by another node's client: one arena, two paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from kvpool.checksum import slot_checksum
from kvpool.keys import Namespace, block_keys
from kvpool.shard.placement import PoolNode, build_pool, stop_shards
from kvpool.shard.wire import ShardConfig
from kvpool.store import StoreConfig
from kvpool.transfer.nixl import NixlOptions
from tests.ray_cluster_fixture import RayCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SLOT = 64 * 1024
FP = "cd" * 16
DEADLINE_S = 10.0


@ray.remote(num_cpus=0)
class EngineLike:
    """What a connector worker holds: a buffer registered with ``KnownPeers`` over NIXL (no progress thread) and,
    optionally, the shared-memory endpoint; it saves to and loads from a shard the way the saver and the worker do."""

    def __init__(self, name: str, nbytes: int, shared_memory: bool) -> None:
        from kvpool.connector.pool import KnownPeers
        from kvpool.transfer.nixl import NixlEndpoint
        from kvpool.transfer.shm import ShmEndpoint

        self.arr = np.zeros(nbytes, dtype=np.uint8)
        self.peers = KnownPeers(NixlEndpoint(name, options=NixlOptions(ucx_devices="lo", progress_thread=False)),
                                ShmEndpoint(f"{name}-shm") if shared_memory else None)
        self.region = self.peers.register(memoryview(self.arr))

    def save(self, handle: Any, shard_id: str, keys: list[bytes], data: bytes) -> tuple[str, list[bytes]]:
        from kvpool.shard.client import ShardClient
        from kvpool.transfer import BlockOp

        client = ShardClient(handle, shard_id, deadline_s=DEADLINE_S)
        self.arr[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        rep = client.reserve(len(keys))
        self.peers.ensure(rep.agent_name, rep.epoch, client.transfer_metadata, lambda: client.shm_metadata())
        ep = self.peers.endpoint_for(rep.agent_name)
        offsets = rep.reservation.offsets
        ops = [BlockOp(rep.region_id, off, self.region, i * SLOT, SLOT) for i, off in enumerate(offsets)]
        assert ep.write(rep.agent_name, ops, DEADLINE_S).all_ok
        sums = [slot_checksum([self.arr[i * SLOT:(i + 1) * SLOT]], SLOT) for i in range(len(keys))]
        commit = client.commit(rep.reservation.reservation_id, keys, sums, FP, epoch=rep.epoch)
        return ep.backend, list(commit.committed)

    def load(self, handle: Any, shard_id: str, keys: list[bytes], same_host: bool) -> tuple[str, bytes]:
        from kvpool.shard.client import ShardClient
        from kvpool.transfer import BlockOp

        client = ShardClient(handle, shard_id, deadline_s=DEADLINE_S)
        rep = client.lease(keys, FP, ttl_s=30.0)
        blocks = rep.lease.blocks
        assert len(blocks) == len(keys)
        try:
            self.peers.ensure(rep.agent_name, rep.epoch, client.transfer_metadata,
                              (lambda: client.shm_metadata()) if same_host else None)
            ep = self.peers.endpoint_for(rep.agent_name)
            ops = [BlockOp(rep.region_id, b.offset, self.region, i * SLOT, SLOT) for i, b in enumerate(blocks)]
            self.arr[:] = 0
            assert ep.read(rep.agent_name, ops, DEADLINE_S).all_ok
            for i, b in enumerate(blocks):
                assert slot_checksum([self.arr[i * SLOT:(i + 1) * SLOT]], SLOT) == b.checksum
            return ep.backend, self.arr[: len(keys) * SLOT].tobytes()
        finally:
            client.release(rep.lease.lease_id)

    def close(self) -> None:
        self.peers.close()


@pytest.fixture(scope="module")
def shards(ray_cluster: RayCluster) -> Iterator[dict[str, Any]]:
    """Node a's shard exports its arena; node c's does not."""

    def config(node: PoolNode) -> ShardConfig:
        name = ray_cluster.by_ip(node.node_ip).name
        store = StoreConfig(slot_bytes=SLOT, dram_slots=16, shared_arena=name == "a")
        return ShardConfig(shard_id=f"shm-{name}", store=store, backend="nixl", nixl=NixlOptions(ucx_devices="lo"))

    handles = build_pool(config, named=False, ready_deadline_s=120.0)
    by_node = {ray_cluster.by_ip(h.node_ip).name: h for h in handles}
    yield by_node
    stop_shards(handles)


def test_the_own_nodes_shard_is_saved_to_and_loaded_from_through_shared_memory(
        ray_cluster: RayCluster, shards: dict[str, Any]) -> None:
    a, c = shards["a"], shards["c"]
    keys = block_keys(Namespace("shm-it", FP), list(range(4 * 8)), 8)
    data = np.random.default_rng(3).integers(0, 256, 4 * SLOT, dtype=np.uint8).tobytes()
    engine = EngineLike.options(scheduling_strategy=ray_cluster.affinity("a")).remote("engine-a", 8 * SLOT, True)
    other = EngineLike.options(scheduling_strategy=ray_cluster.affinity("b")).remote("engine-b", 8 * SLOT, True)
    try:
        backend, committed = ray.get(engine.save.remote(a.actor, a.shard_id, keys, data), timeout=120)
        assert backend == "shm" and len(committed) == 4  # the shard verified the checksums of what shm wrote
        backend, got = ray.get(engine.load.remote(a.actor, a.shard_id, keys, True), timeout=120)
        assert backend == "shm" and got == data
        # Another node's client reads the same slots of the same arena through NIXL.
        backend, got = ray.get(other.load.remote(a.actor, a.shard_id, keys, False), timeout=120)
        assert backend == "nixl" and got == data
        # A shard that does not export is refused by the shared-memory endpoint: NIXL it is, and the data is right.
        backend, committed = ray.get(engine.save.remote(c.actor, c.shard_id, keys, data), timeout=120)
        assert backend == "nixl" and len(committed) == 4
        backend, got = ray.get(engine.load.remote(c.actor, c.shard_id, keys, True), timeout=120)
        assert backend == "nixl" and got == data
    finally:
        for actor in (engine, other):
            ray.get(actor.close.remote(), timeout=30)
            ray.kill(actor)
