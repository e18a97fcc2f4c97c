"""``app.engine`` takes any vLLM engine argument, checked by vLLM's own parser at config load
(``router.vllm_args``, ``deployments.engine_settings``), and what it says reaches the engine's ``AsyncEngineArgs``, the
ingress's serve arguments and plain vLLM's command line; multi-GPU replicas get Serve placement group bundles."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from deployments.app_config import AppConfig
from deployments.engine_settings import EngineSettings
from router.vllm_args import EngineArgsError, check_engine_args, cli_args, parse_engine_args


def _app(engine: dict[str, Any], **replicas: Any) -> AppConfig:
    return AppConfig.model_validate({
        "engine": {"model": "/models/m", **engine},
        "replicas": {"num_replicas": 1, **replicas},
        "router": {"gpu_profile": "cpu-2core"},
        "pool": {"dram_bytes": 2**20},
    })


def test_any_engine_argument_is_accepted_and_reaches_the_engine_args(tmp_path: Any) -> None:
    engine = EngineSettings(model=str(tmp_path), max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
                            trust_remote_code=True, kv_cache_dtype="fp8",
                            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    assert engine.served_model_name == tmp_path.name  # a directory is served under its name
    args = parse_engine_args(engine.vllm_engine_kwargs())
    assert args.max_num_batched_tokens == 8192 and args.gpu_memory_utilization == 0.85
    assert args.trust_remote_code is True and args.kv_cache_dtype == "fp8"
    assert args.structured_outputs_config.disable_any_whitespace is True  # vLLM's config object, as on its server
    assert args.block_size == 128 and args.enable_prefix_caching is True and args.max_model_len == 4096


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tensor_paralel_size", 2, r"app\.engine\.tensor_paralel_size: not an engine argument of vLLM \(did you mean "
                               r"tensor_parallel_size"),
    ("tensor_parallel_size", "two", r"app\.engine\.tensor_parallel_size: .*invalid int value: 'two'"),
    ("gpu_memory_utilization", "high", r"app\.engine\.gpu_memory_utilization: .*invalid float value"),
    ("kv_cache_dtype", "fp7", r"app\.engine\.kv_cache_dtype: .*invalid choice: 'fp7'"),
    ("structured_outputs_config", {"backend": "xgrammar", "no_such_option": 1},
     r"app\.engine\.structured_outputs_config: .*no_such_option"),
])
def test_an_unknown_or_ill_typed_engine_argument_is_an_error_naming_the_key(key: str, value: Any,
                                                                           message: str) -> None:
    with pytest.raises(ValidationError, match="(?s)" + message):
        EngineSettings(model="/models/m", **{key: value})
    with pytest.raises(EngineArgsError, match="(?s)" + message):
        check_engine_args({"model": "/models/m", key: value})


@pytest.mark.parametrize("key", ["kv_transfer_config", "kv_events_config", "enable_prefix_caching",
                                 "worker_extension_cls"])
def test_what_kvstack_sets_itself_is_refused_with_the_reason(key: str) -> None:
    with pytest.raises(ValidationError, match=rf"app\.engine\.{key} is set by kvstack"):
        EngineSettings(model="/models/m", **{key: True})


def test_the_old_model_path_key_says_what_replaced_it() -> None:
    with pytest.raises(ValidationError, match="now app.engine.model"):
        EngineSettings(model_path="/models/m")


def test_served_model_name_defaults() -> None:
    assert EngineSettings(model="Qwen/Qwen3-0.6B").served_model_name == "Qwen/Qwen3-0.6B"  # an id: as vLLM
    assert EngineSettings(model="./models/qwen").served_model_name == "qwen"
    assert EngineSettings(model="/m/qwen", served_model_name="q").served_model_name == "q"


def test_cli_args_follow_vllms_config_file_rules() -> None:
    assert cli_args({"enforce_eager": True, "enable_chunked_prefill": False, "seed": 3, "served_model_name": ["a", "b"],
                     "compilation_config": {"mode": 0}, "quantization": None}) == [
        "--enforce-eager", "--no-enable-chunked-prefill", "--seed", "3", "--served-model-name", "a", "b",
        "--compilation-config", '{"mode": 0}']


def test_the_ingress_parses_the_engines_own_arguments(tmp_path: Any) -> None:
    """The ingress's `vllm serve` arguments are the engines' (tokenizer, max_model_len, max_logprobs...), so its
    checks of a request are the engines' checks."""
    from router.ingress_settings import IngressSettings, OpenAIFrontendSettings
    from router.access import AccessSettings
    from router.vllm_frontend import serve_args

    engine = EngineSettings(model=str(tmp_path), served_model_name="m", max_model_len=2048, max_logprobs=3,
                            trust_remote_code=True)
    settings = IngressSettings(
        served_model_name="m", model_path=str(tmp_path), engine_args=engine.vllm_engine_kwargs(), max_model_len=2048,
        block_size=128, cache_salt="", policy="round_robin", model_spec=None, gpu_profile="cpu-2core",
        tiers={"hbm": "hbm"}, mfu=0.4, bw_util=0.7, seed=0, dtype="bfloat16", reasoning_parser=None,
        openai=OpenAIFrontendSettings(), access=AccessSettings())
    args = serve_args(settings)
    assert args.max_model_len == 2048 and args.max_logprobs == 3 and args.trust_remote_code is True
    assert args.served_model_name == ["m"] and args.model == str(tmp_path)


def test_a_tensor_parallel_replica_gets_one_bundle_per_gpu_and_vllms_ray_executor() -> None:
    from deployments.app import REPLICA_DEPLOYMENT, build_app

    cfg = _app({"tensor_parallel_size": 4}, num_gpus=1, num_cpus=8)
    group = cfg.serve_placement_group()
    assert group == {"placement_group_bundles": [{"CPU": 8, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}],
                     "placement_group_strategy": "STRICT_PACK"}
    assert cfg.serve_ray_actor_options() == {"num_cpus": 8, "num_gpus": 0.0}  # the engine's workers hold the GPUs
    app = build_app(cfg)
    ((replicas, _settings),), _keeper = app._bound_deployment.init_args
    deployment = replicas._bound_deployment
    assert deployment.name == REPLICA_DEPLOYMENT
    assert deployment._replica_config.placement_group_strategy == "STRICT_PACK"
    assert deployment._replica_config.placement_group_bundles == group["placement_group_bundles"]
    engine = deployment.init_args[0]
    assert engine.extra_engine_args()["distributed_executor_backend"] == "ray"
    assert _app({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, num_gpus=1).serve_placement_group()[
        "placement_group_strategy"] == "PACK"
    assert _app({}, num_gpus=1).serve_placement_group() is None
    assert _app({"tensor_parallel_size": 2}).serve_placement_group() is None  # CPU: no GPUs to bundle
