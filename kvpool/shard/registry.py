"""Finding pool shards: one named actor per node, ``kvstack-pool-<node id>`` in a Ray namespace (default ``kvstack``).

Who calls what: whoever starts the pool (``kvpool.shard.placement.build_pool``) names each shard with
``shard_actor_name``; the vLLM connector (``kvpool.connector.pool``), the replica (``deployments.replica``) and the
router (``router.live_view``: status, shard event sync) list them all with ``list_shards``; a shard's ``pull``
finds its source by id with ``find_shard`` (``kvpool.shard.pull``). Names make shards discoverable from any
process of the cluster without passing handles around; a restarted shard keeps its name (and gets a new transfer
epoch, so peers re-add it). A shard found by name has the id ``node_id[:12]`` (the id ``build_pool`` gives by
default); ``find_shard`` also accepts the full node id. Every GCS look-up here has a deadline
(``kvpool.deadline.call_with_deadline``, ``deadline_s``): a busy or gone GCS is ``ShardUnavailableError``, never a
hang.
"""

from __future__ import annotations

import ray

from kvpool.deadline import GCS_DEADLINE_S, call_with_deadline
from kvpool.shard.client import ShardHandle
from kvpool.shard.wire import SHARD_NAMESPACE, ShardUnavailableError

SHARD_PREFIX = "kvstack-pool-"


def shard_actor_name(node_id: str) -> str:
    return f"{SHARD_PREFIX}{node_id}"


def get_named_actor(name: str, namespace: str, deadline_s: float = GCS_DEADLINE_S) -> ray.actor.ActorHandle:
    """``ray.get_actor`` within ``deadline_s`` (``ValueError`` when no such actor lives, as Ray raises)."""
    return call_with_deadline(lambda: ray.get_actor(name, namespace=namespace), deadline_s, f"get_actor {name}")


def _named(namespace: str, deadline_s: float) -> list[str]:
    """Node ids of the named shard actors listed in ``namespace`` (the caller must be connected to Ray)."""
    entries = call_with_deadline(lambda: ray.util.list_named_actors(all_namespaces=True), deadline_s,
                                 "list_named_actors")
    return [entry["name"][len(SHARD_PREFIX):] for entry in entries
            if entry["namespace"] == namespace and entry["name"].startswith(SHARD_PREFIX)]


def _handle(node_id: str, namespace: str, deadline_s: float) -> ShardHandle | None:
    try:
        actor = get_named_actor(shard_actor_name(node_id), namespace, deadline_s)
    except ValueError:  # died between listing and lookup
        return None
    return ShardHandle(shard_id=node_id[:12], node_id=node_id, actor=actor)


def list_shards(namespace: str = SHARD_NAMESPACE, deadline_s: float = GCS_DEADLINE_S) -> list[ShardHandle]:
    """Every live named shard actor of the cluster (each GCS look-up within ``deadline_s``)."""
    return [h for h in (_handle(node_id, namespace, deadline_s) for node_id in _named(namespace, deadline_s))
            if h is not None]


def find_shard(shard_id: str, namespace: str = SHARD_NAMESPACE, deadline_s: float = GCS_DEADLINE_S) -> ShardHandle:
    """The live named shard whose node id is ``shard_id`` or starts with it as its first 12 characters; raises
    ``ShardUnavailableError`` when no such actor lives."""
    for node_id in _named(namespace, deadline_s):
        if shard_id in (node_id, node_id[:12]):
            h = _handle(node_id, namespace, deadline_s)
            if h is not None:
                return ShardHandle(shard_id=shard_id, node_id=h.node_id, actor=h.actor)
    raise ShardUnavailableError(f"unknown source shard {shard_id!r}: no live actor {SHARD_PREFIX}<node id> for it "
                                f"in namespace {namespace!r}")
