"""The weights' identity in the KV namespace (issue 16, item 4): a checkpoint with the same shapes and other weights
at the same path is another identity (so another layout fingerprint: a miss, never the old KV), a byte-identical copy
elsewhere is the same one, and the identity is cached by the files' stamps. Real safetensors files of a generated
tiny model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvpool.connector.weights import weights_identity


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.tiny_models import make_tiny, preset_spec

    return make_tiny(preset_spec("qwen3"), tmp_path_factory.mktemp("weights") / "m")


def _rewrite_weights(directory: Path) -> None:
    """Same tensors, shapes and dtypes (the same safetensors header), other values."""
    from safetensors.torch import load_file, save_file

    for f in sorted(directory.glob("*.safetensors")):
        tensors = load_file(f)
        save_file({k: (v + 1).contiguous() if v.is_floating_point() else v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})


def test_same_shapes_other_weights_is_another_identity(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    before = weights_identity(copy)
    assert weights_identity(tmp_path / "copy") == before == weights_identity(model)  # same bytes, any path
    header_size = {f.name: f.stat().st_size for f in copy.glob("*.safetensors")}
    _rewrite_weights(copy)
    assert {f.name: f.stat().st_size for f in copy.glob("*.safetensors")} == header_size  # sizes did not change
    assert weights_identity(copy) != before


def test_the_identity_goes_into_the_layout_digest(model: Path) -> None:
    from types import SimpleNamespace

    from kvpool.connector.layout import model_digest

    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec="full-attention block 16")])
    a = model_digest("{}", cfg, "auto", weights=weights_identity(model))
    assert a == model_digest("{}", cfg, "auto", weights=weights_identity(model))
    assert a != model_digest("{}", cfg, "auto", weights="another")
    assert a != model_digest("{}", cfg, "auto", weights=weights_identity(model), quantization="fp8")


def test_an_id_without_a_local_snapshot_is_identified_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", os.fspath(tmp_path / "hf"))
    a = weights_identity("no-such-org/no-such-model")
    assert a.startswith("id:") and a != weights_identity("no-such-org/no-such-model", revision="v2")
