"""configs: the shipped YAML loads into typed specs; malformed files fail with the file and key named."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from configs import ConfigError, UnknownNameError, load_gpus, load_models, load_tiers, pick

DENSE = """\
m1:
  params: 1.0e9
  layers: 4
  full_attention_layers: 4
  n_q: 8
  n_kv: 2
  head_dim: 64
"""


def _write(tmp_path: Path, text: str, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_models() -> None:
    models = load_models()
    assert {"qwen3-14b", "qwen3.5-27b", "tiny-qwen3", "tiny-qwen3-heavy", "tiny-qwen3-next"} <= set(models)
    q = models["qwen3-14b"]
    assert (q.params, q.layers, q.full_attention_layers, q.n_q, q.n_kv, q.head_dim, q.dtype) == (
        14e9, 40, 40, 40, 8, 128, "bf16")
    assert not q.is_hybrid and q.linear_state_bytes() == 0
    h = models["qwen3.5-27b"]
    assert (h.params, h.layers, h.full_attention_layers, h.linear_attention_layers, h.n_q, h.n_kv, h.head_dim) == (
        27e9, 64, 16, 48, 24, 4, 256)
    assert h.is_hybrid
    # derived state: 48 layers x (fp32 48·128·128 recurrent + bf16 3·(2·16·128 + 48·128) conv tail)
    assert h.linear_state_bytes() == 48 * (48 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 48 * 128) * 2)


def test_shipped_tiny_models() -> None:
    models = load_models()
    for name in ("tiny-qwen3", "tiny-qwen3-heavy", "tiny-qwen3-next"):
        assert models[name].description == "tiny generated test model (kvstack models make-tiny)"
        assert models[name].params < 2e8
    assert not models["tiny-qwen3"].is_hybrid
    heavy = models["tiny-qwen3-heavy"]
    from cluster.tiny_models import preset_spec

    built = preset_spec("qwen3", "heavy")  # the cost model's view must match the model the generator builds
    assert (heavy.layers, heavy.n_q, heavy.n_kv, heavy.head_dim) == (
        built.layers, built.heads, built.kv_heads, built.head_dim)
    assert heavy.n_q > heavy.n_kv  # GQA
    nxt = models["tiny-qwen3-next"]
    assert nxt.is_hybrid and nxt.full_attention_layers == 1 and nxt.linear_attention_layers == 3
    # 3 layers x (fp32 4·64·64 recurrent + bf16 3·(2·2·64 + 4·64) conv tail)
    assert nxt.linear_state_bytes() == 3 * (4 * 64 * 64 * 4 + 3 * (2 * 2 * 64 + 4 * 64) * 2)


def test_shipped_gpus_and_tiers() -> None:
    gpus = load_gpus()
    expected = {
        "a100-sxm4-80gb": (312, 2039, 80),
        "h100-sxm5-80gb": (989, 3350, 80),
        "h200-sxm5-141gb": (989, 4800, 141),
        "b100-sxm-192gb": (1750, 8000, 192),
        "b200-sxm-192gb": (2250, 8000, 192),
        "cpu-2core": (0.2, 10, 4),
    }
    assert {n: (g.bf16_tflops, g.hbm_gbps, g.hbm_gib) for n, g in gpus.items()} == expected
    tiers = load_tiers()
    reference = {"hbm": 4078, "cpu-dram": 120, "rdma-pool": 50, "local-ssd": 10, "remote-block": 0.35}
    assert {n: tiers[n].bandwidth_gbps for n in reference} == reference
    assert all(tiers[n].latency_s == 0 for n in reference)
    # the measured tiers of this CI box that configs/local.yaml prices with
    assert tiers["box-loopback-dram"].latency_s > 0 and tiers["box-ssd"].bandwidth_gbps < 1


def test_custom_file_loads(tmp_path: Path) -> None:
    models = load_models(_write(tmp_path, DENSE))
    assert list(models) == ["m1"] and models["m1"].name == "m1" and models["m1"].dtype == "bf16"


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, DENSE + "  n_kv_heads: 2\n")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    msg = str(err.value)
    assert str(path) in msg and "m1.n_kv_heads" in msg and "unknown key" in msg


def test_unknown_nested_key_names_the_path(tmp_path: Path) -> None:
    text = DENSE.replace("full_attention_layers: 4", "full_attention_layers: 2\n  linear_attention_layers: 2") + (
        "  linear_state: {num_key_heads: 2, num_value_heads: 4, key_head_dim: 64, value_head_dim: 64, bogus: 1}\n")
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"m1\.linear_state\.bogus: unknown key") as err:
        load_models(path)
    assert str(path) in str(err.value)


def test_unknown_tier_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "fast: {bandwidth_gbps: 10, latency_ms: 3}\n", "tiers.yaml")
    with pytest.raises(ConfigError, match=r"tiers\.yaml: fast\.latency_ms: unknown key"):
        load_tiers(path)


def test_invalid_layer_sum_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, DENSE.replace("full_attention_layers: 4", "full_attention_layers: 3"))
    with pytest.raises(ConfigError, match=r"full_attention_layers \(3\) \+ linear_attention_layers \(0\) != layers"):
        load_models(path)
    hybrid = DENSE.replace("full_attention_layers: 4", "full_attention_layers: 1\n  linear_attention_layers: 2")
    with pytest.raises(ConfigError, match="!= layers"):
        load_models(_write(tmp_path, hybrid))


def test_invalid_values_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of n_kv"):
        load_models(_write(tmp_path, DENSE.replace("n_kv: 2", "n_kv: 3")))
    with pytest.raises(ConfigError, match=r"m1\.dtype"):
        load_models(_write(tmp_path, DENSE + "  dtype: int3\n"))
    with pytest.raises(ConfigError, match=r"m1\.head_dim"):
        load_models(_write(tmp_path, DENSE.replace("head_dim: 64", "head_dim: 0")))
    with pytest.raises(ConfigError, match=r"g\.bf16_tflops"):
        load_gpus(_write(tmp_path, "g: {hbm_gbps: 1, hbm_gib: 1}\n", "gpus.yaml"))


def test_malformed_files_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_models(_write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(ConfigError, match="cannot read YAML"):
        load_models(_write(tmp_path, "a: [unclosed\n"))
    with pytest.raises(ConfigError, match="cannot read YAML"):
        load_models(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="m1: expected a mapping of fields"):
        load_models(_write(tmp_path, "m1: 3\n"))


def test_unknown_name_lists_known_names() -> None:
    models = load_models()
    with pytest.raises(UnknownNameError) as err:
        pick("model", models, "qwen9")
    assert err.value.known == sorted(models)
    assert str(err.value).startswith("unknown model 'qwen9'; known models: ")
    for name in models:
        assert name in str(err.value)
    assert pick("model", models, "qwen3-14b") is models["qwen3-14b"]


def test_specs_are_frozen() -> None:
    q = load_models()["qwen3-14b"]
    with pytest.raises(ValidationError, match="frozen"):
        q.n_kv = 4  # type: ignore[misc]
