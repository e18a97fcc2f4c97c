"""The cost model's view of a model, read from the model's own files: its Hugging Face ``config.json`` and the
headers of its safetensors files.

``model_spec(model)`` is the ``configs.schema.ModelSpec`` the router prices with when ``app.router.model_spec`` names
no override in ``configs/specs/models.yaml``: layers, query / KV heads, head dim, full- vs linear-attention layers
(``layer_types`` or Qwen3-Next's ``full_attention_interval``), the gated-delta-net state of linear layers, sliding
windows, the dtype (the engine's, when it sets one) and the parameter count. Parameters are what a token's forward
pass multiplies by (the cost model's ``2·N`` FLOPs per token): every tensor of the checkpoint, less the input
embedding when the LM head is a tensor of its own (a lookup is no matmul), and only the routed share
(``num_experts_per_tok / num_experts``) of a mixture of experts' expert tensors. Without safetensors the count is
estimated from the config's shapes.

``model`` is a local directory or a Hugging Face id; an id is read through ``huggingface_hub`` (its cache, or the hub
where it is reachable; only ``config.json`` and the safetensors headers, never the weights). Who calls it: the router
(``router.live_view``), the app's pool sizing and HBM ledger (``deployments.engine_settings``), ``kvstack bench
reuse``. ``ModelFileError`` names the model and what is missing.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from configs.schema import DType, LinearStateSpec, ModelSpec

_TORCH_DTYPES: dict[str, DType] = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                                   "float": "fp32"}
_KV_CACHE_DTYPES: dict[str, DType] = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bfloat16": "bf16",
                                      "float16": "fp16"}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class ModelFileError(ValueError):
    """A model's files cannot be read: the message names the model and the file."""


def _local_dir(model: str) -> Path | None:
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def read_config(model: str) -> dict[str, Any]:
    """The model's ``config.json`` as a mapping (a directory's file, or the hub's through its cache)."""
    local = _local_dir(model)
    try:
        if local is not None:
            return json.loads((local / "config.json").read_text())
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as exc:  # noqa: BLE001 - OSError, the hub's errors, bad JSON: one clear message
        kind = "directory" if local is not None else "Hugging Face id (not a local directory)"
        raise ModelFileError(f"model {model!r} ({kind}): cannot read config.json: {type(exc).__name__}: {exc}"
                             ) from None


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (a multimodal model nests it under ``text_config``)."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, Mapping) else dict(cfg)


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def tensor_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape from the safetensors headers (None when the model has no safetensors files)."""
    local = _local_dir(model)
    shapes: dict[str, tuple[int, ...]] = {}
    if local is not None:
        files = sorted(local.glob("*.safetensors"))
        if not files:
            return None
        for file in files:
            for name, info in _safetensors_header(file).items():
                if name != "__metadata__":
                    shapes[name] = tuple(info["shape"])
        return shapes
    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(model)
    except Exception:  # noqa: BLE001 - offline, no safetensors: the config's shapes estimate the count
        return None
    for file_meta in meta.files_metadata.values():
        for name, info in file_meta.tensors.items():
            shapes[name] = tuple(info.shape)
    return shapes


def active_parameters(shapes: Mapping[str, Iterable[int]], cfg: Mapping[str, Any]) -> int:
    """Parameters a token's forward pass multiplies by (see the module docstring)."""
    counts = {name: math.prod(shape) for name, shape in shapes.items()}
    if any("lm_head" in name for name in counts):
        counts = {name: n for name, n in counts.items() if "embed_tokens" not in name}
    text = text_config(cfg)
    experts = next((int(text[k]) for k in _EXPERT_COUNT_KEYS if text.get(k)), 0)
    routed = int(text.get("num_experts_per_tok") or 0)
    share = routed / experts if experts and routed else 1.0
    return int(sum(n * share if ".experts." in name else n for name, n in counts.items()))


def estimated_parameters(cfg: Mapping[str, Any]) -> int:
    """Matmul parameters from a dense config's shapes: attention and a gated MLP per layer, plus the LM head."""
    t = text_config(cfg)
    hidden, layers = int(t["hidden_size"]), int(t["num_hidden_layers"])
    n_q = int(t["num_attention_heads"])
    n_kv = int(t.get("num_key_value_heads") or n_q)
    d = int(t.get("head_dim") or hidden // n_q)
    attention = hidden * (n_q * d + 2 * n_kv * d) + n_q * d * hidden
    mlp = 3 * hidden * int(t.get("intermediate_size") or 4 * hidden)
    return layers * (attention + mlp) + hidden * int(t.get("vocab_size") or 0)


def _layer_counts(t: Mapping[str, Any]) -> tuple[int, int, int]:
    """(full-attention layers, linear-attention layers, of the full ones: sliding-window layers)."""
    layers = int(t["num_hidden_layers"])
    types = t.get("layer_types")
    if types:
        linear = sum(1 for kind in types if kind == "linear_attention")
        sliding = sum(1 for kind in types if kind == "sliding_attention")
        return len(types) - linear, linear, sliding
    if t.get("full_attention_interval"):
        full = layers // int(t["full_attention_interval"])
        return full, layers - full, 0
    sliding = layers if t.get("sliding_window") and t.get("use_sliding_window", True) else 0
    return layers, 0, sliding


def spec_dtype(cfg: Mapping[str, Any], engine_dtype: str | None = None, kv_cache_dtype: str | None = None) -> DType:
    """The KV cache's element type: the engine's ``kv_cache_dtype`` if set, else its ``dtype``, else the config's."""
    if kv_cache_dtype and kv_cache_dtype in _KV_CACHE_DTYPES:
        return _KV_CACHE_DTYPES[kv_cache_dtype]
    for name in (engine_dtype, text_config(cfg).get("torch_dtype"), text_config(cfg).get("dtype")):
        if name and name != "auto" and str(name) in _TORCH_DTYPES:
            return _TORCH_DTYPES[str(name)]
    return "bf16"


def model_spec_from_config(name: str, cfg: Mapping[str, Any], params: float, *, dtype: DType = "bf16") -> ModelSpec:
    """The ModelSpec of a parsed config with ``params`` active parameters."""
    t = text_config(cfg)
    n_q = int(t["num_attention_heads"])
    n_kv = int(t.get("num_key_value_heads") or n_q)
    head_dim = int(t.get("head_dim") or int(t["hidden_size"]) // n_q)
    full, linear, sliding = _layer_counts(t)
    state = None
    if linear:
        state = LinearStateSpec(num_key_heads=int(t["linear_num_key_heads"]),
                                num_value_heads=int(t["linear_num_value_heads"]),
                                key_head_dim=int(t["linear_key_head_dim"]),
                                value_head_dim=int(t["linear_value_head_dim"]),
                                conv_kernel=int(t.get("linear_conv_kernel_dim", 4)),
                                state_dtype=dtype if dtype != "fp8" else "bf16", conv_dtype=dtype if dtype != "fp8"
                                else "bf16")
    architectures = cfg.get("architectures") or [None]
    return ModelSpec(name=name, params=float(params), layers=full + linear, full_attention_layers=full,
                     linear_attention_layers=linear, n_q=n_q, n_kv=n_kv, head_dim=head_dim, dtype=dtype,
                     linear_state=state, sliding_window=int(t["sliding_window"]) if sliding else None,
                     sliding_window_layers=sliding, hf_architecture=architectures[0],
                     description="derived from the model's config.json and safetensors headers")


def model_spec(model: str, name: str | None = None, *, engine_dtype: str | None = None,
               kv_cache_dtype: str | None = None) -> ModelSpec:
    """The ModelSpec of a model directory or Hugging Face id (see the module docstring)."""
    cfg = read_config(model)
    shapes = tensor_shapes(model)
    params = active_parameters(shapes, cfg) if shapes else estimated_parameters(cfg)
    return model_spec_from_config(name or Path(model).name or model, cfg, params,
                                  dtype=spec_dtype(cfg, engine_dtype, kv_cache_dtype))


def pricing_spec(model: str, override: str | None = None, *, name: str | None = None,
                 engine_dtype: str | None = None, kv_cache_dtype: str | None = None) -> ModelSpec:
    """The spec the cost model prices ``model`` with: ``override`` (a name in ``configs/specs/models.yaml``) if set,
    else the one derived from the model's own files."""
    if override is not None:
        from configs.loader import load_models, pick

        return pick("model", load_models(), override)
    return model_spec(model, name, engine_dtype=engine_dtype, kv_cache_dtype=kv_cache_dtype)


def pool_slot_bytes(spec: ModelSpec, block_size: int) -> int:
    """One pool slot: a block of every full-attention layer, or a hybrid's linear-state snapshot (all linear
    layers' conv tail and recurrent state), whichever is larger."""
    return max(spec.kv_bytes_per_token() * block_size, spec.linear_state_bytes())
