"""Typed settings of one vLLM engine (a replica), shared by the app builder, the replica and the benchmarks.

Parsed once by the entrypoint (``deployments.app_config.AppConfig`` embeds it) and passed to
``deployments.replica.VLLMReplica``; pydantic with ``extra="forbid"``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from configs.schema import Strict


class EngineSettings(Strict):

    model_path: str = Field(description="local model directory (weights + tokenizer)")
    served_model_name: str = Field(description="the name clients put in `model`")
    max_model_len: int = Field(default=4096, gt=0)
    block_size: int = Field(default=128, gt=0, description="KV block size in tokens (128 on the CPU backend)")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    kv_cache_memory_bytes: int | None = Field(default=512 * 2**20, gt=0)
    kv_bytes_per_token: int | None = Field(
        default=None, gt=0, description="for the HBM ledger's capacity; derived from the model config if unset"
    )
    enforce_eager: bool = True
    max_num_seqs: int = Field(default=16, gt=0)
    seed: int = 0
    kv_events: bool = Field(default=True, description="publish vLLM KV events; the replica reports exact HBM keys")
    cache_salt: str = ""
    reasoning_parser: str | None = Field(
        default=None, description="vLLM reasoning parser (e.g. qwen3): the engine ends structured-output constraints "
                                  "at the end of reasoning, the ingress splits `reasoning` from `content`")

    def vllm_engine_kwargs(self) -> dict[str, Any]:
        """The vLLM engine arguments these settings stand for (``AsyncEngineArgs`` keywords): the replica's engine
        adds its connector, KV events and CPU binding to them; ``kvstack bench oracle`` starts plain vLLM's own
        server with exactly these."""
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.model_path,
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
        return kwargs

    def hbm_capacity_blocks(self) -> int:
        """KV blocks the engine can hold (for the router's HBM prefix estimate)."""
        if self.kv_cache_memory_bytes is None:
            return 1 << 20
        per_token = self.kv_bytes_per_token or kv_bytes_per_token_from_model(self.model_path)
        return max(1, self.kv_cache_memory_bytes // (per_token * self.block_size))


def kv_bytes_per_token_from_model(model_path: str) -> int:
    """2 (K,V) x kv heads x head dim x full-attention layers x dtype bytes, from the HF config.json."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types:
        layers = sum(1 for t in layer_types if t == "full_attention")
    elif cfg.get("full_attention_interval"):
        layers = layers // int(cfg["full_attention_interval"])
    return 2 * heads * head_dim * layers * 2


def pool_slot_bytes_from_model(model_path: str, block_size: int) -> int:
    """One pool slot: a block of every full-attention layer, or a hybrid's linear-state snapshot (gated delta net:
    conv tail + recurrent state over all linear layers, bf16 as the CPU build keeps them), whichever is larger.
    The connector refuses a pool whose slots are smaller than what its registered layout needs."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    attention = kv_bytes_per_token_from_model(model_path) * block_size
    linear = sum(1 for t in cfg.get("layer_types") or () if t == "linear_attention")
    if not linear:
        return attention
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv = (cfg.get("linear_conv_kernel_dim", 4) - 1) * (2 * nk * dk + nv * dv) * 2
    return max(attention, linear * (conv + nv * dk * dv * 2))
