"""Typed specs for models, GPUs, storage tiers and engine profiles.

Data only: every other room reads these objects, none of them reads YAML itself. Parsed once by
``configs.loader`` at the entrypoint and passed down. Unknown keys are rejected (``extra="forbid"``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["bf16", "fp16", "fp8", "fp32"]

BYTES_PER_ELEM: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


class Strict(BaseModel):
    """Base for every config object: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class LinearStateSpec(Strict):
    """Gated-delta-net / linear-attention state of one layer (constant size per sequence)."""

    num_key_heads: int = Field(gt=0)
    num_value_heads: int = Field(gt=0)
    key_head_dim: int = Field(gt=0)
    value_head_dim: int = Field(gt=0)
    conv_kernel: int = Field(default=4, gt=0)
    state_dtype: DType = "fp32"
    conv_dtype: DType = "bf16"

    def bytes_per_layer(self) -> int:
        """Recurrent state (v_heads x d_k x d_v) plus the causal-conv tail ((kernel-1) x conv channels)."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * BYTES_PER_ELEM[self.state_dtype]
        conv_channels = 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        conv = (self.conv_kernel - 1) * conv_channels * BYTES_PER_ELEM[self.conv_dtype]
        return recurrent + conv


class ModelSpec(Strict):
    """What the cost model needs to know about a model.

    ``params`` is the nominal parameter count N (the design notes use nominal counts).
    ``full_attention_layers`` grow KV with context; ``linear_attention_layers`` hold a constant state per
    sequence, given directly (``linear_state_bytes_per_seq``) or derived from ``linear_state``.
    """

    name: str
    params: float = Field(gt=0)
    layers: int = Field(gt=0)
    full_attention_layers: int = Field(ge=0)
    linear_attention_layers: int = Field(default=0, ge=0)
    n_q: int = Field(gt=0, description="query heads")
    n_kv: int = Field(gt=0, description="KV heads")
    head_dim: int = Field(gt=0)
    dtype: DType = "bf16"
    linear_state: LinearStateSpec | None = None
    linear_state_bytes_per_seq: int | None = Field(default=None, ge=0)
    sliding_window: int | None = Field(default=None, gt=0, description="tokens a sliding-window layer attends to")
    sliding_window_layers: int = Field(
        default=0, ge=0, description="of the full-attention layers, those with a sliding window (priced as full "
                                     "attention: an upper bound on their KV bytes and FLOPs)")
    hf_architecture: str | None = None
    description: str = ""

    @model_validator(mode="after")
    def _check_layers(self) -> ModelSpec:
        if self.full_attention_layers + self.linear_attention_layers != self.layers:
            raise ValueError(
                f"model {self.name!r}: full_attention_layers ({self.full_attention_layers}) + "
                f"linear_attention_layers ({self.linear_attention_layers}) != layers ({self.layers})"
            )
        if self.sliding_window_layers > self.full_attention_layers:
            raise ValueError(f"model {self.name!r}: sliding_window_layers ({self.sliding_window_layers}) > "
                             f"full_attention_layers ({self.full_attention_layers})")
        if self.n_q % self.n_kv:
            raise ValueError(f"model {self.name!r}: n_q ({self.n_q}) must be a multiple of n_kv ({self.n_kv})")
        return self

    @property
    def bytes_per_elem(self) -> int:
        return BYTES_PER_ELEM[self.dtype]

    def kv_bytes_per_token(self) -> int:
        """K and V of every full-attention layer for one token: 2 · KV heads · head dim · layers · element bytes."""
        return 2 * self.n_kv * self.head_dim * self.full_attention_layers * self.bytes_per_elem

    @property
    def is_hybrid(self) -> bool:
        return self.linear_attention_layers > 0

    def linear_state_bytes(self) -> int:
        """Per-sequence linear-attention state over all linear layers (0 for dense models)."""
        if self.linear_state_bytes_per_seq is not None:
            return self.linear_state_bytes_per_seq
        if self.linear_state is None:
            return 0
        return self.linear_attention_layers * self.linear_state.bytes_per_layer()


class GpuProfile(Strict):
    """A GPU: dense BF16 peak, HBM bandwidth and capacity."""

    name: str
    bf16_tflops: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0, description="HBM bandwidth, GB/s (1e9 bytes/s)")
    hbm_gib: float = Field(gt=0)
    device_names: tuple[str, ...] = Field(
        default=(), description="device names this profile is detected from (torch.cuda.get_device_name; 'cpu')")
    description: str = ""


class TierSpec(Strict):
    """A storage tier KV can be fetched from: bandwidth (GB/s, 1e9) and a fixed per-fetch latency (s)."""

    name: str
    bandwidth_gbps: float = Field(gt=0)
    latency_s: float = Field(default=0.0, ge=0)
    description: str = ""
