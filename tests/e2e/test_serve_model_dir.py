"""E2E: ``kvstack serve --model DIR`` and nothing else serves a model of the user's — here a freshly generated tiny
model of a shape no spec file has (6 layers, 6 query heads over 3 KV heads) — with the cost model's spec derived from
the model's own config and safetensors headers, and engine arguments (``--set app.engine.KEY=VALUE``, any vLLM engine
argument) reaching the engines and the ingress that checks requests for them. Driven with the real ``openai`` SDK."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.serve_run import DTYPE, running_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.tiny_models import make_tiny, preset_spec

    return make_tiny(preset_spec("qwen3", layers=6, heads=6, kv_heads=3, hidden=384, seed=7),
                     tmp_path_factory.mktemp("user-model") / "odd-qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    # max_logprobs: an engine argument kvstack does not declare, passed as a user passes any of vLLM's
    yield from running_serve(tmp_path_factory.mktemp("serve-model-dir"),
                             ["app.engine.max_logprobs=2", "app.engine.startup_probe=true"],
                             model=model_dir)


def test_the_model_is_served_under_its_directory_name(server, model_dir: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=server["base"], api_key="unused", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_dir.name]
    reply = client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError, match="logprobs"):  # vLLM's own check of its max_logprobs=2
        client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=8, logprobs=True, top_logprobs=5)
    assert "tiny model" not in server["log"].read_text()  # nothing was generated


def test_the_cost_model_prices_with_the_spec_derived_from_the_model(server, model_dir: Path) -> None:
    from configs.hf_model import model_spec

    status = json.loads(urllib.request.urlopen(server["base"].removesuffix("/v1") + "/kvstack/status",
                                               timeout=30).read())
    spec = status["model_spec"]
    assert (spec["layers"], spec["n_q"], spec["n_kv"], spec["head_dim"]) == (6, 6, 3, 64)
    assert spec == model_spec(str(model_dir), model_dir.name, engine_dtype=DTYPE).model_dump()
    # each replica's start-up prefill probe fitted its MFU: priced with what its engine measured, not the configured
    rows = status["replicas"]
    assert len(rows) == 2 and all(r["gpu_profile"] == "cpu-2core" and r["mfu"] != 0.4 for r in rows), rows


def test_the_engines_vllm_metrics_are_on_the_endpoints_metrics(server) -> None:
    """vLLM's own engine series, one per replica, next to kvstack's (what the PodMonitor's `serve` port scrapes)."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(server["base"].removesuffix("/v1") + "/metrics", timeout=60).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert any(name.startswith("kvstack_") for name in families)
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
                 "vllm:prompt_tokens", "vllm:prefix_cache_queries"):
        assert name in families, sorted(n for n in families if n.startswith("vllm:"))
    replicas = {s.labels["replica"] for s in families["vllm:num_requests_running"].samples}
    assert len(replicas) == 2, replicas
    assert sum(s.value for s in families["vllm:prompt_tokens"].samples if s.name.endswith("_total")) > 0
