"""The Ray Serve LLM anchor (``bench.ray_serve_llm``) is built from the same serve config as kvstack: same model,
same engine arguments, the replicas' count and thread count, Ray Serve LLM's prefix-affinity router."""

from __future__ import annotations

import pytest

from bench.ray_serve_llm import build_app, llm_config
from cluster.serve_config import DEFAULT_CONFIG, load_serve_config, parse_overrides


def config(*sets: str):
    return load_serve_config(DEFAULT_CONFIG, parse_overrides(list(sets)))


def test_the_anchor_runs_the_engine_kvstack_runs() -> None:
    cfg = config("app.engine.kv_cache_memory_bytes=16777216", "app.replicas.threads=2")
    llm = llm_config(cfg)
    want = cfg.app.engine.vllm_engine_kwargs()
    assert llm.model_loading_config.model_id == want.pop("served_model_name")
    assert llm.model_loading_config.model_source == want.pop("model")
    assert {k: llm.engine_kwargs[k] for k in want} == want
    assert llm.engine_kwargs["kv_cache_memory_bytes"] == 16777216
    assert llm.deployment_config["num_replicas"] == cfg.app.replicas.num_replicas
    router = llm.deployment_config["request_router_config"]["request_router_class"]
    assert getattr(router, "__name__", str(router)).endswith("PrefixCacheAffinityRouter")
    assert llm.runtime_env["env_vars"] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}


def test_pow2_keeps_serves_default_router_and_the_app_builds() -> None:
    llm = llm_config(config(), router="pow2")
    assert "request_router_config" not in llm.deployment_config or not llm.deployment_config.get(
        "request_router_config")
    assert build_app(config()) is not None


def test_an_autoscaled_config_is_refused() -> None:
    cfg = config("app.replicas.num_replicas=null", "app.replicas.autoscaling_config.min_replicas=1",
                 "app.replicas.autoscaling_config.max_replicas=2")
    with pytest.raises(SystemExit, match="num_replicas"):
        llm_config(cfg)


def test_the_anchor_serves_tools_with_the_configs_tool_parser() -> None:
    """An OpenAI ``tools`` request must be served by the anchor as by kvstack: the config's frontend options reach
    Ray Serve LLM's own split of ``engine_kwargs`` as vLLM frontend arguments (not refused as unknown)."""
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig

    cfg = config()
    assert cfg.app.ingress.openai.tool_call_parser == "hermes"  # configs/local.yaml
    engine = VLLMEngineConfig.from_llm_config(llm_config(cfg))
    assert engine.frontend_kwargs["tool_call_parser"] == "hermes"
    assert engine.frontend_kwargs["enable_auto_tool_choice"] is True
    assert "tool_call_parser" not in engine.engine_kwargs
