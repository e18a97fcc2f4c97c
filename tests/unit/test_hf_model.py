"""The cost model's spec comes from the model's own files (``configs.hf_model``): generated tiny models of shapes no
spec file lists, a hybrid with a mixture of experts, and configs of real architectures (sliding windows, a nested
text config), checked against counts made here from the same files."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from cluster.tiny_models import make_tiny, preset_spec
from configs import load_models
from configs.hf_model import (ModelFileError, active_parameters, model_spec, model_spec_from_config, pool_slot_bytes,
                              pricing_spec, read_config, tensor_shapes)
from deployments.engine_settings import kv_bytes_per_token_from_model, pool_slot_bytes_from_model


@pytest.fixture(scope="module")
def odd_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 layers, 6 query heads over 3 KV heads: a shape no spec file has."""
    spec = preset_spec("qwen3", layers=6, heads=6, kv_heads=3, hidden=384)
    return make_tiny(spec, tmp_path_factory.mktemp("odd") / "tiny-odd")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(preset_spec("qwen3-next"), tmp_path_factory.mktemp("hybrid") / "tiny-next")


def _header_parameters(model: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for file in model.glob("*.safetensors"):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out.update({k: math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def test_a_dense_model_of_a_new_shape_gets_its_own_spec(odd_dense: Path) -> None:
    spec = model_spec(str(odd_dense), "odd")
    assert (spec.layers, spec.full_attention_layers, spec.linear_attention_layers) == (6, 6, 0)
    assert (spec.n_q, spec.n_kv, spec.head_dim, spec.dtype) == (6, 3, 64, "bf16")
    assert spec.hf_architecture == "Qwen3ForCausalLM" and not any(
        s.n_kv == 3 and s.layers == 6 for s in load_models().values())
    counts = _header_parameters(odd_dense)
    assert spec.params == sum(counts.values()) - counts["model.embed_tokens.weight"]  # a lookup is no matmul
    assert spec.kv_bytes_per_token() == 2 * 3 * 64 * 6 * 2 == kv_bytes_per_token_from_model(str(odd_dense))
    assert pool_slot_bytes_from_model(str(odd_dense), 128) == pool_slot_bytes(spec, 128) == 2 * 3 * 64 * 6 * 2 * 128


def test_the_pool_slot_and_the_ledger_follow_the_engines_kv_element_type(odd_dense: Path) -> None:
    """A float32 engine's blocks are twice a bfloat16 one's, an fp8 KV cache's half: the slots the pool is sized
    with and the blocks the HBM ledger counts follow ``app.engine.dtype`` and ``kv_cache_dtype`` (the slots were
    bfloat16-sized whatever the engine, and the connector refused the pool of a float32 engine)."""
    from deployments.engine_settings import EngineSettings
    from deployments.pool_setup import block_slot_bytes

    bf16 = 2 * 3 * 64 * 6 * 2
    assert kv_bytes_per_token_from_model(str(odd_dense), "float32") == 2 * bf16
    assert kv_bytes_per_token_from_model(str(odd_dense), "auto") == bf16  # the config's torch_dtype
    assert pool_slot_bytes_from_model(str(odd_dense), 128, "float32", "fp8") == bf16 // 2 * 128
    f32 = EngineSettings(model=str(odd_dense), dtype="float32", kv_cache_memory_bytes=64 * 2 * bf16 * 128)
    assert f32.kv_dtypes() == ("float32", None)
    assert block_slot_bytes(f32) == 2 * bf16 * 128
    assert f32.hbm_capacity_blocks() == 64
    assert block_slot_bytes(EngineSettings(model=str(odd_dense))) == bf16 * 128


def test_a_hybrid_counts_its_linear_layers_and_only_the_routed_experts(hybrid: Path) -> None:
    spec = model_spec(str(hybrid))
    assert (spec.full_attention_layers, spec.linear_attention_layers) == (1, 3)
    assert spec.linear_state is not None and spec.linear_state.num_value_heads == 4
    counts = _header_parameters(hybrid)
    experts = sum(n for k, n in counts.items() if ".experts." in k)
    assert experts > 0
    assert spec.params == sum(counts.values()) - counts["model.embed_tokens.weight"] - experts // 2  # top-2 of 4
    # the same layout the pool's slots were sized with before (gated delta net state, bf16 as the CPU build keeps it)
    cfg = read_config(str(hybrid))
    nk, nv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    state = 3 * ((4 - 1) * (2 * nk * dk + nv * dv) * 2 + nv * dk * dv * 2)
    assert pool_slot_bytes_from_model(str(hybrid), 128) == max(2 * 2 * 64 * 1 * 2 * 128, state)


def test_real_architecture_configs() -> None:
    gemma_like = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 1152, "sliding_window": 512,
                  "torch_dtype": "float16",
                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    spec = model_spec_from_config("g", gemma_like, 1e9, dtype="fp16")
    assert (spec.full_attention_layers, spec.sliding_window_layers, spec.sliding_window) == (6, 5, 512)
    multimodal = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                  "text_config": {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
                                  "hidden_size": 2048}}
    spec = model_spec_from_config("vl", multimodal, 3e9)
    assert (spec.layers, spec.n_q, spec.n_kv, spec.head_dim) == (4, 16, 2, 128)
    moe = {"num_experts": 8, "num_experts_per_tok": 2}
    assert active_parameters({"a.experts.0.w": (10, 10), "b.attn.w": (10, 10), "lm_head.weight": (4, 4),
                              "model.embed_tokens.weight": (4, 4)}, moe) == 25 + 100 + 16


def test_engine_dtype_and_kv_cache_dtype_set_the_element_size(odd_dense: Path) -> None:
    assert model_spec(str(odd_dense), engine_dtype="float32").dtype == "fp32"
    assert model_spec(str(odd_dense), kv_cache_dtype="fp8").dtype == "fp8"


def test_a_named_override_wins_and_a_missing_model_is_a_clear_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert pricing_spec("/nonexistent", "qwen3-14b").name == "qwen3-14b"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFileError, match=r"model 'no-such-org/no-such-model' \(Hugging Face id"):
        read_config("no-such-org/no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="directory.*config.json"):
        read_config(str(tmp_path / "empty"))
    assert tensor_shapes(str(tmp_path / "empty")) is None
