"""Typed runtime settings of the OpenAI ingress / router (``router.ingress.OpenAIIngress``, ``router.live_view``).

Built in one place, ``deployments.app.ingress_settings(app_config)``, from the app config, whose fields carry the
defaults; every field that comes from the config is required here (no default), so a builder that forgets one
fails instead of silently running with a second default. The fields with defaults are the router's own runtime
knobs, which the app config does not set. Lives in ``router`` (not ``deployments``) because the router may not
import ``deployments``; ``deployments.app_config`` takes the policy names and tier roles from here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from configs.hf_model import pricing_spec
from configs.schema import ModelSpec, Strict
from router.access import AccessSettings
from router.hub import DEFAULT_HUB_NAME

# The policies a deployment can name (``router.policies.runner.POLICIES`` has these and test-only ones).
PolicyName = Literal["round_robin", "least_loaded", "prefix_affinity", "cost_based"]
# Where a prefix can come from, as the router prices it: the replica's own HBM, the DRAM / SSD of the pool shard on
# the replica's node, or the DRAM / SSD of a shard on another node (over the network).
TierRole = Literal["hbm", "local_dram", "remote_dram", "local_ssd", "remote_ssd"]


class OpenAIFrontendSettings(Strict):
    """Options of vLLM's OpenAI serving layer that the ingress runs (``router.vllm_frontend``). Each field is the
    ``vllm serve`` flag of the same name (``tool_call_parser`` is ``--tool-call-parser``) with vLLM's default, and
    means what it means there; ``max_request_body_bytes`` is kvstack's own (larger bodies get a 413)."""

    enable_auto_tool_choice: bool = Field(default=False, description="tool_choice 'auto' (needs tool_call_parser)")
    tool_call_parser: str | None = Field(default=None, description="vLLM tool parser name, e.g. hermes (Qwen3)")
    exclude_tools_when_tool_choice_none: bool = False
    chat_template: str | None = Field(default=None, description="a template file or inline Jinja (default: the "
                                                                "tokenizer's)")
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    default_chat_template_kwargs: dict[str, Any] | None = None
    trust_request_chat_template: bool = False
    response_role: str = "assistant"
    max_request_body_bytes: int = Field(default=16 * 2**20, gt=0)

    def vllm_serve_kwargs(self, *, only_changed: bool = True) -> dict[str, Any]:
        """The vLLM options as ``vllm serve`` keywords (flag names with underscores), kvstack's own left out. By
        default those set to something other than vLLM's default: what plain vLLM's own server needs to serve the
        same endpoint (``bench.oracle``); all of them for the ingress's own serve arguments
        (``router.vllm_frontend``)."""
        return self.model_dump(exclude_defaults=only_changed, exclude={"max_request_body_bytes"})


class IngressSettings(Strict):
    # from the app config (deployments.app.ingress_settings)
    served_model_name: str
    model_path: str = Field(description="the engines' model (a directory or a Hugging Face id): the tokenizer, chat "
                                        "template and the derived cost-model spec come from here")
    engine_args: dict[str, Any] = Field(description="the engines' vLLM arguments (``EngineSettings."
                                                    "vllm_engine_kwargs``): the ingress's model config is theirs")
    max_model_len: int = Field(gt=0)
    block_size: int = Field(gt=0)
    cache_salt: str = Field(description="the engines' cache salt: the ingress's block keys must match theirs")
    policy: PolicyName
    model_spec: str | None = Field(description="configs/specs/models.yaml name used for pricing (None: the spec "
                                               "derived from the model's own files, configs.hf_model)")
    gpu_profile: str | None = Field(description="configs/specs/gpus.yaml name used for pricing (None: detected "
                                                "from the replicas' device)")
    tiers: dict[TierRole, str] = Field(description="tier role -> tiers.yaml name")
    mfu: float = Field(gt=0, le=1, description="initial MFU; calibration replaces it")
    bw_util: float = Field(gt=0, le=1, description="initial bandwidth utilisation; calibration replaces it")
    seed: int | None = Field(description="seed of the policy's RNG (None: fresh)")
    dtype: str = Field(description="the engines' dtype (vLLM's model config at the ingress must match theirs)")
    reasoning_parser: str | None = Field(description="the engines' vLLM reasoning parser (None: none)")
    openai: OpenAIFrontendSettings
    access: AccessSettings = Field(description="API keys file, metrics_need_key, max_queued_requests (app.ingress)")
    # the router's own runtime knobs
    hub_name: str = DEFAULT_HUB_NAME
    hub_namespace: str = "kvstack"  # the hub and the pool shards are named actors in this namespace
    poll_interval_s: float = Field(default=0.1, gt=0)
    shard_events_wait_s: float = Field(
        default=2.0, ge=0, le=10.0, description="how long a pool shard holds the router's events long poll when it "
                                                "has no event to send (0: plain polls every poll_interval_s)")
    replica_ttl_s: float = Field(default=10.0, gt=0)
    decision_log_size: int = Field(default=1024, gt=0)

    def pricing_model_spec(self) -> ModelSpec:
        """The model spec the cost model prices with: the named override, else the one derived from the model's
        config.json and safetensors headers at the engines' dtype."""
        return pricing_spec(self.model_path, self.model_spec, name=self.served_model_name, engine_dtype=self.dtype,
                            kv_cache_dtype=self.engine_args.get("kv_cache_dtype"))
