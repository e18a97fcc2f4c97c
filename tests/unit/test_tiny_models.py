"""Unit tests of the tiny-model specs and the ``kvstack models`` command's argument handling (no model is built;
building is covered by the e2e fixtures, which build once and reuse by digest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.tiny_models import MARKER_FILE, make_tiny, preset_spec


def test_presets_and_digest() -> None:
    tiny, heavy = preset_spec("qwen3"), preset_spec("qwen3", "heavy")
    assert tiny.digest() == preset_spec("qwen3").digest()
    assert heavy.digest() != tiny.digest()
    assert heavy.heads // heavy.kv_heads == 4 and heavy.hidden > tiny.hidden
    assert preset_spec("qwen3", layers=6).digest() != tiny.digest()
    nxt = preset_spec("qwen3-next")
    assert nxt.layer_types() == ["linear_attention"] * 3 + ["full_attention"]
    assert tiny.initializer_range == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "llama"}, "unknown arch"),
        ({"arch": "qwen3", "heads": 3}, "multiple of kv_heads"),
        ({"arch": "qwen3-next", "layers": 6}, "full_attention_interval"),
        ({"arch": "qwen3", "nonsense": 1}, "unknown spec field"),
    ],
)
def test_invalid_specs_are_refused(kwargs: dict, match: str) -> None:
    arch = kwargs.pop("arch")
    with pytest.raises(ValueError, match=match):
        preset_spec(arch, "tiny", **kwargs)


def test_make_tiny_never_overwrites_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="not a kvstack tiny model"):
        make_tiny(preset_spec("qwen3"), tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / MARKER_FILE).write_text('{"digest": "0000"}')
    (other / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="another tiny model"):
        make_tiny(preset_spec("qwen3"), other)


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "make-tiny", "--arch", "qwen3", "--out", str(tmp_path / "m"), "--heads", "3"]) == 2
    assert "multiple of kv_heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["models", "make-tiny", "--arch", "gpt2", "--out", str(tmp_path)])
