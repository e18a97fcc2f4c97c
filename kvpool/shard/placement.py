"""Placement of pool shards: one ``PoolShard`` actor per node, hard-pinned there, started and stopped as a pool.

Who calls what:
- ``build_pool`` is the one way a pool is built for a cluster: ``deployments.pool_setup`` (``kvstack serve``, every
  replica for its own node), the integration and e2e tests and the benches. It takes a function node →
  ``ShardConfig``, which nodes, whether the shards are named (``kvpool.shard.registry``, so other processes find
  them and a ``pull`` finds its source), detached or not, and a ready deadline.
- ``_start_shards`` is its mechanism (a node filter, actor names and options as given), ``stop_shards`` closes and
  kills what either started, ``alive_nodes`` lists the nodes a pool may go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import msgspec
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.shard.actor import PoolShardActor
from kvpool.shard.client import ShardHandle, proof_for
from kvpool.shard.registry import shard_actor_name
from kvpool.shard.wire import SHARD_NAMESPACE, ShardConfig, ShardInfo, ShardUnavailableError, decode, encode

log = logging.getLogger(__name__)


class PoolNode(msgspec.Struct, frozen=True):
    """A node a shard is placed on (what ``build_pool``'s config function gets)."""

    node_id: str
    node_ip: str


def default_shard_id(node: PoolNode) -> str:
    """The id a shard found by name has (``kvpool.shard.registry``): the first 12 characters of its node id."""
    return node.node_id[:12]


def alive_nodes(include: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
    """Alive Ray nodes passing ``include`` (default: nodes with CPU > 0, i.e. not a 0-CPU control-plane head)."""
    pred = include or (lambda n: n.get("Resources", {}).get("CPU", 0) > 0)
    return [n for n in ray.nodes() if n.get("Alive") and pred(n)]


def build_pool(
    shard_config: Callable[[PoolNode], ShardConfig],
    *,
    nodes: Collection[str] | None = None,
    named: bool = True,
    namespace: str = SHARD_NAMESPACE,
    detached: bool = False,
    ready_deadline_s: float = 60.0,
) -> list[ShardHandle]:
    """Start one shard on each alive node of ``nodes`` (node ids; None = every alive node with CPUs) from
    ``shard_config(node)``, and wait until each is ready.

    ``named``: each actor is ``shard_actor_name(node_id)`` in ``namespace`` and finds its pull sources there (its
    ``registry_namespace`` is set to ``namespace``); unnamed shards are reachable only through the returned handles.
    ``detached``: the shards outlive the caller (named ones only) and an already running shard of that name is
    reused (a second caller gets the same pool). On failure kills what it started and raises
    ``ShardUnavailableError`` (see ``_start_shards``).
    """
    if detached and not named:
        raise ValueError("build_pool: a detached pool must be named (nothing could find or stop it otherwise)")
    wanted = None if nodes is None else set(nodes)

    def config(node_id: str, node_ip: str) -> ShardConfig:
        cfg = shard_config(PoolNode(node_id, node_ip))
        return msgspec.structs.replace(cfg, registry_namespace=namespace) if named else cfg

    return _start_shards(
        config,
        include=None if wanted is None else (lambda n: n["NodeID"] in wanted),
        ready_deadline_s=ready_deadline_s,
        actor_options={"get_if_exists": True, "lifetime": "detached"} if detached else None,
        actor_name=shard_actor_name if named else None,
        namespace=namespace if named else None,
    )


def _start_shards(
    config_for_node: Callable[[str, str], ShardConfig],
    *,
    include: Callable[[dict[str, Any]], bool] | None = None,
    max_concurrency: int = 8,
    ready_deadline_s: float = 60.0,
    actor_options: dict[str, Any] | None = None,
    actor_name: Callable[[str], str] | None = None,
    namespace: str | None = None,
) -> list[ShardHandle]:
    """Start one shard per alive node (``config_for_node(node_id, node_ip)``), each hard-pinned to its node.

    ``actor_name(node_id)`` names each actor (in ``namespace``) so other processes find it
    (``kvpool.shard.registry``). Waits until every shard answered ``info`` within ``ready_deadline_s``; on failure
    kills what it started and raises ``ShardUnavailableError``.
    """
    handles: list[ShardHandle] = []
    try:
        for node in alive_nodes(include):
            node_id, node_ip = node["NodeID"], node["NodeManagerAddress"]
            cfg = config_for_node(node_id, node_ip)
            named = {"name": actor_name(node_id), "namespace": namespace} if actor_name is not None else {}
            actor = PoolShardActor.options(
                num_cpus=0,
                max_concurrency=max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                **named,
                **(actor_options or {}),
            ).remote(encode(cfg))
            handles.append(ShardHandle(shard_id=cfg.shard_id, node_id=node_id, actor=actor, node_ip=node_ip))
    except BaseException:
        for h in handles:
            ray.kill(h.actor, no_restart=True)
        raise
    if not handles:
        raise ShardUnavailableError("no alive node passed the filter: no pool shard started")
    refs = [h.actor.info.remote(proof_for("info")) for h in handles]
    try:
        infos = [decode(raw, ShardInfo) for raw in ray.get(refs, timeout=ready_deadline_s)]
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        stop_shards(handles)
        raise ShardUnavailableError(f"pool shards not ready within {ready_deadline_s}s: {exc}") from exc
    for h, info in zip(handles, infos, strict=True):
        if info.node_id != h.node_id:
            stop_shards(handles)
            raise ShardUnavailableError(f"shard {h.shard_id} landed on node {info.node_id}, not {h.node_id}")
    return handles


def stop_shards(handles: Sequence[ShardHandle], deadline_s: float = 10.0) -> None:
    """Close every shard (bounded by ``deadline_s``), then kill the actors."""
    refs = [h.actor.close.remote() for h in handles]
    try:
        ray.get(refs, timeout=deadline_s)
    except Exception as exc:  # a dead or stuck shard is killed below regardless
        log.warning("stop_shards: close did not finish cleanly: %s", exc)
    for h in handles:
        ray.kill(h.actor, no_restart=True)
