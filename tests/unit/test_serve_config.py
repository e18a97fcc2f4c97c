"""cluster.serve_config.load_serve_config: the shipped configs load, unknown keys are rejected naming the file and
key, dotted overrides apply before validation, relative model paths resolve against the current directory; and
``deployments.app.build_app`` turns the ``app`` section into a Serve Application without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.serve_config import ServeFileConfig, load_serve_config
from configs.loader import ConfigError, UnknownNameError
from deployments.app_config import AppConfig

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local.yaml"
GPU = REPO / "configs" / "gpu-8xh100.yaml"


def write(tmp_path: Path, data: object, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def local_raw() -> dict:
    return yaml.safe_load(LOCAL.read_text())


def test_local_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    cfg = load_serve_config(LOCAL)
    assert isinstance(cfg, ServeFileConfig)
    assert cfg.cluster.mode == "local" and cfg.cluster.workers == 2
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 8000)
    assert cfg.tiny_model is not None and cfg.tiny_model.arch == "qwen3"
    assert cfg.app.engine.served_model_name == "tiny-qwen3" and cfg.app.replicas.num_replicas == 2
    assert cfg.app.engine.model_path == str(REPO / ".kvstack" / "models" / "tiny-qwen3")


def test_gpu_config_loads() -> None:
    cfg = load_serve_config(GPU)
    assert cfg.cluster.mode == "existing" and cfg.cluster.address == "auto"
    assert cfg.tiny_model is None
    assert cfg.app.engine.model_path == "/models/Qwen3-14B"  # absolute: untouched
    assert cfg.app.engine.kv_cache_memory_bytes is None
    auto = cfg.app.serve_autoscaling_config()
    assert auto is not None and (auto["min_replicas"], auto["max_replicas"]) == (8, 64)
    assert cfg.app.serve_ray_actor_options() == {"num_cpus": 4.0, "num_gpus": 1.0}


def test_relative_model_path_resolves_against_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = local_raw()
    raw["app"]["engine"]["model"] = "models/m"
    (tmp_path / "cfgdir").mkdir()
    path = write(tmp_path / "cfgdir", raw)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # relative to where kvstack runs (as documented), not to the config file's folder
    assert load_serve_config(path).app.engine.model_path == str(work / "models" / "m")


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda r: r.update(bogus=1), "bogus"),
        (lambda r: r["cluster"].update(wrokers=3), "cluster.wrokers"),
        (lambda r: r["http"].update(tls=True), "http.tls"),
        (lambda r: r["app"].update(extra=1), "app.extra"),
        (lambda r: r["app"]["router"].update(polcy="x"), "app.router.polcy"),
        (lambda r: r["app"]["pool"].update(dram=1), "app.pool.dram"),
    ],
)
def test_unknown_keys_rejected_naming_file_and_key(tmp_path: Path, mutate: object, key: str) -> None:
    raw = local_raw()
    mutate(raw)  # type: ignore[operator]
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as ei:
        load_serve_config(path)
    msg = str(ei.value)
    assert str(path) in msg and f"{key}: unknown key" in msg


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda r: r["cluster"].update(workers=0), "cluster.workers"),
        (lambda r: r["http"].update(port=70000), "http.port"),
        (lambda r: r["app"]["router"].update(policy="fastest"), "app.router.policy"),
        (lambda r: r["app"]["replicas"].update(autoscaling_config={"max_replicas": 2}), "app.replicas"),
        (lambda r: r.pop("app"), "app"),
    ],
)
def test_invalid_values_name_the_key(tmp_path: Path, mutate: object, key: str) -> None:
    raw = local_raw()
    mutate(raw)  # type: ignore[operator]
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as ei:
        load_serve_config(path)
    assert f"{path}: {key}" in str(ei.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text\n", "a: [1\n"])
def test_not_a_mapping_or_bad_yaml(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=str(path)):
        load_serve_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_serve_config(tmp_path / "nope.yaml")


def test_overrides_apply_before_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    cfg = load_serve_config(LOCAL, {"http.port": 9001, "cluster.workers": "3", "app.router.policy": "round_robin",
                                    "app.engine.max_model_len": 2048})
    assert cfg.http.port == 9001 and cfg.cluster.workers == 3
    assert cfg.app.router.policy == "round_robin" and cfg.app.engine.max_model_len == 2048
    assert load_serve_config(LOCAL).http.port == 8000  # the file itself is not changed


def test_override_creates_missing_and_null_sections(tmp_path: Path) -> None:
    raw = local_raw()
    del raw["http"]
    raw["tiny_model"] = None
    path = write(tmp_path, raw)
    cfg = load_serve_config(path, {"http.port": 8123, "tiny_model.arch": "qwen3-next"})
    assert cfg.http.port == 8123 and cfg.http.host == "127.0.0.1"
    assert cfg.tiny_model is not None and cfg.tiny_model.arch == "qwen3-next"


def test_bad_overrides_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="app.engine.bogus: not an engine argument of vLLM"):
        load_serve_config(LOCAL, {"app.engine.bogus": 1})
    with pytest.raises(ConfigError, match="http.port"):
        load_serve_config(LOCAL, {"http.port": "eighty"})
    with pytest.raises(ConfigError, match="app.engine.max_model_len.x.*max_model_len is not a mapping"):
        load_serve_config(LOCAL, {"app.engine.max_model_len.x": 1})


# -- the app section builds the Serve application ------------------------------------------------------------------
def test_build_app_from_the_local_app_section() -> None:
    import ray
    from ray import serve

    from deployments.app import INGRESS_DEPLOYMENT, POOL_KEEPER_DEPLOYMENT, REPLICA_DEPLOYMENT, build_app

    ray_was_up = ray.is_initialized()  # a session-scoped test cluster may already be connected in a full run
    app = build_app(local_raw()["app"])  # the raw mapping, as Serve passes `args`
    assert isinstance(app, serve.Application)
    assert ray.is_initialized() == ray_was_up, "build_app must not start or stop Ray"
    ingress = app._bound_deployment
    assert ingress.name == INGRESS_DEPLOYMENT
    ((replicas, settings),), keeper = ingress.init_args
    assert isinstance(replicas, serve.Application)
    assert keeper._bound_deployment.name == POOL_KEEPER_DEPLOYMENT  # the pool comes with the app
    assert replicas._bound_deployment.name == REPLICA_DEPLOYMENT
    assert replicas._bound_deployment.num_replicas == 2
    assert replicas._bound_deployment.init_args[0].model_path.endswith("tiny-qwen3")
    assert settings.served_model_name == "tiny-qwen3" and settings.policy == "cost_based"


def test_build_app_rejects_unknown_spec_names() -> None:
    from deployments.app import build_app

    app = local_raw()["app"]
    app["router"]["gpu_profile"] = "h100-typo"
    with pytest.raises(UnknownNameError, match="h100-typo"):
        build_app(app)


def test_serve_config_document_serves_the_same_app_and_passes_ray_serves_schema(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve_config import serve_config_document
    from deployments.app import build_app

    cfg = load_serve_config(LOCAL, {"app.engine.max_num_batched_tokens": 2048, "http.port": 8123})
    doc = serve_config_document(cfg)
    ServeDeploySchema.model_validate(doc)
    (app,) = doc["applications"]
    assert app["import_path"] == "deployments.app:build_app" and doc["http_options"]["port"] == 8123
    assert AppConfig.model_validate(app["args"]) == cfg.app  # the same app, any engine argument included
    assert app["args"]["engine"]["max_num_batched_tokens"] == 2048
    assert Path(app["args"]["engine"]["model"]).is_absolute() and Path(app["args"]["pool"]["ssd_dir"]).is_absolute()
    build_app(app["args"])  # what `serve run` calls with them


def test_serve_config_command_writes_only_the_document_to_stdout() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cluster.cli", "serve-config", "--model", "/models/qwen3",
                          "--out", "-"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    engine = doc["applications"][0]["args"]["engine"]
    assert engine["model"] == "/models/qwen3" and engine["served_model_name"] == "qwen3"
    assert "model_spec" not in doc["applications"][0]["args"]["router"]  # derived from the model's own config
