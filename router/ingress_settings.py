"""Typed settings of the OpenAI ingress / router, built by ``deployments.app`` from the app config.

Lives in ``router`` (not ``deployments``) because the router may not import ``deployments``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from router.hub import DEFAULT_HUB_NAME


class IngressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str
    model_path: str = Field(description="local model directory: the tokenizer and chat template come from here")
    max_model_len: int = Field(gt=0)
    block_size: int = Field(gt=0)
    cache_salt: str = ""
    policy: str = "cost_based"
    model_spec: str = Field(description="configs/specs/models.yaml name used for pricing")
    gpu_profile: str = Field(description="configs/specs/gpus.yaml name used for pricing")
    tiers: dict[str, str] = Field(default_factory=dict, description="tier role -> tiers.yaml name")
    mfu: float = Field(default=0.4, gt=0, le=1, description="initial MFU; calibration replaces it")
    bw_util: float = Field(default=0.7, gt=0, le=1)
    hub_name: str = DEFAULT_HUB_NAME
    hub_namespace: str = "kvstack"  # the hub and the pool shards are named actors in this namespace
    shard_names: list[str] = Field(default_factory=list, description="named pool shard actors to watch")
    poll_interval_s: float = Field(default=0.1, gt=0)
    replica_ttl_s: float = Field(default=10.0, gt=0)
    decision_log_size: int = Field(default=1024, gt=0)
    seed: int | None = None
