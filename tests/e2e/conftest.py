"""Fixtures for the e2e reuse tests: tiny models, a real local Ray cluster with named pool shards, in-process engines.

- ``tiny_models`` (session): the dense and hybrid tiny models under ``<repo>/.kvstack/models`` (built once,
  reused while their generator digest matches).
- ``ray_cluster`` (session): from ``tests/ray_cluster_fixture.py`` (registered in ``tests/conftest.py``) — a head with 0 CPUs and worker
  nodes a, b, c on 127.0.0.3-5 (``cluster.local_cluster.LocalCluster``), UCX on loopback.
- ``pool`` (module): one named ``PoolShard`` per worker node (``kvpool.shard.registry`` names), DRAM + SSD, NIXL.
  The pytest process (an engine in it runs on the head node, which has no shard) saves to shard ``a``.
- ``engines`` (module): an ``EngineSlot`` keeping at most one in-process vLLM engine alive — vLLM holds its KV
  connector in a process global, so two engines in one process would share one connector.
Run under the machine-wide lock:
``flock /tmp/kvstack-heavy.lock timeout 900 .venv/bin/pytest -m reuse_correctness tests/e2e/test_reuse_correctness.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.ray_cluster_fixture import RayCluster

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / ".kvstack" / "models"
TINY: dict[str, tuple[str, str]] = {"dense": ("qwen3", "tiny-qwen3"), "hybrid": ("qwen3-next", "tiny-qwen3-next")}
# one dense tiny block in float32 (4 layers x 128 KiB; bfloat16: half); a hybrid tiny state needs 105 KiB
SLOT_BYTES = 512 * 1024


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, str]:
    from cluster.tiny_models import MARKER_FILE, make_tiny, preset_spec

    out: dict[str, str] = {}
    for kind, (arch, name) in TINY.items():
        path = MODEL_DIR / name
        spec = preset_spec(arch, "tiny")
        marker = path / MARKER_FILE
        stale = marker.exists() and spec.digest() not in marker.read_text()
        make_tiny(spec, path, force=stale)
        out[kind] = str(path)
    return out


@dataclass
class Pool:
    cluster: RayCluster
    handles: dict[str, Any]  # node name -> kvpool.shard.client.ShardHandle
    shard_ids: dict[str, str] = field(default_factory=dict)  # node name -> shard id

    def ref(self, node: str) -> Any:
        from kvpool.connector.config import ShardRef
        from kvpool.shard.registry import shard_actor_name

        h = self.handles[node]
        return ShardRef(h.shard_id, shard_actor_name(h.node_id), h.node_id)

    def client(self, node: str) -> Any:
        return self.handles[node].client(deadline_s=30.0)

    def config(self, *, local: str, nodes: tuple[str, ...] = ("a", "b"), **kw: Any) -> Any:
        """Connector config with explicit shards (the pytest process sits on the head node: no shard of its own)."""
        from kvpool.connector.config import ConnectorConfig

        return ConnectorConfig(shards=[self.ref(n) for n in nodes], local_shard=self.handles[local].shard_id, **kw)

    def leases(self) -> dict[str, int]:
        out = {}
        for node, h in self.handles.items():
            try:
                out[node] = h.client(deadline_s=5.0).stats().leases
            except Exception:  # noqa: BLE001 - a shard a test killed on purpose
                out[node] = -1
        return out


@pytest.fixture(scope="module")
def pool(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    from kvpool.shard.placement import PoolNode, build_pool, stop_shards
    from kvpool.shard.wire import ShardConfig
    from kvpool.store import StoreConfig

    ssd = tmp_path_factory.mktemp("ssd")
    names = {n.node_id: n.name for n in ray_cluster.nodes.values()}

    def config(node: PoolNode) -> ShardConfig:
        name = names[node.node_id]
        # shared_arena: as deployed (app.pool.shared_memory), an engine reaches its own node's shard through
        # shared memory and the others through NIXL
        store = StoreConfig(slot_bytes=SLOT_BYTES, dram_slots=256, ssd_dir=str(ssd / name), ssd_slots=256,
                            shared_arena=True)
        return ShardConfig(shard_id=f"shard-{name}", store=store, backend="nixl")

    handles = build_pool(config, nodes=names, ready_deadline_s=120.0)
    pool = Pool(ray_cluster, {names[h.node_id]: h for h in handles})
    try:
        yield pool
    finally:
        alive = [h for h in handles if pool.leases().get(names[h.node_id], -1) >= 0]
        stop_shards(alive)
        import ray

        for h in handles:
            if h not in alive:
                ray.kill(h.actor, no_restart=True)


class EngineSlot:
    """At most one in-process engine at a time; ``get`` closes the current one when another is asked for."""

    def __init__(self) -> None:
        self.key: Any = None
        self.llm: Any = None

    def get(self, key: Any, spec: Any, connector: Any = None, connector_class: tuple[str, str] | None = None) -> Any:
        from bench.inproc import make_llm, release_engine_globals

        if self.key == key and self.llm is not None:
            return self.llm
        self.close()
        try:
            self.llm = make_llm(spec, connector, connector_class=connector_class)
        except BaseException:
            release_engine_globals()  # a failed start leaves vLLM's process globals set up
            raise
        self.key = key
        return self.llm

    def close(self) -> None:
        from bench.inproc import close_llm

        if self.llm is not None:
            llm, self.llm, self.key = self.llm, None, None
            close_llm(llm)


@pytest.fixture(scope="module")
def engines() -> Iterator[EngineSlot]:
    slot = EngineSlot()
    try:
        yield slot
    finally:
        slot.close()
