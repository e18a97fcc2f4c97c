"""AppConfig (deployments/app_config.py): the typed args of the Serve app, parsed once, unknown keys rejected."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from configs.loader import UnknownNameError, load_gpus, load_models, load_tiers
from deployments.app_config import AppConfig


def _args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "engine": {"model": "/models/tiny-qwen3", "served_model_name": "tiny-qwen3"},
        "replicas": {"num_replicas": 2},
        "router": {"model_spec": "tiny-qwen3", "gpu_profile": "cpu-2core"},
        "pool": {"dram_bytes": 2**28},
    }
    for section, value in overrides.items():
        args[section] = value
    return args


def test_minimal_args_get_the_documented_defaults() -> None:
    cfg = AppConfig.model_validate(_args())
    assert cfg.version == 1
    assert cfg.router.policy == "cost_based"
    assert cfg.router.tiers["hbm"] == "hbm" and cfg.router.tiers["local_ssd"] == "local-ssd"
    assert cfg.pool.transfer_backend == "nixl" and cfg.pool.ssd_bytes == 0
    assert cfg.ingress.num_replicas == 1
    assert cfg.serve_autoscaling_config() is None
    assert cfg.serve_ray_actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    cfg.check_spec_names(load_models(), load_gpus(), load_tiers())


def test_unknown_keys_are_rejected_at_every_level() -> None:
    with pytest.raises(ValidationError, match="dram_gb"):
        AppConfig.model_validate(_args(pool={"dram_bytes": 1, "dram_gb": 1}))
    with pytest.raises(ValidationError, match="replica"):
        AppConfig.model_validate({**_args(), "replica": {}})
    with pytest.raises(ValidationError, match="max_model_length"):
        AppConfig.model_validate(_args(engine={"model": "/m", "served_model_name": "m", "max_model_length": 8}))


@pytest.mark.parametrize(
    "replicas",
    [{}, {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}}],
    ids=["neither", "both"],
)
def test_replicas_need_exactly_one_of_count_and_autoscaling(replicas: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="exactly one of replicas.num_replicas and replicas.autoscaling_config"):
        AppConfig.model_validate(_args(replicas=replicas))


def test_autoscaling_bounds_and_serve_options() -> None:
    with pytest.raises(ValidationError, match=r"min_replicas \(5\) > max_replicas \(2\)"):
        AppConfig.model_validate(_args(replicas={"autoscaling_config": {"min_replicas": 5, "max_replicas": 2}}))
    with pytest.raises(ValidationError, match=r"initial_replicas \(9\) outside \[1, 4\]"):
        AppConfig.model_validate(_args(replicas={"autoscaling_config": {"max_replicas": 4, "initial_replicas": 9}}))
    cfg = AppConfig.model_validate(_args(replicas={
        "autoscaling_config": {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 4},
        "num_gpus": 1, "num_cpus": 8,
    }))
    assert cfg.serve_autoscaling_config() == {
        "min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 4.0, "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
    }
    assert cfg.serve_ray_actor_options() == {"num_cpus": 8.0, "num_gpus": 1.0}


def test_every_serve_autoscaling_key_passes_through_and_an_unknown_one_is_named() -> None:
    from ray.serve.config import AutoscalingConfig

    options = {"max_replicas": 6, "upscaling_factor": 2.0, "downscaling_factor": 0.5, "look_back_period_s": 20.0,
               "metrics_interval_s": 5.0, "smoothing_factor": 1.5, "aggregation_function": "max",
               "downscale_to_zero_delay_s": 900.0}
    cfg = AppConfig.model_validate(_args(replicas={"autoscaling_config": options}))
    got = cfg.serve_autoscaling_config()
    assert {k: got[k] for k in options} == options
    AutoscalingConfig.model_validate(got)
    with pytest.raises(ValidationError, match=r"autoscaling_config\.upscale_factor: not a Ray Serve autoscaling "
                                              r"option \(did you mean upscaling_factor"):
        AppConfig.model_validate(_args(replicas={"autoscaling_config": {"max_replicas": 2, "upscale_factor": 2}}))
    with pytest.raises(ValidationError, match="aggregation_function"):
        AppConfig.model_validate(_args(replicas={"autoscaling_config": {"max_replicas": 2,
                                                                        "aggregation_function": "median"}}))


def test_serve_autoscaling_config_is_accepted_by_ray_serve() -> None:
    from ray.serve.config import AutoscalingConfig

    cfg = AppConfig.model_validate(_args(replicas={"autoscaling_config": {"max_replicas": 3, "initial_replicas": 2}}))
    serve_cfg = AutoscalingConfig.model_validate(cfg.serve_autoscaling_config())
    assert (serve_cfg.min_replicas, serve_cfg.max_replicas, serve_cfg.initial_replicas) == (1, 3, 2)


def test_pool_ssd_needs_a_directory_and_a_valid_backend() -> None:
    with pytest.raises(ValidationError, match="pool.ssd_bytes > 0 needs pool.ssd_dir"):
        AppConfig.model_validate(_args(pool={"dram_bytes": 1, "ssd_bytes": 10}))
    with pytest.raises(ValidationError, match="transfer_backend"):
        AppConfig.model_validate(_args(pool={"dram_bytes": 1, "transfer_backend": "rdma"}))
    with pytest.raises(ValidationError, match="dram_bytes"):
        AppConfig.model_validate(_args(pool={"dram_bytes": 0}))
    with pytest.raises(ValidationError, match="saver_nice"):
        AppConfig.model_validate(_args(pool={"dram_bytes": 1, "saver_nice": -5}))
    assert AppConfig.model_validate(_args(pool={"dram_bytes": 1})).pool.saver_nice == 19
    assert AppConfig.model_validate(_args(pool={"dram_bytes": 1})).pool.saver_max_lag_s == 1.0
    with pytest.raises(ValidationError, match="saver_max_lag_s"):
        AppConfig.model_validate(_args(pool={"dram_bytes": 1, "saver_max_lag_s": -1}))


def test_router_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="policy"):
        AppConfig.model_validate(_args(router={"model_spec": "m", "gpu_profile": "g", "policy": "random"}))
    with pytest.raises(ValidationError, match="router.tiers must map 'hbm'"):
        AppConfig.model_validate(_args(router={"model_spec": "m", "gpu_profile": "g", "tiers": {"local_dram": "x"}}))
    with pytest.raises(ValidationError, match="tiers"):
        AppConfig.model_validate(_args(router={"model_spec": "m", "gpu_profile": "g",
                                               "tiers": {"hbm": "hbm", "l3": "x"}}))


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ({"model_spec": "qwen9", "gpu_profile": "cpu-2core"}, "unknown model 'qwen9'; known models:"),
        ({"model_spec": "tiny-qwen3", "gpu_profile": "h100"}, "unknown GPU 'h100'; known GPUs: a100-sxm4-80gb"),
        ({"model_spec": "tiny-qwen3", "gpu_profile": "cpu-2core", "tiers": {"hbm": "hbm", "local_ssd": "nvme"}},
         "unknown tier 'nvme'; known tiers:"),
    ],
)
def test_check_spec_names_lists_the_known_names(router: dict[str, Any], message: str) -> None:
    cfg = AppConfig.model_validate(_args(router=router))
    with pytest.raises(UnknownNameError, match=message):
        cfg.check_spec_names(load_models(), load_gpus(), load_tiers())


# Every field of the router's runtime settings either comes from the app config (and is required there, so the one
# builder cannot drop it) or is one of the router's own runtime knobs. A new field must be added to one of the two.
FROM_APP_CONFIG = {  # IngressSettings field -> (app config section, key, a non-default value)
    "served_model_name": ("engine", "served_model_name", "tiny-x"),
    "model_path": ("engine", "model", "/models/x"),
    "max_model_len": ("engine", "max_model_len", 1234),
    "block_size": ("engine", "block_size", 32),
    "cache_salt": ("engine", "cache_salt", "tenant-7"),
    "policy": ("router", "policy", "prefix_affinity"),
    "model_spec": ("router", "model_spec", "qwen3-14b"),
    "gpu_profile": ("router", "gpu_profile", "h100-sxm5-80gb"),
    "tiers": ("router", "tiers", {"hbm": "hbm", "local_dram": "cpu-dram"}),
    "mfu": ("router", "mfu", 0.55),
    "bw_util": ("router", "bw_util", 0.33),
    "seed": ("router", "seed", 42),
    "dtype": ("engine", "dtype", "float16"),
    "reasoning_parser": ("engine", "reasoning_parser", "qwen3"),
    "openai": ("ingress", "openai", {"enable_auto_tool_choice": True, "tool_call_parser": "hermes",
                                     "max_request_body_bytes": 1024}),
}
ROUTER_RUNTIME_KNOBS = {"hub_name", "hub_namespace", "poll_interval_s", "shard_events_wait_s", "replica_ttl_s",
                        "decision_log_size"}
ENGINE_ARGS = {"engine_args"}  # the engines' whole vLLM arguments (EngineSettings.vllm_engine_kwargs)
ACCESS = {"access"}  # app.ingress's access keys (router.access.AccessSettings), flat in the config: checked below


def test_every_router_setting_from_the_app_config_reaches_the_router() -> None:
    from deployments.app import ingress_settings
    from router.ingress_settings import IngressSettings

    fields = IngressSettings.model_fields
    assert set(fields) == set(FROM_APP_CONFIG) | ROUTER_RUNTIME_KNOBS | ENGINE_ARGS | ACCESS
    assert all(fields[name].is_required() for name in set(FROM_APP_CONFIG) | ENGINE_ARGS | ACCESS)
    args = _args()
    defaults = AppConfig.model_validate(args)
    for section, key, value in FROM_APP_CONFIG.values():
        assert getattr(getattr(defaults, section), key) != value, (section, key)  # the test value is not a default
        args[section] = {**args.get(section, {}), key: value}
    cfg = AppConfig.model_validate(args)
    got = ingress_settings(cfg)
    assert got.engine_args == cfg.engine.vllm_engine_kwargs()
    for name, (_, _, value) in FROM_APP_CONFIG.items():
        got_value = getattr(got, name)
        if hasattr(got_value, "model_dump"):
            got_value = got_value.model_dump(exclude_defaults=True)
        assert got_value == value, name
    access = {"api_keys_file": "/etc/kvstack/keys.yaml", "metrics_need_key": True, "max_queued_requests": 7,
              "tenant_tokens_per_minute": 9000}
    args["ingress"] = {**args.get("ingress", {}), **access}
    assert ingress_settings(AppConfig.model_validate(args)).access.model_dump() == access


def test_router_settings_are_typed() -> None:
    from router.ingress_settings import IngressSettings

    base = {name: value for name, (_, _, value) in FROM_APP_CONFIG.items()} | {"engine_args": {"model": "/m"},
                                                                               "access": {}}
    IngressSettings.model_validate(base)
    with pytest.raises(ValidationError, match="policy"):
        IngressSettings.model_validate({**base, "policy": "cost-based"})
    with pytest.raises(ValidationError, match="tiers"):
        IngressSettings.model_validate({**base, "tiers": {"local-dram": "cpu-dram"}})
    with pytest.raises(ValidationError, match="extra"):
        IngressSettings.model_validate({**base, "mfu_": 0.4})


def test_policy_names_are_policies() -> None:
    from typing import get_args

    from router.ingress_settings import PolicyName
    from router.policies.runner import POLICIES

    assert set(get_args(PolicyName)) <= set(POLICIES)


def test_every_settings_class_is_strict() -> None:
    """One strict base (configs.schema.Strict: frozen, unknown keys rejected) for every settings model."""
    import inspect

    from pydantic import BaseModel

    import cluster.serve_config
    import deployments.app_config
    import deployments.engine_settings
    import router.ingress_settings
    from configs.schema import Strict

    modules = (cluster.serve_config, deployments.app_config, deployments.engine_settings, router.ingress_settings)
    models = [obj for m in modules for obj in vars(m).values()
              if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == m.__name__]
    assert len(models) >= 10, models
    # EngineSettings takes any vLLM engine argument (vLLM's own parser checks the keys it does not declare)
    open_models = {deployments.engine_settings.EngineSettings, deployments.app_config.AutoscalingSettings}
    assert all(m.model_config.get("frozen") for m in open_models)
    assert all(issubclass(m, Strict) for m in models if m not in open_models), [
        m for m in models if not issubclass(m, Strict)]
    names = [m.__name__ for m in models]
    assert len(names) == len(set(names)), names


def _two_models(**extra: Any) -> dict[str, Any]:
    args = _args()
    del args["engine"]
    args["models"] = [
        {"engine": {"model": "/models/a", "kv_bytes_per_token": 2048}, "replicas": {"num_replicas": 2}},
        {"engine": {"model": "/models/b", "served_model_name": "bee", "kv_bytes_per_token": 4608},
         "replicas": {"autoscaling_config": {"max_replicas": 3}}, "policy": "prefix_affinity"},
    ]
    args.pop("replicas", None)
    return {**args, **extra}


def test_several_models_each_get_replicas_a_hub_and_a_route() -> None:
    from deployments.app import INGRESS_DEPLOYMENT, POOL_KEEPER_DEPLOYMENT, build_app, hub_name
    from deployments.pool_setup import shard_config
    from kvpool.shard.placement import PoolNode

    cfg = AppConfig.model_validate(_two_models())
    assert [m.engine.served_model_name for m in cfg.entries()] == ["a", "bee"]
    app = build_app(cfg)
    assert app._bound_deployment.name == INGRESS_DEPLOYMENT
    routes, keeper = app._bound_deployment.init_args
    assert keeper._bound_deployment.name == POOL_KEEPER_DEPLOYMENT
    (rep_a, set_a), (rep_b, set_b) = routes
    assert (rep_a._bound_deployment.name, rep_b._bound_deployment.name) == ("VLLMReplica-0-a", "VLLMReplica-1-bee")
    assert rep_a._bound_deployment.num_replicas == 2
    assert rep_b._bound_deployment._deployment_config.autoscaling_config.max_replicas == 3
    assert (set_a.served_model_name, set_b.served_model_name) == ("a", "bee")
    assert (set_a.policy, set_b.policy) == ("cost_based", "prefix_affinity")  # the router's, and its own
    assert (set_a.hub_name, set_b.hub_name) == (hub_name(0), hub_name(1)) and hub_name(0) != hub_name(1)
    for rep in (rep_a, rep_b):  # each model's replicas report to their own hub; every model sizes the shard
        kwargs = rep._bound_deployment.init_kwargs
        assert kwargs["hub_name"] in (hub_name(0), hub_name(1))
        assert [e.served_model_name for e in kwargs["pool_engines"]] == ["a", "bee"]
    slot = shard_config([m.engine for m in cfg.entries()], cfg.pool, PoolNode("n" * 40, "127.0.0.1")).store.slot_bytes
    assert slot == 4608 * 128  # the larger block of the two


@pytest.mark.parametrize(("edit", "message"), [
    (lambda a: a.update(engine={"model": "/m"}), "app.models lists every model"),
    (lambda a: a["models"][1]["engine"].update(served_model_name="a"), "two models are served under one name"),
    (lambda a: a.update(models=[]), "at least 1"),
])
def test_a_model_list_is_checked(edit: Any, message: str) -> None:
    args = _two_models()
    edit(args)
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(args)


def test_a_single_model_config_is_one_entry() -> None:
    cfg = AppConfig.model_validate(_args())
    (entry,) = cfg.entries()
    assert entry.engine == cfg.engine and entry.replicas == cfg.replicas and cfg.models is None
    with pytest.raises(ValidationError, match="set app.engine and app.replicas"):
        AppConfig.model_validate({k: v for k, v in _args().items() if k != "engine"})
