"""One ``kvstack serve`` of a two-model app (``app.models``) for the modules of this package: ``alpha`` (the tiny
dense shape, its engines running vLLM's ``qwen3`` reasoning parser) and ``beta`` (the same tokenizer, other shapes
and weights), one replica each, the pool on, from a config file as a user writes one (``kvstack serve --config``).

Starting a server takes 70-120 s on a 2-core box, so ``test_serve_reasoning.py`` (the OpenAI surface: reasoning,
streamed structured output, batched prompts, logit bias; on ``alpha``) and ``test_serve_two_models.py`` (routing by
``model``, caches apart) share this one (a package-scoped fixture, torn down after the package's last test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.serve_run import DTYPE, running_serve

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="package")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from cluster.tiny_models import make_tiny, preset_spec

    tmp = tmp_path_factory.mktemp("two-models")
    return (make_tiny(preset_spec("qwen3"), tmp / "alpha"),  # same tokenizer (vocab, seed), other shapes and weights
            make_tiny(preset_spec("qwen3", layers=6, heads=6, kv_heads=3, hidden=384), tmp / "beta"))


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory, models: tuple[Path, Path]):
    tmp = tmp_path_factory.mktemp("serve-two-models")
    cfg = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    cfg["tiny_model"] = None
    engine = cfg["app"].pop("engine")
    replicas = {**cfg["app"].pop("replicas"), "num_replicas": 1}
    cfg["app"]["router"]["model_spec"] = None  # each model priced with the spec of its own files
    parsers = {"alpha": {"reasoning_parser": "qwen3"}, "beta": {}}  # a setting of one model's engines only
    cfg["app"]["models"] = [{"engine": {**engine, "model": str(m), "served_model_name": m.name, "dtype": DTYPE,
                                        **parsers[m.name]},
                             "replicas": replicas} for m in models]
    path = tmp / "two-models.yaml"
    path.write_text(yaml.safe_dump(cfg))
    yield from running_serve(tmp, [], config=path)


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["base"], api_key="unused", timeout=120, max_retries=0)
