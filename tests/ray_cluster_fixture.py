"""The shared session fixture ``ray_cluster``: a real local multi-node Ray cluster on this machine.

Registered once, in ``tests/conftest.py``, so integration and e2e tests share ONE cluster per pytest session
(a fixture defined in two conftest files would start a second cluster on the same node IPs while the first lives).

``ray_cluster`` (session scope) is ``cluster.local_cluster.LocalCluster`` — the very bootstrap ``kvstack serve``
uses, with its environment, ports and pitfalls handled there: a head with 0 CPUs on 127.0.0.2 (control plane only,
so nothing lands there by accident) and three worker nodes ``a``, ``b``, ``c`` on 127.0.0.3-5, each with 1 CPU and
a custom resource ``node_a`` / ``node_b`` / ``node_c``. It is stopped with ``shutdown()`` at the end of the session
(own processes only — never ``ray stop``, which would kill other people's clusters), which also puts the pytest
process's environment back.

Run integration tests under the machine-wide lock:
``flock /tmp/kvstack-heavy.lock timeout 900 .venv/bin/pytest -m integration tests/integration``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

NODE_NAMES = ("a", "b", "c")


@dataclass
class NodeInfo:
    name: str  # "a" | "b" | "c"
    ip: str
    node_id: str

    @property
    def resource(self) -> str:
        return f"node_{self.name}"


@dataclass
class RayCluster:
    local: Any  # cluster.local_cluster.LocalCluster
    nodes: dict[str, NodeInfo] = field(default_factory=dict)

    def by_ip(self, ip: str) -> NodeInfo:
        return next(n for n in self.nodes.values() if n.ip == ip)

    def affinity(self, name: str) -> Any:
        """Hard node-affinity scheduling strategy for the named worker node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id=self.nodes[name].node_id, soft=False)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    from cluster.local_cluster import LocalCluster

    local = LocalCluster(workers=len(NODE_NAMES), cpus_per_worker=1, worker_names=NODE_NAMES,
                         object_store_bytes=80 * 1024 * 1024, namespace=None)
    try:
        local.start()
        yield RayCluster(local, {n.name: NodeInfo(n.name, n.ip, n.node_id) for n in local.worker_nodes})
    finally:
        local.shutdown()
