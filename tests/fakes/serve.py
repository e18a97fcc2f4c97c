"""Ray Serve's ``RunningReplica`` (the request router's view of one replica) without a live replica actor, for
tests of ``deployments.request_router.DecisionRequestRouter`` (tests/unit/test_request_router.py).

``FakeRunningReplica`` is a real ``RunningReplica``, built by its own constructor from a real
``RunningReplicaInfo`` — replica id, node, ``max_ongoing_requests`` and the ``routing_stats`` dict that the replica's
``record_routing_stats`` returns — so every property the router reads is Serve's own code. Only the actor handle is
missing (the real one is looked up by name in a running Ray cluster): any call that would reach the replica (queue
probe, request, slot reservation) raises ``NoReplicaActor``, which a routing decision never needs. Stats change
the way Serve changes them, through ``update_replica_info``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.serve._private.common import DeploymentID, RunningReplicaInfo
from ray.serve._private.constants import DEFAULT_MAX_ONGOING_REQUESTS
from ray.serve.request_router import ReplicaID, RunningReplica

# The router reads only ``replica_id.unique_id``; the deployment is named for what it is, not as the app names it.
FAKE_DEPLOYMENT = DeploymentID(name="fake-replicas", app_name="tests")


class NoReplicaActor(RuntimeError):
    """A fake replica was asked to talk to its (absent) actor."""


class _AbsentActor:
    def __init__(self, unique_id: str) -> None:
        self._unique_id = unique_id

    def __getattr__(self, name: str) -> Any:
        raise NoReplicaActor(f"fake replica {self._unique_id!r} has no actor (asked for {name!r}): routing must "
                             "decide from the replica info alone")


class _DetachedReplicaInfo(RunningReplicaInfo):
    """A real ``RunningReplicaInfo`` whose actor handle is not looked up in a Ray cluster."""

    def get_actor_handle(self) -> Any:
        return _AbsentActor(self.replica_id.unique_id)


class FakeRunningReplica(RunningReplica):
    def __init__(self, unique_id: str, running: int = 0, waiting: int = 0,
                 routing_stats: dict[str, Any] | None = None, *, node_id: str = "node-0",
                 max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS) -> None:
        """``routing_stats`` as the replica reports them; default ``{"running": running, "waiting": waiting}``."""
        stats = routing_stats if routing_stats is not None else {"running": running, "waiting": waiting}
        super().__init__(_DetachedReplicaInfo(
            replica_id=ReplicaID(unique_id, FAKE_DEPLOYMENT), node_id=node_id, node_ip="127.0.0.1",
            availability_zone=None, actor_name=f"fake-replica-{unique_id}",
            max_ongoing_requests=max_ongoing_requests, routing_stats=stats))

    def set_routing_stats(self, stats: dict[str, Any] | None) -> None:
        """New stats through Serve's own update path (``RunningReplica.update_replica_info``)."""
        self.update_replica_info(dataclasses.replace(self._replica_info, routing_stats=stats))

    def __repr__(self) -> str:
        return f"FakeRunningReplica({self.replica_id.unique_id!r}, {self.routing_stats!r})"
