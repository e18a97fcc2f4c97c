"""Unit tests of the tiny-model specs, the ``kvstack models`` command's argument handling, and one real build of the
smallest spec (``qwen3`` tiny, into a temporary directory): exact vocabulary, Qwen3's markup tokens as single
non-special ids, idempotency, and an older generator's directory being refused by ``make_tiny`` and rebuilt in place
by ``ensure_configured``. The chat template and vLLM's parsers on this tokenizer: ``test_tiny_chat_template.py``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from cluster import tiny_models
from cluster.cli import main
from cluster.tiny_models import MARKER_FILE, MARKUP_TOKENS, SPECIAL_TOKENS, TinySpec, make_tiny, preset_spec


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


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinySpec, Path]:
    spec = preset_spec("qwen3")
    return spec, make_tiny(spec, tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


def test_built_tokenizer_has_exact_vocab_and_single_non_special_markup_tokens(built: tuple[TinySpec, Path]) -> None:
    from transformers import AutoTokenizer

    spec, path = built
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == spec.vocab == json.loads((path / "config.json").read_text())["vocab_size"]
    assert sorted(tok.get_vocab().values()) == list(range(spec.vocab))  # every id 0..vocab-1 exists exactly once
    added = {t.content: t for t in tok.added_tokens_decoder.values()}
    for text in MARKUP_TOKENS:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(text), text
        assert not added[text].special and not added[text].normalized, text
        assert text not in tok.all_special_tokens, text
    for text in SPECIAL_TOKENS:
        assert added[text].special and text in tok.all_special_tokens, text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id

    # Markup inside text is one token each; skip_special_tokens drops the specials only.
    text = "<think>\nabc\n</think>\n\n<tool_call>\n{}\n</tool_call><tool_response>\nok\n</tool_response>"
    ids = tok.encode("<|im_start|>" + text + "<|im_end|>", add_special_tokens=False)
    assert sum(i in {tok.convert_tokens_to_ids(t) for t in MARKUP_TOKENS} for i in ids) == len(MARKUP_TOKENS)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>" + text + "<|im_end|>"


def test_make_tiny_reuses_its_own_build_and_rebuilds_an_older_generators_in_place(
    built: tuple[TinySpec, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, path = built
    marker = path / MARKER_FILE
    before = marker.stat().st_mtime_ns
    assert make_tiny(spec, path) == path and marker.stat().st_mtime_ns == before  # same digest: nothing rebuilt

    # A directory written by generator version 1 (same spec, no markup tokens): its digest no longer matches.
    with monkeypatch.context() as m:
        m.setattr(tiny_models, "GENERATOR_VERSION", 1)
        old_digest = spec.digest()
    assert old_digest != spec.digest()
    old = tmp_path / "tiny-qwen3"
    shutil.copytree(path, old)
    (old / MARKER_FILE).write_text(json.dumps({"digest": old_digest, "spec": dataclasses.asdict(spec)}))
    with pytest.raises(FileExistsError, match="another tiny model"):
        make_tiny(spec, old)  # the plain call refuses (explicit --force needed) ...
    assert tiny_models.ensure_configured("qwen3", "tiny", old) == old  # ... a config's launcher rebuilds in place
    assert json.loads((old / MARKER_FILE).read_text())["digest"] == spec.digest()
    for name in ("tokenizer.json", "model.safetensors", "config.json", "chat_template.jinja"):
        assert (old / name).read_bytes() == (path / name).read_bytes(), name  # deterministic: byte-identical rebuild
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling left behind
