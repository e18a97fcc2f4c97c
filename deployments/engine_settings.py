"""Settings of one vLLM engine (a replica): any vLLM engine argument, plus kvstack's own few.

``app.engine`` is a mapping of ``AsyncEngineArgs`` keywords — ``model`` (a local directory or a Hugging Face id),
``tensor_parallel_size``, ``gpu_memory_utilization``, ``quantization``, ``max_num_batched_tokens``,
``trust_remote_code``, ``structured_outputs_config``, ... — checked by vLLM's own parser when the config is loaded
(``router.vllm_args``: an unknown or ill-typed key is an error naming it, before anything starts). The fields
declared here are those kvstack reads itself or gives another default than vLLM (the CPU build's block size, a fixed
KV cache, eager mode, a seed); ``kv_bytes_per_token``, ``kv_events``, ``cache_salt`` and ``startup_probe`` are
kvstack's own. The keys kvstack sets itself (its connector, KV events, prefix caching, the worker extension) are
refused.

Parsed once by the entrypoint (``deployments.app_config.AppConfig`` embeds it) and passed to
``deployments.replica.VLLMReplica``; ``vllm_engine_kwargs`` is what the replica, the ingress's renderer, plain vLLM's
server in ``kvstack bench oracle`` and Ray Serve LLM's anchor all start from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from configs.schema import ModelSpec

# Engine arguments kvstack sets itself (deployments.replica.build_engine_args), with the reason a user may not.
RESERVED_ENGINE_ARGS: dict[str, str] = {
    "kv_transfer_config": "kvstack's KV pool connector is the engine's connector (app.pool)",
    "kv_events_config": "kvstack subscribes to the engine's KV events itself (app.engine.kv_events)",
    "enable_prefix_caching": "the router routes on the engines' prefix caches: it is always on",
    "worker_extension_cls": "kvstack's worker extension reports each worker's CPU binding",
}


def is_local_model(model: str, *, generated: bool = False) -> bool:
    """Whether ``model`` names a local directory rather than a Hugging Face id: it exists, is written as a path
    (``./``, ``../``, ``/``, ``~``), or is where a tiny model will be generated. Anything else is an id (as vLLM
    reads it)."""
    return generated or Path(model).expanduser().exists() or model.startswith((".", "/", "~"))


def default_served_model_name(model: str) -> str:
    """A local directory is served under its base name, a Hugging Face id under the id (as vLLM does)."""
    return Path(model).expanduser().name if is_local_model(model) else model


class EngineSettings(BaseModel):
    """One engine's vLLM arguments (declared fields and any other ``AsyncEngineArgs`` keyword) and kvstack's own."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = Field(description="a local model directory or a Hugging Face id (vLLM's `model`)")
    served_model_name: str = Field(default="", description="the name clients put in `model` (default: the "
                                                           "directory's name, or the Hugging Face id)")
    max_model_len: int = Field(default=4096, gt=0)
    block_size: int = Field(default=128, gt=0, description="KV block size in tokens (128 on the CPU backend)")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    kv_cache_memory_bytes: int | None = Field(default=512 * 2**20, gt=0)
    enforce_eager: bool = True
    max_num_seqs: int = Field(default=16, gt=0)
    seed: int = 0
    reasoning_parser: str | None = Field(
        default=None, description="vLLM reasoning parser (e.g. qwen3): the engine ends structured-output constraints "
                                  "at the end of reasoning, the ingress splits `reasoning` from `content`")
    # kvstack's own
    kv_bytes_per_token: int | None = Field(
        default=None, gt=0, description="for the HBM ledger's capacity; derived from the model config if unset"
    )
    kv_events: bool = Field(default=True, description="publish vLLM KV events; the replica reports exact HBM keys")
    cache_salt: str = ""
    startup_probe: bool = Field(
        default=False, description="time a few cold prefills when the engine starts, so the routers price this "
                                   "engine with what it measured (off by default: replicas priced a few percent apart "
                                   "by their probes drew all of a burst of fresh prompts onto one, see the note)")

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "model_path" in data:
                raise ValueError("app.engine.model_path is now app.engine.model (vLLM's name: a directory or an id)")
            if data.get("model") and not data.get("served_model_name"):
                data = {**data, "served_model_name": default_served_model_name(str(data["model"]))}
        return data

    @model_validator(mode="after")
    def _vllm_accepts(self) -> EngineSettings:
        for key in self.extra_engine_args():
            if key in RESERVED_ENGINE_ARGS:
                raise ValueError(f"app.engine.{key} is set by kvstack: {RESERVED_ENGINE_ARGS[key]}")
        if self.extra_engine_args():  # vLLM's parser (an import of vLLM) only for what pydantic did not check
            from router.vllm_args import check_engine_args

            check_engine_args(self.vllm_engine_kwargs())
        return self

    def extra_engine_args(self) -> dict[str, Any]:
        """The engine arguments given beyond the declared fields, as written in the config."""
        return dict(self.model_extra or {})

    @property
    def model_path(self) -> str:
        """Where kvstack reads the model's own files (config.json, tokenizer): ``model`` (a directory, or an id
        that vLLM and ``configs.hf_model`` resolve through the Hugging Face cache)."""
        return self.model

    def tensor_parallel_size(self) -> int:
        """The engine's tensor-parallel ranks (each stores its heads in the pool under its own keys)."""
        return int(self.extra_engine_args().get("tensor_parallel_size", 1))

    def parallel_size(self) -> int:
        """GPUs one replica's engine spans (tensor × pipeline parallel)."""
        return self.tensor_parallel_size() * int(self.extra_engine_args().get("pipeline_parallel_size", 1))

    def vllm_engine_kwargs(self) -> dict[str, Any]:
        """The vLLM engine arguments these settings stand for (``AsyncEngineArgs`` keywords, as written: parse them
        with ``router.vllm_args.parse_engine_args``): the replica's engine adds its connector, KV events and CPU
        binding to them; ``kvstack bench oracle`` starts plain vLLM's own server with exactly these."""
        kwargs: dict[str, Any] = dict(
            model=self.model,
            tokenizer=self.model,
            served_model_name=self.served_model_name,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=True,
            seed=self.seed,
            max_num_seqs=self.max_num_seqs,
        )
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.reasoning_parser:
            kwargs["reasoning_parser"] = self.reasoning_parser
        kwargs.update(self.extra_engine_args())
        return kwargs

    def hbm_capacity_blocks(self) -> int:
        """KV blocks the engine can hold (for the router's HBM prefix estimate)."""
        if self.kv_cache_memory_bytes is None:
            return 1 << 20
        per_token = self.kv_bytes_per_token or kv_bytes_per_token_from_model(self.model_path, *self.kv_dtypes())
        return max(1, self.kv_cache_memory_bytes // (per_token * self.block_size))

    def kv_dtypes(self) -> tuple[str, str | None]:
        """(``dtype``, ``kv_cache_dtype``): what the engine stores its KV as (``configs.hf_model.spec_dtype``)."""
        return self.dtype, self.extra_engine_args().get("kv_cache_dtype")


def _kv_spec(model: str, dtype: str | None, kv_cache_dtype: str | None) -> ModelSpec:
    """The model's ``ModelSpec`` from its config alone (no weight headers: the KV shapes need none) at the engine's
    KV element type (``dtype`` or ``kv_cache_dtype``, else the config's: ``configs.hf_model.spec_dtype``)."""
    from configs.hf_model import model_spec_from_config, read_config, spec_dtype

    cfg = read_config(model)
    return model_spec_from_config("kv", cfg, 1.0, dtype=spec_dtype(cfg, dtype, kv_cache_dtype))


def kv_bytes_per_token_from_model(model: str, dtype: str | None = None, kv_cache_dtype: str | None = None) -> int:
    """KV bytes per token of the model's full-attention layers at the engine's KV element type, from its config."""
    return _kv_spec(model, dtype, kv_cache_dtype).kv_bytes_per_token()


def pool_slot_bytes_from_model(model: str, block_size: int, dtype: str | None = None,
                               kv_cache_dtype: str | None = None) -> int:
    """One pool slot: a block of every full-attention layer, or a hybrid's linear-state snapshot (gated delta net:
    conv tail + recurrent state over all linear layers), whichever is larger, at the engine's KV element type (a
    float32 engine's blocks are twice a bfloat16 one's). The connector refuses a pool whose slots are smaller than
    what its registered layout needs."""
    from configs.hf_model import pool_slot_bytes

    return pool_slot_bytes(_kv_spec(model, dtype, kv_cache_dtype), block_size)
