"""The kvstack Serve application: ``build_app(args)`` → ingress (router) + vLLM replica deployment.

Who calls it: ``kvstack serve`` (``cluster.commands.serve``) and Ray Serve itself from a Serve config
(``import_path: deployments.app:build_app``, KubeRay's ``serveConfigV2``). ``args`` is parsed once into
``deployments.app_config.AppConfig`` (unknown keys rejected) and the spec names are checked against
``configs/specs``; then the deployment graph is built. No Ray calls, no model or file access happen here: the
replicas load their engines, and the ingress its tokenizer, when they start. The ``ClusterViewHub`` actor is
created on first use by whichever component starts first (``router.hub.get_or_create_hub``). With the pool on, a
``PoolKeeper`` deployment (``deployments.pool_keeper``) starts a pool shard on every node, including nodes that join
later; it is bound into the ingress's arguments so that Serve deploys it with the app.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from configs import load_gpus, load_models, load_tiers
from deployments.app_config import AppConfig
from deployments.pool_keeper import PoolKeeper
from deployments.replica import VLLMReplica
from deployments.request_router import DecisionRequestRouter
from router.ingress import OpenAIIngress
from router.ingress_settings import IngressSettings

REPLICA_DEPLOYMENT = "VLLMReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
POOL_KEEPER_DEPLOYMENT = "PoolKeeper"


def ingress_settings(cfg: AppConfig) -> IngressSettings:
    """The router's runtime settings from the app config: the one place they are built (every field the config
    holds is required by ``IngressSettings``, so none is dropped on the way)."""
    return IngressSettings(
        served_model_name=cfg.engine.served_model_name,
        model_path=cfg.engine.model_path,
        engine_args=cfg.engine.vllm_engine_kwargs(),
        max_model_len=cfg.engine.max_model_len,
        block_size=cfg.engine.block_size,
        cache_salt=cfg.engine.cache_salt,
        policy=cfg.router.policy,
        model_spec=cfg.router.model_spec,
        gpu_profile=cfg.router.gpu_profile,
        tiers=dict(cfg.router.tiers),
        mfu=cfg.router.mfu,
        bw_util=cfg.router.bw_util,
        seed=cfg.router.seed,
        dtype=cfg.engine.dtype,
        reasoning_parser=cfg.engine.reasoning_parser,
        openai=cfg.ingress.openai,
    )


def build_app(args: dict[str, Any] | AppConfig) -> serve.Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    cfg.check_spec_names(load_models(), load_gpus(), load_tiers())

    replica_options: dict[str, Any] = dict(
        name=REPLICA_DEPLOYMENT,
        ray_actor_options=cfg.serve_ray_actor_options(),
        max_ongoing_requests=cfg.replicas.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=DecisionRequestRouter, request_routing_stats_period_s=1.0
        ),
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=20,
    )
    engine = cfg.engine
    placement_group = cfg.serve_placement_group()
    if placement_group is not None:
        replica_options.update(placement_group)
        if "distributed_executor_backend" not in engine.extra_engine_args():  # vLLM's Ray executor: the group's GPUs
            engine = engine.model_copy(update={"distributed_executor_backend": "ray"})
    autoscaling = cfg.serve_autoscaling_config()
    if autoscaling is not None:
        replica_options["autoscaling_config"] = autoscaling
    else:
        replica_options["num_replicas"] = cfg.replicas.num_replicas
    replicas = serve.deployment(VLLMReplica).options(**replica_options).bind(
        engine, cfg.pool, threads=cfg.replicas.engine_threads(), cpu_binding=cfg.replicas.cpu_binding)

    keeper = None
    if cfg.pool.enabled:  # the pool belongs to the app: a shard on every node, also those that join later
        keeper = serve.deployment(PoolKeeper).options(
            name=POOL_KEEPER_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
            health_check_period_s=10,
        ).bind(cfg.engine, cfg.pool)

    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=cfg.ingress.num_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=256,
    )
    return ingress.bind(replicas, ingress_settings(cfg), keeper)
