"""Checks of a RayService's ``serveConfigV2`` against Ray Serve, the kvstack app, and the pods it runs on.

Who calls it: ``k8s.tools.manifest_check`` for every RayService it validates (and so the unit test). Import paths
are resolved with Ray's own helper, the one Serve loads them with (``ray._common.utils.import_attr``); the
deployment names are the app's own (``deployments.app``).

What is checked (each finding is a ``Problem`` naming where it is and what is wrong):
- Ray Serve's own schema (``ray.serve.schema.ServeDeploySchema``), plus the models Serve keeps as plain dicts in
  that schema (``autoscaling_config``, ``request_router_config``), which Serve only validates at deploy time.
- Key names: Serve's schema ignores unknown keys (a typo like ``autoscaling_confg`` deploys silently with defaults),
  so every mapping is walked and its keys compared with the schema's fields; ``runtime_env`` keys with Ray's.
- ``args`` against ``deployments.app_config.AppConfig`` (unknown keys rejected) and its spec names.
- Import paths resolve to real objects: the app builder, the request router (a ``RequestRouter`` subclass), the
  engine's KV connector class; the deployment names exist in the graph the builder returns for those args.
- The app agrees with itself and with the pods: ``args`` and the per-deployment overrides; GPUs, CPUs, memory,
  the SSD volume and the model volume of the node groups the replicas can land on; autoscaling limits that fit.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from ray._common.utils import import_attr

from deployments.app import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT

APP_CONFIG_PATH = "deployments.app_config:AppConfig"
GPU_RESOURCE = "nvidia.com/gpu"
# Mapping-typed Serve fields whose keys are user data, not schema keys.
FREE_FORM_FIELDS = {"user_config", "request_router_kwargs", "resources", "label_selector", "autoscaling_policy"}


@dataclass(frozen=True)
class Problem:
    where: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.path}: {self.message}"


# -- import paths -------------------------------------------------------------------------------------------------

def resolve(path: str) -> Any:
    """``import_attr(path)`` as Serve does it; any failure becomes an ImportError naming the path and the cause."""
    try:
        return import_attr(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImportError(f"{path!r}: {type(exc).__name__}: {exc}") from exc


# -- key names ----------------------------------------------------------------------------------------------------

def _models_in(annotation: Any) -> tuple[list[type[BaseModel]], list[type[BaseModel]]]:
    """(models a mapping value may be, models a list item may be) for a field annotation."""
    direct: list[type[BaseModel]] = []
    items: list[type[BaseModel]] = []
    origin = typing.get_origin(annotation)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        direct.append(annotation)
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            d, i = _models_in(arg)
            direct += d
            items += i
    elif origin in (list, tuple, set, frozenset):
        for arg in typing.get_args(annotation):
            d, _ = _models_in(arg)
            items += d
    return direct, items


def _fields(model: type[BaseModel]) -> dict[str, Any]:
    out = {}
    for name, info in model.model_fields.items():
        out[name] = info
        if info.alias:
            out[info.alias] = info
    return out


def unknown_keys(data: Any, model: type[BaseModel], path: str) -> Iterator[str]:
    """Dotted paths of keys in ``data`` that ``model`` (recursively) has no field for."""
    if not isinstance(data, dict):
        return
    fields = _fields(model)
    for key, value in data.items():
        here = f"{path}.{key}" if path else str(key)
        info = fields.get(key)
        if info is None and model.model_config.get("extra") == "allow":
            continue  # a model that takes any key checks them itself (EngineSettings: vLLM's engine arguments)
        if info is None:
            known = ", ".join(sorted(model.model_fields))
            yield f"{here}: unknown key for {model.__name__} (known: {known})"
            continue
        if key in FREE_FORM_FIELDS:
            continue
        direct, items = _models_in(info.annotation)
        if isinstance(value, dict) and direct:
            yield from unknown_keys(value, direct[0], here)
        elif isinstance(value, list) and items:
            for i, item in enumerate(value):
                yield from unknown_keys(item, items[0], f"{here}[{i}]")


def _pydantic_problems(exc: ValidationError, where: str, prefix: str) -> list[Problem]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = "unknown key (not allowed here)" if err["type"] == "extra_forbidden" else err["msg"]
        out.append(Problem(where, f"{prefix}.{loc}" if loc else prefix, msg))
    return out


# -- the serve config ---------------------------------------------------------------------------------------------

def parse_serve_config(text: Any, where: str) -> tuple[dict[str, Any] | None, list[Problem]]:
    if not isinstance(text, str):
        return None, [Problem(where, "serveConfigV2", f"must be a YAML string, got {type(text).__name__}")]
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return None, [Problem(where, "serveConfigV2", f"not valid YAML: {exc}")]
    if not isinstance(cfg, dict):
        return None, [Problem(where, "serveConfigV2", "must be a YAML mapping")]
    return cfg, []


def check_serve_schema(cfg: dict[str, Any], where: str) -> list[Problem]:
    """Ray Serve's schema, the dict-typed sub-models Serve checks only at deploy time, and key names."""
    from ray.runtime_env import RuntimeEnv
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig
    from ray.serve.schema import ServeDeploySchema

    problems: list[Problem] = []
    try:  # constructing RequestRouterConfig imports request_router_class, so import errors surface here too
        ServeDeploySchema.model_validate(cfg)
    except ValidationError as exc:
        problems += _pydantic_problems(exc, where, "serveConfigV2")
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        problems.append(Problem(where, "serveConfigV2", f"Ray Serve rejects it: {type(exc).__name__}: {exc}"))
    problems += [Problem(where, "serveConfigV2." + p.split(": ", 1)[0], p.split(": ", 1)[1])
                 for p in unknown_keys(cfg, ServeDeploySchema, "")]
    for a, app in enumerate(cfg.get("applications") or []):
        if not isinstance(app, dict):
            continue
        env = app.get("runtime_env") or {}
        for key in sorted(set(env) - set(RuntimeEnv.known_fields)):
            problems.append(Problem(where, f"serveConfigV2.applications[{a}].runtime_env.{key}",
                                    "unknown runtime_env key"))
        for d, dep in enumerate(app.get("deployments") or []):
            if not isinstance(dep, dict):
                continue
            base = f"serveConfigV2.applications[{a}].deployments[{d}]"
            for key, model in (("autoscaling_config", AutoscalingConfig),
                               ("request_router_config", RequestRouterConfig)):
                value = dep.get(key)
                if isinstance(value, dict):
                    try:
                        model.model_validate(value)
                    except ValidationError as exc:
                        problems += _pydantic_problems(exc, where, f"{base}.{key}")
                    except (ImportError, AttributeError):
                        pass  # RequestRouterConfig imports request_router_class: reported by check_imports
    return problems


def parse_args(app: dict[str, Any], where: str, path: str) -> tuple[Any, list[Problem]]:
    """``args`` as an AppConfig (or None) and the problems; spec names are checked against configs/specs."""
    try:
        app_config = resolve(APP_CONFIG_PATH)
    except ImportError as exc:
        return None, [Problem(where, path, str(exc))]
    try:
        parsed = app_config.model_validate(app.get("args") or {})
    except ValidationError as exc:
        return None, _pydantic_problems(exc, where, path)
    from configs.loader import UnknownNameError, load_gpus, load_models, load_tiers

    try:
        parsed.check_spec_names(load_models(), load_gpus(), load_tiers())
    except UnknownNameError as exc:
        return parsed, [Problem(where, path, str(exc))]
    return parsed, []


def check_imports(app: dict[str, Any], args: Any, where: str, path: str) -> list[Problem]:
    """The builder, the request routers and the KV connector resolve; deployment names exist in the built graph."""
    from ray.serve.request_router import RequestRouter

    problems: list[Problem] = []
    builder = None
    try:
        builder = resolve(str(app.get("import_path", "")))
        if not callable(builder):
            problems.append(Problem(where, f"{path}.import_path", f"{app['import_path']!r} is not callable"))
            builder = None
    except ImportError as exc:
        problems.append(Problem(where, f"{path}.import_path", str(exc)))
    for d, dep in enumerate(app.get("deployments") or []):
        cls_path = (dep.get("request_router_config") or {}).get("request_router_class")
        if cls_path is None:
            continue
        try:
            cls = resolve(cls_path)
            if not (inspect.isclass(cls) and issubclass(cls, RequestRouter)):
                problems.append(Problem(where, f"{path}.deployments[{d}].request_router_config.request_router_class",
                                        f"{cls_path!r} is not a ray.serve RequestRouter subclass"))
        except ImportError as exc:
            problems.append(Problem(where, f"{path}.deployments[{d}].request_router_config", str(exc)))
    if args is not None and args.pool.enabled:
        # the app wires the kvpool connector into every engine when the pool is on: it must resolve
        from kvpool.connector.config import CONNECTOR_MODULE, CONNECTOR_NAME

        try:
            if not inspect.isclass(resolve(f"{CONNECTOR_MODULE}:{CONNECTOR_NAME}")):
                problems.append(Problem(where, f"{path}.args.pool", f"{CONNECTOR_NAME} is not a class"))
        except ImportError as exc:
            problems.append(Problem(where, f"{path}.args.pool", str(exc)))
    if builder is not None and args is not None:
        problems += _check_deployment_names(builder, app, where, path)
    return problems


def built_deployments(builder: Any, args: dict[str, Any], app_name: str) -> dict[str, Any]:
    """Deployment name -> wrapped class/function of the graph ``builder(args)`` returns (no Ray needed)."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    application = call_user_app_builder_with_args_if_necessary(builder, args)
    built = build_app(application, name=app_name)
    return {d.name: d.func_or_class for d in built.deployments}


def _check_deployment_names(builder: Any, app: dict[str, Any], where: str, path: str) -> list[Problem]:
    try:
        graph = built_deployments(builder, app.get("args") or {}, str(app.get("name", "default")))
    except Exception as exc:  # noqa: BLE001 - any failure of the user's builder is a finding, reported as such
        return [Problem(where, f"{path}.import_path",
                        f"building the app from its args failed: {type(exc).__name__}: {exc}")]
    problems = []
    for d, dep in enumerate(app.get("deployments") or []):
        if dep.get("name") not in graph:
            problems.append(Problem(where, f"{path}.deployments[{d}].name",
                                    f"{dep.get('name')!r} is not a deployment of the app "
                                    f"(has: {', '.join(sorted(graph))})"))
    return problems


# -- consistency between args, Serve overrides and the pods -------------------------------------------------------

_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
}


def parse_quantity(value: Any) -> float:
    """A Kubernetes resource quantity ('64Gi', '500m', '8', 1e3) as a number."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)]:
            return float(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return float(text)


@dataclass(frozen=True)
class NodeGroup:
    """What one head/worker group offers to Ray: logical CPUs and GPUs, memory, mounts, and how many pods."""

    name: str
    path: str
    cpus: float
    gpus: float
    gpu_limit: float
    memory: float | None
    ephemeral_request: float
    object_store: float
    max_pods: int
    mounts: dict[str, dict[str, Any]]  # mountPath -> volume
    ports: dict[str, int]
    start_params: dict[str, str]


def node_groups(ray_cluster_spec: dict[str, Any], base: str) -> list[NodeGroup]:
    groups = []
    specs = [("head", f"{base}/headGroupSpec", ray_cluster_spec.get("headGroupSpec") or {}, 1)]
    for i, w in enumerate(ray_cluster_spec.get("workerGroupSpecs") or []):
        specs.append((str(w.get("groupName")), f"{base}/workerGroupSpecs/{i}", w, int(w.get("maxReplicas", 0))))
    for name, path, spec, max_pods in specs:
        pod = (spec.get("template") or {}).get("spec") or {}
        containers = pod.get("containers") or [{}]
        main = containers[0]
        limits = (main.get("resources") or {}).get("limits") or {}
        requests = (main.get("resources") or {}).get("requests") or {}
        params = {k: str(v) for k, v in (spec.get("rayStartParams") or {}).items()}
        cpu_default = parse_quantity(limits["cpu"]) if "cpu" in limits else 0.0
        gpu_limit = parse_quantity(limits.get(GPU_RESOURCE, 0))
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        mounts = {m["mountPath"]: volumes.get(m.get("name"), {}) for m in main.get("volumeMounts") or []}
        ports = {p.get("name", ""): int(p["containerPort"]) for p in main.get("ports") or []}
        groups.append(NodeGroup(
            name=name, path=path,
            cpus=float(params.get("num-cpus", cpu_default)),
            gpus=float(params.get("num-gpus", gpu_limit)),
            gpu_limit=gpu_limit,
            memory=parse_quantity(limits["memory"]) if "memory" in limits else None,
            ephemeral_request=parse_quantity(requests.get("ephemeral-storage", 0)),
            object_store=float(params.get("object-store-memory", 0)),
            max_pods=max_pods, mounts=mounts, ports=ports, start_params=params,
        ))
    return groups


def _deployment(app: dict[str, Any], name: str) -> dict[str, Any]:
    for dep in app.get("deployments") or []:
        if dep.get("name") == name:
            return dep
    return {}


def _mount_for(group: NodeGroup, path: str) -> dict[str, Any] | None:
    best = None
    for mount_path, volume in group.mounts.items():
        prefix = mount_path.rstrip("/") + "/"
        if (path == mount_path or path.startswith(prefix)) and (best is None or len(mount_path) > len(best[0])):
            best = (mount_path, volume)
    return best[1] if best else None


def check_consistency(app: dict[str, Any], args: Any, ray_cluster_spec: dict[str, Any], where: str,
                      path: str, cluster_path: str) -> list[Problem]:
    """args vs the Serve overrides, and both vs the node groups the deployments can be placed on."""
    replica, ingress = _deployment(app, REPLICA_DEPLOYMENT), _deployment(app, INGRESS_DEPLOYMENT)
    opts = replica.get("ray_actor_options") or {}
    rep_cpus = float(opts.get("num_cpus", args.replicas.num_cpus))
    rep_gpus = float(opts.get("num_gpus", args.replicas.num_gpus))
    ing_cpus = float((ingress.get("ray_actor_options") or {}).get("num_cpus", 0.0))  # unknown: assume anywhere
    groups = node_groups(ray_cluster_spec, cluster_path)
    hosts = [g for g in groups if g.cpus >= rep_cpus and g.gpus >= rep_gpus]
    ing_hosts = [g for g in groups if g.cpus >= ing_cpus]
    problems = _check_overrides(replica, ingress, args, where, path)
    if not hosts:
        problems.append(Problem(where, f"{path}.deployments[{REPLICA_DEPLOYMENT}]",
                                f"no node group offers {rep_cpus} CPUs and {rep_gpus} GPUs per replica"))
    problems += _check_placement(groups, hosts, ing_hosts, rep_gpus, args.engine.model_path, where)
    if args.pool.enabled:
        problems += _check_pool(hosts, args.pool, where)
    problems += _check_autoscaling_room(hosts, args.replicas, rep_cpus, rep_gpus, where, path)
    return problems


def _check_overrides(replica: dict[str, Any], ingress: dict[str, Any], args: Any, where: str,
                     path: str) -> list[Problem]:
    """args and the per-deployment overrides must say the same thing (in Serve the override wins)."""
    problems: list[Problem] = []
    rep, ing = f"{path}.deployments[{REPLICA_DEPLOYMENT}]", f"{path}.deployments[{INGRESS_DEPLOYMENT}]"
    r = args.replicas
    auto = args.serve_autoscaling_config()
    if replica and ("autoscaling_config" in replica) != (auto is not None):
        problems.append(Problem(where, rep, "autoscaling here and in args.replicas must both be on or both off"))
    if "autoscaling_config" in replica and auto is not None:
        override = replica["autoscaling_config"]
        for key, value in auto.items():
            if key in override and float(override[key]) != float(value):
                problems.append(Problem(where, f"{rep}.autoscaling_config.{key}",
                                        f"{override[key]} but args.replicas.autoscaling_config.{key} is {value}"))
        for key in sorted(set(override) & set(type(r.autoscaling_config).model_fields) - set(auto)):
            problems.append(Problem(where, f"{rep}.autoscaling_config.{key}", "set here but not in args"))
    if "num_replicas" in replica and r.num_replicas is not None and replica["num_replicas"] != r.num_replicas:
        problems.append(Problem(where, f"{rep}.num_replicas",
                                f"differs from args.replicas.num_replicas ({r.num_replicas})"))
    if "max_ongoing_requests" in replica and replica["max_ongoing_requests"] != r.max_ongoing_requests:
        problems.append(Problem(where, f"{rep}.max_ongoing_requests",
                                f"differs from args.replicas.max_ongoing_requests ({r.max_ongoing_requests})"))
    opts = replica.get("ray_actor_options") or {}
    for key, value in args.serve_ray_actor_options().items():
        if key in opts and float(opts[key]) != float(value):
            problems.append(Problem(where, f"{rep}.ray_actor_options.{key}",
                                    f"{opts[key]} but args.replicas.{key} is {value}"))
    if "num_replicas" in ingress and ingress["num_replicas"] != args.ingress.num_replicas:
        problems.append(Problem(where, f"{ing}.num_replicas",
                                f"differs from args.ingress.num_replicas ({args.ingress.num_replicas})"))
    return problems


def _check_placement(groups: list[NodeGroup], hosts: list[NodeGroup], ing_hosts: list[NodeGroup], rep_gpus: float,
                     model_path: str, where: str) -> list[Problem]:
    """The model is mounted wherever replicas or routers can run; GPUs are requested exactly where they are used."""
    problems: list[Problem] = []
    for g in {g.name: g for g in hosts + ing_hosts}.values():
        if _mount_for(g, model_path) is None:
            who = "replicas" if g in hosts else "ingress replicas (they load the tokenizer)"
            problems.append(Problem(where, g.path, f"{who} can run here but engine.model {model_path} is not on "
                                    "a mounted volume"))
    for g in groups:
        if rep_gpus > 0 and g in hosts:
            if g.gpu_limit <= 0:
                problems.append(Problem(where, g.path, f"replicas need {rep_gpus:g} GPU(s) but the container has no "
                                        f"{GPU_RESOURCE} limit"))
            elif "num-gpus" in g.start_params and float(g.start_params["num-gpus"]) != g.gpu_limit:
                problems.append(Problem(where, f"{g.path}/rayStartParams/num-gpus",
                                        f"{g.start_params['num-gpus']} but the container's {GPU_RESOURCE} limit is "
                                        f"{g.gpu_limit:g}"))
        if rep_gpus == 0 and g.gpu_limit > 0:
            problems.append(Problem(where, g.path, f"replicas use no GPU but the pod requests {g.gpu_limit:g} "
                                    f"{GPU_RESOURCE}"))
    return problems


def _check_pool(hosts: list[NodeGroup], pool: Any, where: str) -> list[Problem]:
    """Each node that runs replicas has a shard: its DRAM arena, SSD volume and metrics port must fit the pod."""
    problems: list[Problem] = []
    for g in hosts:
        if g.memory is not None and g.memory < pool.dram_bytes + g.object_store:
            problems.append(Problem(where, f"{g.path}/template/spec/containers/0/resources/limits/memory",
                                    f"{g.memory / 2**30:.1f} GiB cannot hold pool.dram_bytes "
                                    f"({pool.dram_bytes / 2**30:.1f} GiB) + object-store-memory "
                                    f"({g.object_store / 2**30:.1f} GiB)"))
        if pool.ssd_bytes > 0 and pool.ssd_dir:
            problems += _check_ssd_volume(g, pool, where)
        if pool.metrics_port and pool.metrics_port not in g.ports.values():
            problems.append(Problem(where, g.path, f"pool.metrics_port {pool.metrics_port} is not a container port"))
    return problems


def _check_ssd_volume(g: NodeGroup, pool: Any, where: str) -> list[Problem]:
    volume = _mount_for(g, pool.ssd_dir)
    if volume is None:
        return [Problem(where, g.path, f"pool.ssd_dir {pool.ssd_dir} is not on a mounted volume")]
    if "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory":
        problems = []
        limit = volume["emptyDir"].get("sizeLimit")
        if limit is not None and parse_quantity(limit) < pool.ssd_bytes:
            problems.append(Problem(where, g.path, f"SSD volume {volume.get('name')} sizeLimit {limit} < "
                                    f"pool.ssd_bytes {pool.ssd_bytes}"))
        if g.ephemeral_request < pool.ssd_bytes:  # the slab is preallocated in full when the shard starts
            problems.append(Problem(where, f"{g.path}/template/spec/containers/0/resources/requests",
                                    f"ephemeral-storage request {g.ephemeral_request / 2**30:.1f} GiB < pool.ssd_bytes "
                                    f"on the emptyDir ({pool.ssd_bytes / 2**30:.1f} GiB): the scheduler may pick a "
                                    "node without room for the SSD tier"))
        return problems
    if not ({"hostPath", "persistentVolumeClaim", "ephemeral"} & set(volume)):
        return [Problem(where, g.path, f"SSD volume {volume.get('name')} is not a disk volume (emptyDir on disk, "
                                       "hostPath, persistentVolumeClaim or ephemeral)")]
    return []


def _check_autoscaling_room(hosts: list[NodeGroup], r: Any, rep_cpus: float, rep_gpus: float, where: str,
                            path: str) -> list[Problem]:
    """Serve may ask for max_replicas: the Ray autoscaler must be able to add enough pods to hold them."""
    if r.autoscaling_config is None:
        return []
    n = r.autoscaling_config.max_replicas
    if rep_gpus > 0:
        room = sum(int(g.gpus // rep_gpus) * g.max_pods for g in hosts)
    elif rep_cpus > 0:
        room = sum(int(g.cpus // rep_cpus) * g.max_pods for g in hosts)
    else:
        return []
    if room < n:
        return [Problem(where, f"{path}.args.replicas.autoscaling_config.max_replicas",
                        f"{n} replicas, but the worker groups fit at most {room} at their maxReplicas")]
    return []
