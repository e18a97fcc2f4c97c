"""The kvstack Serve application: ``build_app(args)`` → ingress (router) + one vLLM replica deployment per model.

Who calls it: ``kvstack serve`` (``cluster.commands.serve``) and Ray Serve itself from a Serve config
(``import_path: deployments.app:build_app``, KubeRay's ``serveConfigV2``). ``args`` is parsed once into
``deployments.app_config.AppConfig`` (unknown keys rejected) and the spec names are checked against
``configs/specs``; then the deployment graph is built. No Ray calls, no model or file access happen here: the
replicas load their engines, and the ingress its tokenizer, when they start. The ``ClusterViewHub`` actor is
created on first use by whichever component starts first (``router.hub.get_or_create_hub``). With the pool on, a
``PoolKeeper`` deployment (``deployments.pool_keeper``) starts a pool shard on every node, including nodes that join
later; it is bound into the ingress's arguments so that Serve deploys it with the app. Several models
(``app.models``): one replica deployment and one hub per model, one ingress routing by the request's ``model``; the
pool's shards are shared, their slot the largest block of any model, the keys apart by model (namespace).
"""

from __future__ import annotations

import re
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from configs import load_gpus, load_models, load_tiers
from deployments.app_config import AppConfig, ModelEntry
from deployments.pool_keeper import PoolKeeper
from deployments.replica import VLLMReplica
from deployments.request_router import DecisionRequestRouter
from router.access import AccessSettings
from router.hub import DEFAULT_HUB_NAME
from router.ingress import OpenAIIngress
from router.ingress_settings import IngressSettings

REPLICA_DEPLOYMENT = "VLLMReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
POOL_KEEPER_DEPLOYMENT = "PoolKeeper"


def ingress_settings(cfg: AppConfig, entry: ModelEntry | None = None, index: int = 0) -> IngressSettings:
    """The router's runtime settings for one model of the app (default: the first) from the app config: the one
    place they are built (every field the config holds is required by ``IngressSettings``, so none is dropped on
    the way). Each model of a multi-model app has its own hub (``hub_name``), so its own replicas and cluster view."""
    entry = entry or cfg.first
    engine = entry.engine
    return IngressSettings(
        served_model_name=engine.served_model_name,
        model_path=engine.model_path,
        engine_args=engine.vllm_engine_kwargs(),
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        cache_salt=engine.cache_salt,
        policy=entry.policy or cfg.router.policy,
        model_spec=entry.model_spec or cfg.router.model_spec,
        gpu_profile=cfg.router.gpu_profile,
        tiers=dict(cfg.router.tiers),
        mfu=cfg.router.mfu,
        bw_util=cfg.router.bw_util,
        seed=cfg.router.seed,
        dtype=engine.dtype,
        reasoning_parser=engine.reasoning_parser,
        openai=cfg.ingress.openai,
        access=AccessSettings.model_validate(cfg.ingress.model_dump(include=set(AccessSettings.model_fields))),
        hub_name=hub_name(index),
    )


def hub_name(index: int) -> str:
    """The cluster-view hub of the app's ``index``-th model (the first keeps the single-model name)."""
    return DEFAULT_HUB_NAME if index == 0 else f"{DEFAULT_HUB_NAME}-{index}"


def replica_deployment_name(cfg: AppConfig, index: int) -> str:
    """``VLLMReplica`` for a single-model app; one deployment per model otherwise (``VLLMReplica-<i>-<name>``)."""
    if cfg.models is None:
        return REPLICA_DEPLOYMENT
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.entries()[index].engine.served_model_name)
    return f"{REPLICA_DEPLOYMENT}-{index}-{name}"


def _replicas(cfg: AppConfig, entry: ModelEntry, index: int) -> serve.Application:
    replica_options: dict[str, Any] = dict(
        name=replica_deployment_name(cfg, index),
        ray_actor_options=entry.serve_ray_actor_options(),
        max_ongoing_requests=entry.replicas.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=DecisionRequestRouter, request_routing_stats_period_s=1.0
        ),
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=20,
    )
    engine = entry.engine
    placement_group = entry.serve_placement_group()
    if placement_group is not None:
        replica_options.update(placement_group)
        if "distributed_executor_backend" not in engine.extra_engine_args():  # vLLM's Ray executor: the group's GPUs
            engine = engine.model_copy(update={"distributed_executor_backend": "ray"})
    autoscaling = entry.serve_autoscaling_config()
    if autoscaling is not None:
        replica_options["autoscaling_config"] = autoscaling
    else:
        replica_options["num_replicas"] = entry.replicas.num_replicas
    # every model's engine sizes the node's pool shard (one slot size for all: the largest block)
    pool_engines = [m.engine for m in cfg.entries()]
    return serve.deployment(VLLMReplica).options(**replica_options).bind(
        engine, cfg.pool, hub_name=hub_name(index), threads=entry.replicas.engine_threads(),
        cpu_binding=entry.replicas.cpu_binding, pool_engines=pool_engines,
        stream_batching_interval_ms=entry.replicas.stream_batching_interval_ms)


def build_app(args: dict[str, Any] | AppConfig) -> serve.Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    cfg.check_spec_names(load_models(), load_gpus(), load_tiers())
    routes = [(_replicas(cfg, entry, i), ingress_settings(cfg, entry, i)) for i, entry in enumerate(cfg.entries())]

    keeper = None
    if cfg.pool.enabled:  # the pool belongs to the app: a shard on every node, also those that join later
        keeper = serve.deployment(PoolKeeper).options(
            name=POOL_KEEPER_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
            health_check_period_s=10,
        ).bind([m.engine for m in cfg.entries()], cfg.pool)

    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=cfg.ingress.num_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=256,
    )
    return ingress.bind(routes, keeper)
