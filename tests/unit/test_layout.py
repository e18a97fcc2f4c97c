"""KV layout descriptions, the kind registry and the fingerprint (kvpool/layout.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvpool.layout import (
    KIND_REGISTRY,
    KvLayout,
    LayerGroupLayout,
    LayoutError,
    Reuse,
    UnknownDTypeError,
    UnknownLayoutKindError,
    attention_group,
    canonical_dtype,
    kind_info,
    state_group,
)


def full_attn(n_layers: int = 4, *, first: int = 0, dtype: str = "bfloat16", block: int = 16) -> LayerGroupLayout:
    return attention_group(
        "full_attention",
        [f"model.layers.{i}.self_attn.attn" for i in range(first, first + n_layers)],
        list(range(first, first + n_layers)),
        block_size=block,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        tensor_shape=(2, 128, block, 2, 64),
        tensor_strides=(128 * block * 128, block * 128, 128, 64, 1),
    )


def dense_layout() -> KvLayout:
    return KvLayout("qwen3-tiny", (full_attn(),))


def hybrid_layout() -> KvLayout:
    lin = state_group(
        "linear_state",
        ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"],
        [0, 1, 2],
        block_size=64,
        dtype="float32",
        tensor_shape=(128, 4, 32, 32),
        tensor_strides=(4096, 1024, 32, 1),
        state_bytes_per_layer=4 * 32 * 32 * 4,
        num_heads=4,
        head_dim=32,
    )
    return KvLayout("qwen3-next-tiny", (lin, full_attn(1, first=3, block=64)))


def test_attention_bytes_per_block() -> None:
    g = full_attn(4)
    assert g.bytes_per_block == 2 * 16 * 2 * 64 * 2 * 4  # K+V · block · heads · dim · bf16 · layers
    assert g.element_bytes == 2


def test_registry_says_how_each_kind_is_reused() -> None:
    assert kind_info("full_attention") == KIND_REGISTRY["full_attention"]
    assert kind_info("full_attention").reuse is Reuse.PER_BLOCK and kind_info("full_attention").offloaded
    assert kind_info("mla").reuse is Reuse.PER_BLOCK and kind_info("mla").offloaded
    assert not kind_info("sliding_window").offloaded  # documented choice: not offloaded for now
    for k in ("linear_state", "mamba"):
        assert kind_info(k).reuse is Reuse.BOUNDARY_SNAPSHOT and kind_info(k).offloaded
    for k in ("cross_attention", "encoder"):
        assert kind_info(k).reuse is Reuse.NEVER and not kind_info(k).offloaded


def test_unknown_kind_is_refused_with_a_clear_message() -> None:
    with pytest.raises(UnknownLayoutKindError) as exc:
        attention_group("paged_magic", ["l0"], [0], block_size=16, num_kv_heads=1, head_dim=8, dtype="bf16",
                        tensor_shape=(1,), tensor_strides=(1,))
    msg = str(exc.value)
    assert "paged_magic" in msg
    for known in KIND_REGISTRY:
        assert known in msg
    with pytest.raises(UnknownLayoutKindError):
        kind_info("")


def test_decoding_an_unknown_kind_is_refused() -> None:
    raw = dense_layout().encode().replace(b'"full_attention"', b'"mystery_attention"')
    with pytest.raises(msgspec.ValidationError, match="mystery_attention"):
        KvLayout.decode(raw)


def test_unknown_and_aliased_dtypes() -> None:
    assert canonical_dtype("torch.bfloat16") == "bfloat16"
    assert canonical_dtype("bf16") == "bfloat16"
    assert canonical_dtype("fp8") == "float8_e4m3fn"
    with pytest.raises(UnknownDTypeError, match="float7"):
        canonical_dtype("float7")
    with pytest.raises(LayoutError, match="canonical"):
        LayerGroupLayout("full_attention", ("a",), (0,), 16, 1, 8, "bf16", (1,), (1,), 10)


def test_roundtrip_keeps_fingerprint() -> None:
    for layout in (dense_layout(), hybrid_layout()):
        back = KvLayout.decode(layout.encode())
        assert back == layout
        assert back.fingerprint == layout.fingerprint
        assert len(layout.fingerprint) == 32


def test_fingerprint_is_stable_across_processes() -> None:
    code = "from tests.unit.test_layout import hybrid_layout; print(hybrid_layout().fingerprint)"
    repo = Path(__file__).resolve().parents[2]  # `python -c` imports from its working directory
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == hybrid_layout().fingerprint


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "mla"},
        {"layer_names": ("x0", "x1", "x2", "x3")},
        {"layer_indices": (4, 5, 6, 7)},
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"dtype": "float16"},
        {"tensor_shape": (128, 2, 16, 2, 64)},
        {"tensor_strides": (1, 2, 3, 4, 5)},
        {"bytes_per_block": 1},
    ],
)
def test_fingerprint_covers_every_field(change: dict) -> None:
    base = dense_layout()
    changed = KvLayout(base.model_id, (msgspec.structs.replace(base.groups[0], **change),))
    assert changed.fingerprint != base.fingerprint


def test_fingerprint_covers_model_and_group_order() -> None:
    h = hybrid_layout()
    assert KvLayout("other", h.groups).fingerprint != h.fingerprint
    assert KvLayout(h.model_id, tuple(reversed(h.groups))).fingerprint != h.fingerprint


def test_hybrid_and_offloaded_bytes() -> None:
    h = hybrid_layout()
    assert h.is_hybrid()
    assert not dense_layout().is_hybrid()
    assert h.offloaded_bytes_per_block() == sum(g.bytes_per_block for g in h.groups)
    sw = attention_group("sliding_window", ["sw0"], [9], block_size=16, num_kv_heads=2, head_dim=64,
                         dtype="bfloat16", tensor_shape=(2, 8, 16, 2, 64), tensor_strides=(16384, 2048, 128, 64, 1))
    with_sw = KvLayout("m", (full_attn(), sw))
    assert with_sw.offloaded_groups() == (with_sw.groups[0],)
    assert with_sw.offloaded_bytes_per_block() == full_attn().bytes_per_block


def test_inconsistent_layouts_are_refused() -> None:
    with pytest.raises(LayoutError, match="more than one group"):
        KvLayout("m", (full_attn(2), full_attn(2, first=1)))
    with pytest.raises(LayoutError, match="at least one"):
        KvLayout("m", ())
    with pytest.raises(LayoutError, match="one index per layer"):
        LayerGroupLayout("full_attention", ("a", "b"), (0,), 16, 1, 8, "bfloat16", (1,), (1,), 10)
    with pytest.raises(LayoutError, match="shape"):
        LayerGroupLayout("full_attention", ("a",), (0,), 16, 1, 8, "bfloat16", (1, 2), (1,), 10)
    with pytest.raises(LayoutError, match="boundary-snapshot"):
        state_group("full_attention", ["a"], [0], block_size=16, dtype="float32", tensor_shape=(1,),
                    tensor_strides=(1,), state_bytes_per_layer=8)
    with pytest.raises(LayoutError, match="version"):
        KvLayout("m", (full_attn(),), version=99)
