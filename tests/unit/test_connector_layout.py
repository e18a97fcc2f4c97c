"""Unit tests of the connector's layout derivation and config (real vLLM spec classes, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

torch = pytest.importorskip("torch")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface")

from kvpool.connector.config import ConnectorConfig, ShardRef  # noqa: E402
from kvpool.connector.layout import (  # noqa: E402
    TensorInfo,
    derive_layout,
    group_kinds,
    pool_plan,
    spec_kind,
    state_key,
    tensor_info,
)
from kvpool.keys import BlockKey  # noqa: E402
from kvpool.layout import LayoutError, UnknownLayoutKindError  # noqa: E402

BASE = 1 << 20
PAGE = 65536  # CPU layout page: 2 heads x 128 tokens x 2*64 dims x 2 bytes


def full_spec(dtype: object = None, **kw: object) -> object:
    return kvi.FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype or torch.bfloat16, **kw)


def kv_config(groups: list[tuple[object, list[str]]], num_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in groups],
    )


def dense(num_blocks: int = 64, layers: int = 4, elem: int = 2, dtype: str = "torch.bfloat16"):
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_bytes = num_blocks * PAGE
    infos = {
        n: TensorInfo((num_blocks, 2, 128, 128), (PAGE // elem, 128 * 128, 128, 1), dtype, elem,
                      BASE + i * layer_bytes, BASE, layers * layer_bytes)
        for i, n in enumerate(names)
    }
    return names, infos


def test_dense_layout_geometry_and_fingerprint() -> None:
    names, infos = dense()
    cfg = kv_config([(full_spec(), names)], 64)
    layout, geo, storages = derive_layout("m", "d1", cfg, infos)
    assert storages == [(BASE, 4 * 64 * PAGE)]
    assert geo.block_payload == 4 * PAGE and geo.state_payload == 0
    pieces = geo.pieces(geo.block_groups, {0: 3})
    assert pieces == [(0, i * 64 * PAGE + 3 * PAGE, PAGE) for i in range(4)]
    assert [g.kind for g in layout.groups] == ["full_attention"]
    assert layout.groups[0].layer_indices == (0, 1, 2, 3)
    again, _, _ = derive_layout("m", "d1", cfg, infos)
    assert again.fingerprint == layout.fingerprint


def test_fingerprint_ignores_cache_size_but_not_model_or_dtype() -> None:
    names, infos = dense(64)
    fp = derive_layout("m", "d1", kv_config([(full_spec(), names)], 64), infos)[0].fingerprint
    names2, infos2 = dense(128)
    assert derive_layout("m", "d1", kv_config([(full_spec(), names2)], 128), infos2)[0].fingerprint == fp
    assert derive_layout("m", "d2", kv_config([(full_spec(), names)], 64), infos)[0].fingerprint != fp
    names3, infos3 = dense(64, dtype="torch.float16")
    fp16 = derive_layout("m", "d1", kv_config([(full_spec(torch.float16), names3)], 64), infos3)[0].fingerprint
    assert fp16 != fp


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        (kvi.ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                       attention_chunk_size=256), "ChunkedLocalAttentionSpec"),
        (kvi.SinkFullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                   sink_len=4), "SinkFullAttentionSpec"),
        (full_spec(sliding_window=64), "full_attention_windowed"),
    ],
)
def test_unknown_kinds_are_refused_by_name(spec: object, kind: str) -> None:
    assert spec_kind(spec) == kind
    with pytest.raises(UnknownLayoutKindError, match=kind):
        group_kinds(kv_config([(spec, ["model.layers.0.attn"])], 8))


def test_known_but_not_offloaded_kind_turns_the_pool_off() -> None:
    sw = kvi.SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    plan = pool_plan(group_kinds(kv_config([(full_spec(), ["a.0.x"]), (sw, ["a.1.x"])], 8)))
    assert not plan.usable and "sliding_window" in plan.why_unusable


def test_block_dimension_must_be_outermost() -> None:
    names, _ = dense(8, layers=1)
    infos = {names[0]: TensorInfo((2, 8, 128, 2, 64), (8 * 128 * 128, 128 * 128, 128, 64, 1), "torch.bfloat16", 2,
                                  BASE, BASE, 2 * 8 * PAGE)}
    with pytest.raises(LayoutError, match="outermost"):
        derive_layout("m", "d", kv_config([(full_spec(), names)], 8), infos)


def test_a_kv_cache_outside_host_memory_is_refused_with_its_device() -> None:
    names, infos = dense()
    cfg = kv_config([(full_spec(), names)], 64)
    on_gpu = {n: msgspec.structs.replace(i, device="cuda:0") if n == names[2] else i for n, i in infos.items()}
    with pytest.raises(LayoutError, match=r"layers\.2\..*cuda:0.*host memory.*app\.pool\.enabled: false"):
        derive_layout("m", "d1", cfg, on_gpu)
    derive_layout("m", "d1", cfg, infos)  # the same tensors in host memory: accepted


def test_tensor_info_reads_the_device() -> None:
    t = torch.zeros((4, 2, 8, 16), dtype=torch.bfloat16)
    info = tensor_info(t)
    assert info.device == "cpu" and info.shape == (4, 2, 8, 16) and info.element_size == 2
    assert info.storage_nbytes == 4 * 2 * 8 * 16 * 2


def test_hybrid_state_pages_share_storage_with_attention() -> None:
    mamba = kvi.MambaSpec(block_size=128, shapes=((3, 512), (4, 64, 64)), dtypes=(torch.bfloat16, torch.bfloat16),
                          page_size_padded=PAGE, mamba_type="gdn_attn", mamba_cache_mode="align")
    n = 32
    lin = [f"model.layers.{i}.linear_attn" for i in range(3)]
    att = "model.layers.3.self_attn.attn"
    infos = {name: TensorInfo((n, 1, 1, 35840), (PAGE, 35840, 35840, 1), "torch.int8", 1, BASE, BASE, n * PAGE)
             for name in lin}
    infos[att] = TensorInfo((n, 2, 128, 128), (PAGE // 2, 128 * 128, 128, 1), "torch.bfloat16", 2, BASE, BASE, n * PAGE)
    cfg = kv_config([(mamba, [lin[0]]), (mamba, [lin[1]]), (mamba, [lin[2]]), (full_spec(), [att])], n)
    layout, geo, storages = derive_layout("m", "d", cfg, infos)
    assert len(storages) == 1
    assert geo.block_payload == PAGE and geo.state_payload == 3 * 35840
    assert geo.slot_bytes_needed == 3 * 35840
    assert [g.kind for g in layout.groups] == ["linear_state"] * 3 + ["full_attention"]
    plan = pool_plan(group_kinds(cfg))
    assert plan.usable and plan.hybrid and plan.state_groups == (0, 1, 2) and plan.block_groups == (3,)
    assert geo.pieces(geo.state_groups, {0: 5, 1: 6, 2: 7}) == [(0, b * PAGE, 35840) for b in (5, 6, 7)]


def test_state_key_is_deterministic_and_disjoint_from_block_keys() -> None:
    k = BlockKey(bytes(range(16)))
    assert state_key(k) == state_key(k) and state_key(k) != k and len(state_key(k)) == 16


def test_connector_config_parsing() -> None:
    assert ConnectorConfig.from_extra({}) == ConnectorConfig()
    cfg = ConnectorConfig(shards=[ShardRef("s", "actor-s", "n")], local_shard="s", backend="tcp")
    assert ConnectorConfig.from_extra(cfg.to_extra()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra({"kvpool": {}, "typo": 1})
    with pytest.raises(ValueError, match="bad configuration"):
        ConnectorConfig.from_extra({"kvpool": {"lookup_deadline": 1}})
    with pytest.raises(ValueError, match="local_shard"):
        ConnectorConfig(shards=[ShardRef("s", "a")], local_shard="other")
    with pytest.raises(ValueError, match="positive"):
        ConnectorConfig(lease_ttl_s=0)
    assert ConnectorConfig().saver_nice == 19  # the saver yields the worker's core to the forward pass
    assert ConnectorConfig.from_extra(ConnectorConfig(saver_nice=0).to_extra()).saver_nice == 0
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="saver_nice"):
            ConnectorConfig(saver_nice=bad)
    assert ConnectorConfig().saver_max_lag_s == 1.0  # a save waits at most this long for the lowered saver
    assert ConnectorConfig.from_extra(ConnectorConfig(saver_max_lag_s=0.0).to_extra()).saver_max_lag_s == 0.0
    with pytest.raises(ValueError, match="saver_max_lag_s"):
        ConnectorConfig(saver_max_lag_s=-0.5)
