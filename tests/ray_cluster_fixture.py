"""The shared session fixture ``ray_cluster``: a real local multi-node Ray cluster on this machine.

Registered once, in ``tests/conftest.py``, so integration and e2e tests share ONE cluster per pytest session
(a fixture defined in two conftest files would start a second cluster on the same node IPs while the first lives).

``ray_cluster`` (session scope) starts a head with 0 CPUs (control plane only, so nothing lands there by accident)
and three worker nodes added one at a time with node IPs 127.0.0.2, 127.0.0.3, 127.0.0.4 (all loopback on Linux),
each with 1 CPU and a custom resource ``node_a`` / ``node_b`` / ``node_c``. Ray's files go to a private short
``RAY_TMPDIR`` (``/tmp/kvs-XXXX``: Unix socket paths must stay short), auth is disabled, Serve's proxy readiness
timeout is raised for this slow shared machine, and UCX is kept on loopback (``UCX_NET_DEVICES=lo``). The cluster
is stopped with ``cluster.shutdown()`` at the end of the session — never ``ray stop``, which would kill other
people's clusters.

Run integration tests under the machine-wide lock:
``flock /tmp/kvstack-heavy.lock timeout 900 .venv/bin/pytest -m integration tests/integration``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.local_cluster import scoped_environ

WORKER_IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NODE_NAMES = ("a", "b", "c")

CLUSTER_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_health_check_timeout_ms": "30000",
    "RAY_USAGE_STATS_ENABLED": "0",
    "UCX_NET_DEVICES": "lo",  # no RDMA hardware here: UCX over loopback (tcp for wire-up, CMA for same-host RMA)
}


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
    cluster: Any  # ray.cluster_utils.Cluster
    tmpdir: str
    nodes: dict[str, NodeInfo] = field(default_factory=dict)

    def by_ip(self, ip: str) -> NodeInfo:
        return next(n for n in self.nodes.values() if n.ip == ip)

    def affinity(self, name: str) -> Any:
        """Hard node-affinity scheduling strategy for the named worker node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id=self.nodes[name].node_id, soft=False)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    import ray
    from ray.cluster_utils import Cluster

    tmpdir = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    with scoped_environ({**CLUSTER_ENV, "RAY_TMPDIR": tmpdir}):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * 1024 * 1024},
        )
        info = RayCluster(cluster, tmpdir)
        try:
            for name, ip in zip(NODE_NAMES, WORKER_IPS, strict=True):
                node = cluster.add_node(
                    num_cpus=1,
                    node_ip_address=ip,
                    resources={f"node_{name}": 1},
                    object_store_memory=80 * 1024 * 1024,
                    wait=True,
                )
                info.nodes[name] = NodeInfo(name, ip, node.node_id)
            ray.init(address=cluster.address, logging_level="warning")
            yield info
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(tmpdir, ignore_errors=True)
