"""AppConfig: the typed arguments of the kvstack Serve application (``deployments.app:build_app``).

Who calls what:
- Ray Serve calls ``build_app(args)`` with the ``args`` mapping of a Serve config (``serve run``/``serve deploy``,
  KubeRay's ``serveConfigV2``) or of ``kvstack serve``; ``build_app`` parses it once with
  ``AppConfig.model_validate(args)`` and passes the parsed pieces down (the engine settings to every
  ``VLLMReplica``, the router settings to ``OpenAIIngress``, the pool settings to each node's ``PoolShard``).
- ``check_spec_names`` resolves the spec names (model spec, GPU profile, tiers) against the loaded
  ``configs/specs`` tables; ``build_app`` calls it so a typo fails at deploy time, not at the first request.
- ``serve_autoscaling_config`` / ``serve_ray_actor_options`` give the Serve deployment options that the app
  applies to the replica deployment; a Serve config that also overrides them per deployment must agree
  (``tests/unit/test_k8s_manifests.py`` checks the Kubernetes manifests do).

Contract for ``build_app``: it only builds the deployment graph (no Ray calls, no model or file access); files and
engines are touched when the replicas start. Unknown keys anywhere are rejected (``extra="forbid"``); every field
has its default here and nowhere else.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.loader import pick
from configs.schema import GpuProfile, ModelSpec, Strict, TierSpec
from deployments.engine_settings import EngineSettings
from router.access import AccessSettings
from router.hub import CpuBinding
from router.ingress_settings import OpenAIFrontendSettings, PolicyName, TierRole

APP_CONFIG_VERSION = 1

TransferBackend = Literal["nixl", "tcp"]

# How often a replica sends a streamed request's tokens after its first (deployments.stream_batching).
STREAM_BATCHING_INTERVAL_MS = 20.0

DEFAULT_TIER_MAP: dict[TierRole, str] = {
    "hbm": "hbm",
    "local_dram": "cpu-dram",
    "remote_dram": "rdma-pool",
    "local_ssd": "local-ssd",
    "remote_ssd": "remote-block",
}


class AutoscalingSettings(BaseModel):
    """Serve autoscaling of the replica deployment: every key of Ray Serve's ``autoscaling_config``
    (``ray.serve.config.AutoscalingConfig``: smoothing and scaling factors, look-back period, metrics interval,
    aggregation function, custom policy...) passes through and is checked by Ray Serve's own model; a key Serve
    does not know is an error naming it. The declared fields are those with kvstack's own defaults."""

    model_config = ConfigDict(extra="allow", frozen=True)

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(ge=1)
    target_ongoing_requests: float = Field(default=8.0, gt=0)
    initial_replicas: int | None = Field(default=None, ge=0)
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=600.0, ge=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) outside [{self.min_replicas}, {self.max_replicas}]"
            )
        from ray.serve.config import AutoscalingConfig  # Ray's model ignores unknown keys: name them here

        for key in self.model_extra or {}:
            if key not in AutoscalingConfig.model_fields:
                close = difflib.get_close_matches(key, sorted(AutoscalingConfig.model_fields), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ValueError(f"replicas.autoscaling_config.{key}: not a Ray Serve autoscaling option{hint}")
        AutoscalingConfig.model_validate(self.model_dump(exclude_none=True))
        return self


class ReplicaSettings(Strict):
    """The vLLM replica deployment: a fixed count or autoscaling, and the resources of one replica."""

    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: AutoscalingSettings | None = None
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per replica (0 on CPU clusters)")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs per replica")
    max_ongoing_requests: int = Field(default=32, ge=1)
    threads: int | None = Field(
        default=None, ge=1,
        description="engine threads per replica, each bound to a core of its own (default: num_cpus, at least 1)")
    cpu_binding: CpuBinding = Field(
        default="exclusive",
        description="exclusive: a replica's threads run on cores no other replica holds (refused when none is "
                    "free); shared: the least-claimed cores, replicas may share them; unbound: no claim, the "
                    "threads run wherever the OS schedules them (vLLM's nobind) (deployments.cpu_placement)")
    stream_batching_interval_ms: float = Field(
        default=STREAM_BATCHING_INTERVAL_MS, ge=0,
        description="a streamed request's tokens after its first are sent to the ingress at most this often, merged "
                    "(the first token and the last are never held; 0: every token as the engine makes it) "
                    "(deployments.stream_batching)")

    @model_validator(mode="after")
    def _one_of(self) -> ReplicaSettings:
        if (self.num_replicas is None) == (self.autoscaling_config is None):
            raise ValueError("set exactly one of replicas.num_replicas and replicas.autoscaling_config")
        return self

    def engine_threads(self) -> int:
        """Threads (and so cores) of one replica's engine."""
        return self.threads if self.threads is not None else max(1, int(self.num_cpus))


class RouterSettings(Strict):
    """The routing policy, the specs it prices with (names from ``configs/specs/*.yaml``), the cost model's initial
    efficiencies and the policy's seed. ``deployments.app.ingress_settings`` turns these into the router's runtime
    ``router.ingress_settings.IngressSettings``."""

    policy: PolicyName = "cost_based"
    model_spec: str | None = Field(
        default=None, description="a model name in configs/specs/models.yaml to price with instead of the spec "
                                  "derived from the model's own config.json and safetensors (configs.hf_model)")
    gpu_profile: str | None = Field(
        default=None, description="GPU name in configs/specs/gpus.yaml (None: detected from the replicas' device, "
                                  "configs/specs/gpus.yaml device_names)")
    tiers: dict[TierRole, str] = Field(
        default_factory=lambda: dict(DEFAULT_TIER_MAP), description="tier role -> tier name in tiers.yaml"
    )
    mfu: float = Field(default=0.4, gt=0, le=1, description="initial MFU of the cost model; calibration replaces it")
    bw_util: float = Field(default=0.7, gt=0, le=1,
                           description="initial bandwidth utilisation of the cost model; calibration replaces it")
    seed: int | None = Field(default=None, description="seed of the policy's RNG (None: a fresh one per router)")

    @model_validator(mode="after")
    def _hbm_priced(self) -> RouterSettings:
        if "hbm" not in self.tiers:
            raise ValueError("router.tiers must map 'hbm' (the replica's own prefix cache)")
        return self


class PoolSettings(Strict):
    """The KV pool shard on each node: DRAM arena, optional SSD directory, transfer backend."""

    enabled: bool = True
    dram_bytes: int = Field(gt=0, description="DRAM arena per node shard, bytes")
    ssd_dir: str | None = Field(default=None, description="directory for the SSD tier (a local NVMe mount)")
    ssd_bytes: int = Field(default=0, ge=0, description="SSD tier capacity per node shard, bytes (0: no SSD tier)")
    transfer_backend: TransferBackend = "nixl"
    shared_memory: bool = Field(
        default=True, description="replicas reach their own node's shard through shared memory (one memory copy), "
                                  "other nodes' shards through transfer_backend")
    lease_on_lookup: bool = Field(
        default=True, description="a replica's pool lookup also leases what it found, so the load starts in the step "
                                  "vLLM allocates the request's blocks (off: the lease starts then, the load a step "
                                  "later)")
    saver_nice: int = Field(
        default=19, ge=0, le=19, description="nice value of each replica's background saver thread (Linux): 19 = "
                                             "saves run when the engine's threads leave a core idle, never ahead of "
                                             "the forward pass and the first token; 0 = the engine's priority")
    saver_max_lag_s: float = Field(
        default=1.0, ge=0, description="with saver_nice > 0, a save that waited this long for the saver thread is "
                                       "taken by a second one at the engine's priority (busy cores starve a nice-19 "
                                       "thread); 0: none")
    inline_load_max_bytes: int = Field(
        default=16 << 20, ge=0, description="a pool hit on the replica's own node, leased by its lookup, of at most "
                                            "this many bytes is loaded inside the engine step that allocates it (one "
                                            "shared-memory copy before the forward) instead of a step later; 0: "
                                            "every load in the background")
    metrics_port: int | None = Field(
        default=9101, ge=1024, le=65535, description="HTTP port of the shard's Prometheus exposition (None: off)"
    )

    @model_validator(mode="after")
    def _ssd(self) -> PoolSettings:
        if self.ssd_bytes > 0 and not self.ssd_dir:
            raise ValueError("pool.ssd_bytes > 0 needs pool.ssd_dir")
        return self


class IngressDeploymentSettings(AccessSettings):
    """The OpenAI ingress (router) Serve deployment (its runtime settings: ``router.ingress_settings``), who may
    call it and how much it holds (``router.access.AccessSettings``: API keys file, ``metrics_need_key``,
    ``max_queued_requests``, ``tenant_tokens_per_minute``), and the options of the vLLM OpenAI serving layer it
    runs (``vllm serve`` flag names: tool parser, chat template...)."""

    num_replicas: int = Field(default=1, ge=1)
    openai: OpenAIFrontendSettings = Field(default_factory=OpenAIFrontendSettings)


class ModelEntry(Strict):
    """One model of the app: its engine, its replica deployment and, optionally, its own routing policy and pricing
    spec (else ``app.router``'s). ``app.models`` lists several; a single-model config's ``app.engine`` and
    ``app.replicas`` are its one entry."""

    engine: EngineSettings
    replicas: ReplicaSettings
    policy: PolicyName | None = None
    model_spec: str | None = Field(default=None, description="a configs/specs/models.yaml name (else the router's, "
                                                              "else derived from the model's own files)")

    def serve_autoscaling_config(self) -> dict[str, Any] | None:
        """The replica deployment's Serve ``autoscaling_config`` (None for a fixed replica count)."""
        auto = self.replicas.autoscaling_config
        if auto is None:
            return None
        return auto.model_dump(exclude_none=True)

    def serve_ray_actor_options(self) -> dict[str, float]:
        """The replica deployment's Serve ``ray_actor_options`` resources. A replica whose engine spans several GPUs
        (``serve_placement_group``) holds none itself: its engine's Ray workers hold them."""
        gpus = 0.0 if self.serve_placement_group() else self.replicas.num_gpus
        return {"num_cpus": self.replicas.num_cpus, "num_gpus": gpus}

    def serve_placement_group(self) -> dict[str, Any] | None:
        """Serve's placement group options for a replica whose engine spans ``tensor_parallel_size ×
        pipeline_parallel_size`` GPUs (Ray Serve's way for multi-GPU replicas, as Ray Serve LLM does it): one bundle
        per GPU worker of vLLM's Ray executor, the replica actor's CPUs in the first; packed on one node for tensor
        parallelism, spread as needed for pipeline stages. None for a one-GPU or CPU replica."""
        n = self.engine.parallel_size()
        if n <= 1 or self.replicas.num_gpus <= 0:
            return None
        gpu = self.replicas.num_gpus
        bundles = [{"CPU": self.replicas.num_cpus, "GPU": gpu}] + [{"GPU": gpu} for _ in range(n - 1)]
        pipeline = int(self.engine.extra_engine_args().get("pipeline_parallel_size", 1))
        return {"placement_group_bundles": bundles,
                "placement_group_strategy": "PACK" if pipeline > 1 else "STRICT_PACK"}


class AppConfig(Strict):
    """Everything ``build_app`` needs; one YAML/JSON mapping (Serve ``args``). One model (``engine`` and
    ``replicas``) or several (``models``, each answering under its own ``served_model_name``)."""

    version: Literal[1] = APP_CONFIG_VERSION
    engine: EngineSettings | None = None
    replicas: ReplicaSettings | None = None
    models: list[ModelEntry] | None = Field(default=None, min_length=1)
    router: RouterSettings
    pool: PoolSettings
    ingress: IngressDeploymentSettings = Field(default_factory=IngressDeploymentSettings)

    @model_validator(mode="after")
    def _one_model_or_a_list(self) -> AppConfig:
        single = (self.engine is not None, self.replicas is not None)
        if self.models is None and single != (True, True):
            raise ValueError("set app.engine and app.replicas (one model), or app.models (several)")
        if self.models is not None and any(single):
            raise ValueError("app.models lists every model: app.engine and app.replicas go into its entries")
        names = [m.engine.served_model_name for m in self.entries()]
        if len(set(names)) != len(names):
            raise ValueError(f"app.models: two models are served under one name: {names}")
        return self

    def entries(self) -> list[ModelEntry]:
        """Every model of the app, the single-model config's as its one entry."""
        if self.models is not None:
            return list(self.models)
        assert self.engine is not None and self.replicas is not None
        return [ModelEntry(engine=self.engine, replicas=self.replicas)]

    @property
    def first(self) -> ModelEntry:
        """The first (for a single-model config: the only) model."""
        return self.entries()[0]

    def check_spec_names(
        self,
        models: Mapping[str, ModelSpec],
        gpus: Mapping[str, GpuProfile],
        tiers: Mapping[str, TierSpec],
    ) -> None:
        """Raise ``configs.loader.UnknownNameError`` (listing the known names) for a name no spec defines."""
        for name in {self.router.model_spec, *(m.model_spec for m in self.entries())} - {None}:
            pick("model", models, name)
        if self.router.gpu_profile is not None:
            pick("GPU", gpus, self.router.gpu_profile)
        for tier_name in self.router.tiers.values():
            pick("tier", tiers, tier_name)

    # The first model's Serve options (a single-model config's): ModelEntry has them per model.
    def serve_autoscaling_config(self) -> dict[str, Any] | None:
        return self.first.serve_autoscaling_config()

    def serve_ray_actor_options(self) -> dict[str, float]:
        return self.first.serve_ray_actor_options()

    def serve_placement_group(self) -> dict[str, Any] | None:
        return self.first.serve_placement_group()
