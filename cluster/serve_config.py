"""The ``kvstack serve`` config file: where the cluster comes from, the HTTP endpoint, the model, and the app.

Parsed once by ``cluster.commands.serve`` (unknown keys rejected, errors name the file and key); ``bench.oracle``
and ``bench.live_compare`` read the same file (the engine arguments, the model) to drive a server as a client
would. ``DEFAULT_CONFIG`` is the embedded default's path; ``parse_overrides`` turns ``--set KEY=VALUE`` items into
``load_serve_config``'s overrides. The ``app``
section is exactly the Serve application's args (``deployments.app_config.AppConfig``), so the same section works
in a KubeRay ``serveConfigV2``. ``configs/local.yaml`` is the embedded default; ``configs/gpu-8xh100.yaml`` is a
documented GPU example.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from configs.loader import ConfigError, parse_model
from configs.schema import Strict
from deployments.app_config import AppConfig
from deployments.engine_settings import is_local_model

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


class LocalClusterSettings(Strict):
    """Start a local multi-node cluster (``mode: local``) or join a running one (``mode: existing``)."""

    mode: Literal["local", "existing"] = "local"
    address: str | None = Field(default=None, description="Ray address for mode=existing (e.g. 'auto')")
    workers: int = Field(default=2, ge=1)
    cpus_per_worker: int = Field(default=2, ge=1)


class HttpSettings(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)


class TinyModelSettings(Strict):
    """Generate this tiny model into ``app.engine.model_path`` on first run (no hub access)."""

    arch: Literal["qwen3", "qwen3-next"] = "qwen3"
    preset: Literal["tiny", "heavy"] = "tiny"


class ServeFileConfig(Strict):
    cluster: LocalClusterSettings = Field(default_factory=LocalClusterSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    tiny_model: TinyModelSettings | None = None
    app: AppConfig


def load_serve_config(path: Path, overrides: dict[str, Any] | None = None) -> ServeFileConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise ConfigError(f"{path}: override {dotted}: {p} is not a mapping")
            node = node[p]
        node[leaf] = value
    cfg = parse_model(ServeFileConfig, raw, path)
    # Relative paths (a local model, the SSD directory) are relative to the current directory, where kvstack runs:
    # made absolute here, so the replicas, the ingress and the pool keeper (Ray workers elsewhere) read the same.
    app = cfg.app

    def resolved(engine: Any, generated: bool) -> Any:
        if is_local_model(engine.model, generated=generated) and not Path(engine.model).is_absolute():
            return engine.model_copy(update={"model": str(Path(engine.model).expanduser().resolve())})
        return engine

    if app.models is None:
        app = app.model_copy(update={"engine": resolved(app.engine, cfg.tiny_model is not None)})
    else:
        app = app.model_copy(update={"models": [m.model_copy(update={"engine": resolved(m.engine, False)})
                                                for m in app.models]})
    if app.pool.ssd_dir and not Path(app.pool.ssd_dir).is_absolute():
        app = app.model_copy(update={"pool": app.pool.model_copy(
            update={"ssd_dir": str(Path(app.pool.ssd_dir).expanduser().resolve())})})
    return cfg.model_copy(update={"app": app})


APP_NAME = "kvstack"
IMPORT_PATH = "deployments.app:build_app"


def serve_config_document(cfg: ServeFileConfig) -> dict[str, Any]:
    """The standard Ray Serve config (``serve run FILE`` / ``serve deploy FILE``; KubeRay's ``serveConfigV2``) that
    serves what ``kvstack serve`` serves for ``cfg``: one application, ``deployments.app:build_app`` with the app
    section as its args (only what differs from the defaults), the HTTP options; proxies on every node for an
    existing cluster (Serve's default otherwise, as ``kvstack serve`` starts it). The pool comes with the app
    (``deployments.pool_keeper``)."""
    doc: dict[str, Any] = {}
    if cfg.cluster.mode == "existing":
        doc["proxy_location"] = "EveryNode"
    doc["http_options"] = {"host": cfg.http.host, "port": cfg.http.port}
    doc["applications"] = [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
                            "args": cfg.app.model_dump(mode="json", exclude_defaults=True)}]
    return doc


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items → {dotted key: YAML-parsed value} (``load_serve_config``'s overrides)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out
