"""The Kubernetes manifests under k8s/ are valid without a cluster (issue 6, "Validation in the test suite").

What is checked, per kustomization (k8s/base, k8s/overlays/local-kind, k8s/overlays/gpu, k8s/monitoring):
- every YAML/JSON file parses; each kustomization renders with `kubectl kustomize` (the tests that need rendered
  manifests skip, saying so, where kubectl is not installed);
- the RayService validates against the real KubeRay CRDs in ../shared/k8s-crds (unknown fields rejected), its
  embedded cluster also as a RayCluster, core kinds and the pod templates against the Kubernetes schemas of
  kubernetes-validate;
- serveConfigV2 against Ray Serve's ServeDeploySchema and by key names (Serve ignores unknown keys), its args
  against deployments.app_config.AppConfig; the import paths resolve to real objects; deployment names exist in
  the app the builder returns; args, Serve overrides and the pods agree (GPUs, memory, volumes, autoscaling room);
- the PodMonitor selects the Ray pods and scrapes ports they declare; the dashboard uses metric and label names the
  code defines (router/metrics.py, kvpool/metrics.py) or Ray Serve exports;
- deliberately broken manifests fail, each with a message that names the place and the mistake.
The checker is the same code as `python -m k8s.tools.manifest_check` (the CLI is tested at the end).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "k8s"
SHARED = REPO_ROOT.parent / "shared"
CRD_DIR = SHARED / "k8s-crds"

from deployments.app import INGRESS_DEPLOYMENT, POOL_KEEPER_DEPLOYMENT, REPLICA_DEPLOYMENT
from k8s.tools import manifest_check, monitoring_check, serve_check

APP_DIRS = ["base", "overlays/local-kind", "overlays/gpu"]
ALL_DIRS = [*APP_DIRS, "monitoring"]
CRD_FILES = ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml")


@pytest.fixture(scope="module")
def crds() -> manifest_check.CrdSchemas:
    missing = [f for f in CRD_FILES if not (CRD_DIR / f).is_file()]
    if missing:
        pytest.skip(f"KubeRay CRDs not found: {', '.join(str(CRD_DIR / f) for f in missing)} (expects ../shared next "
                    "to the repository)")
    loaded = manifest_check.CrdSchemas.load(CRD_DIR)
    assert loaded.has("ray.io", "RayService") and loaded.has("ray.io", "RayCluster")
    return loaded


NO_KUBECTL = "kubectl not installed: the kustomizations are rendered with `kubectl kustomize`"
needs_kubectl = pytest.mark.skipif(manifest_check.kubectl() is None, reason=NO_KUBECTL)


@pytest.mark.parametrize("rel", ["base", "overlays/local-kind", "overlays/gpu"])
def test_ray_token_auth_is_on_and_every_ray_pod_gets_the_secrets_from_kubernetes_secrets(rel: str) -> None:
    """Issue 16: Ray's token authentication on; the pool's cluster secret (required) and the API / admin keys
    (optional) on every Ray pod from Secrets, never as a literal value (the dashboard shows pod specs' values)."""
    cluster = ray_service(rel)["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        (ray_container,) = [c for c in template["spec"]["containers"] if c["name"].startswith("ray-")]
        env = {e["name"]: e for e in ray_container["env"]}
        for name, optional in (("KVSTACK_POOL_SECRET", False), ("KVSTACK_API_KEYS", True),
                               ("KVSTACK_ADMIN_KEY", True)):
            assert "value" not in env[name], name
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert bool(ref.get("optional", False)) is optional, name
    assert "KVSTACK_POOL_SECRET" not in ray_service(rel)["spec"]["serveConfigV2"]


RAY_TLS_ENV = {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "/etc/ray/tls/tls.crt",
               "RAY_TLS_SERVER_KEY": "/etc/ray/tls/tls.key", "RAY_TLS_CA_CERT": "/etc/ray/tls/ca.crt"}


@pytest.mark.parametrize("rel", ["base", "overlays/local-kind", "overlays/gpu"])
def test_every_ray_process_speaks_mutual_tls_with_its_pods_own_certificate(rel: str) -> None:
    """Issue 16: Ray's traffic (the pool's call proofs travel in it) encrypted and only between holders of a
    certificate from the cluster's CA: on every Ray container and the autoscaler Ray's TLS settings; each pod's
    first init container makes the pod's certificate with the script the ConfigMap carries — the very file
    ``tests/integration/test_ray_access.py`` runs against a real Ray cluster — from the CA Secret, into the memory
    volume the Ray container mounts read-only."""
    resources = rendered(rel)
    (script,) = [r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "kvstack-ray-tls"]
    assert script["data"]["make-cert.sh"] == (K8S / "base/ray-tls/make-cert.sh").read_text()
    cluster = ray_service(rel)["spec"]["rayClusterConfig"]
    auto = cluster["autoscalerOptions"]
    assert {e["name"]: e["value"] for e in auto["env"]} == RAY_TLS_ENV
    assert auto["volumeMounts"] == [{"name": "ray-tls", "mountPath": "/etc/ray/tls", "readOnly": True}]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["ray-ca"]["secret"]["secretName"] == "kvstack-ray-ca"
        assert volumes["ray-tls-script"]["configMap"]["name"] == "kvstack-ray-tls"
        assert volumes["ray-tls"]["emptyDir"]["medium"] == "Memory"
        init = spec["initContainers"][0]  # before any other init container: they may start Ray clients
        assert init["name"] == "ray-tls-cert" and init["command"] == ["sh", "/etc/kvstack/ray-tls/make-cert.sh"]
        env = {e["name"]: e for e in init["env"]}
        assert env["RAY_TLS_DIR"]["value"] == "/etc/ray/tls"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert mounts["ray-ca"]["mountPath"] == env["RAY_TLS_CA_DIR"]["value"] and mounts["ray-ca"]["readOnly"]
        assert not mounts["ray-tls"].get("readOnly")
        (ray_container,) = [c for c in spec["containers"] if c["name"].startswith("ray-")]
        assert {e["name"]: e.get("value") for e in ray_container["env"] if e["name"] in RAY_TLS_ENV} == RAY_TLS_ENV
        assert {"name": "ray-tls", "mountPath": "/etc/ray/tls", "readOnly": True} in ray_container["volumeMounts"]
        assert not any(m["name"] == "ray-ca" for m in ray_container["volumeMounts"])  # the CA key stays out of it


@functools.cache
def _rendered(rel: str) -> tuple[dict[str, Any], ...]:
    return tuple(manifest_check.render(K8S / rel))


def rendered(rel: str) -> list[dict[str, Any]]:
    if manifest_check.kubectl() is None:
        pytest.skip(NO_KUBECTL)
    return copy.deepcopy(list(_rendered(rel)))


def ray_service(rel: str) -> dict[str, Any]:
    (res,) = [r for r in rendered(rel) if r["kind"] == "RayService"]
    return res


def serve_app(rel: str) -> dict[str, Any]:
    cfg = yaml.safe_load(ray_service(rel)["spec"]["serveConfigV2"])
    (app,) = cfg["applications"]
    return app


def _fmt(problems: list[Any]) -> str:
    return "\n".join(str(p) for p in problems)


# -- files and rendering ------------------------------------------------------------------------------------------

def test_every_manifest_file_parses() -> None:
    files = [p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    assert len(files) >= 10, files
    problems = manifest_check.parse_tree(K8S)
    assert not problems, _fmt(problems)


def test_parse_tree_reports_broken_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "ok.yaml").write_text("a: 1\n---\nb: 2\n")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    (tmp_path / "bad.json").write_text('{"a": 1,}')
    problems = manifest_check.parse_tree(tmp_path)
    assert sorted(Path(p.where).name for p in problems) == ["bad.json", "bad.yaml"]
    assert all("not valid" in p.message for p in problems)


@pytest.mark.parametrize(
    ("rel", "kinds"),
    [
        ("base", ["ConfigMap", "PersistentVolumeClaim", "RayService"]),
        ("overlays/local-kind", ["ConfigMap", "RayService"]),
        ("overlays/gpu", ["ConfigMap", "PersistentVolumeClaim", "RayService"]),
        ("monitoring", ["ConfigMap", "PodMonitor"]),
    ],
)
def test_kustomizations_render(rel: str, kinds: list[str]) -> None:
    resources = rendered(rel)
    assert sorted(r["kind"] for r in resources) == kinds
    assert all(r["metadata"]["namespace"] == "kvstack" for r in resources)


def test_overlays_change_what_they_should() -> None:
    def worker(rel: str) -> dict[str, Any]:
        return ray_service(rel)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]

    kind, gpu = worker("overlays/local-kind"), worker("overlays/gpu")
    assert "nvidia.com/gpu" not in json.dumps(ray_service("overlays/local-kind"))
    assert kind["template"]["spec"]["initContainers"][0]["image"] == "kvstack:0.1.0-cpu"
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert gpu["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    ssd = [v for v in gpu["template"]["spec"]["volumes"] if v["name"] == "kvpool-ssd"]
    assert ssd == [{"name": "kvpool-ssd", "hostPath": {"path": "/mnt/nvme/kvstack", "type": "DirectoryOrCreate"}}]
    from deployments.app_config import AppConfig

    assert AppConfig.model_validate(serve_app("overlays/local-kind")["args"]).replicas.num_gpus == 0
    assert AppConfig.model_validate(serve_app("overlays/gpu")["args"]).pool.dram_bytes == 512 * 2**30


def test_gpu_overlay_runs_the_documented_gpu_config() -> None:
    """configs/gpu-8xh100.yaml says its `app` section is what k8s/ puts in serveConfigV2: keep that true."""
    from deployments.app_config import AppConfig

    documented = yaml.safe_load((REPO_ROOT / "configs" / "gpu-8xh100.yaml").read_text())["app"]
    deployed = serve_app("overlays/gpu")["args"]
    assert deployed["pool"]["ssd_dir"] == "/var/lib/kvstack/ssd"  # the hostPath as the pod sees it
    documented["pool"]["ssd_dir"] = deployed["pool"]["ssd_dir"]
    assert AppConfig.model_validate(deployed) == AppConfig.model_validate(documented)


def test_overlay_patch_on_a_reordered_base_fails_loudly(tmp_path: Path) -> None:
    """The overlays pin list positions with `test` ops: a base whose worker volumes moved must not build."""
    copy_tree = tmp_path / "k8s"
    shutil.copytree(K8S, copy_tree, ignore=shutil.ignore_patterns("tools", "__pycache__"))
    base = copy_tree / "base" / "rayservice.yaml"
    text = base.read_text()
    volume = "              - name: {}\n                emptyDir:"
    text = text.replace(volume.format("kvpool-ssd"), volume.format("kvpool-scratch"))
    base.write_text(text)
    if manifest_check.kubectl() is None:
        pytest.skip(NO_KUBECTL)
    failed = "testing value /spec/rayClusterConfig/workerGroupSpecs/0/template/spec/volumes/1/name failed"
    with pytest.raises(manifest_check.KustomizeError, match=failed):
        manifest_check.render(copy_tree / "overlays" / "gpu")


# -- schemas ------------------------------------------------------------------------------------------------------

def test_strict_schema_rejects_unknown_fields_where_the_crd_is_structural(crds: manifest_check.CrdSchemas) -> None:
    schema = crds.schemas[("ray.io", "v1", "RayService")]
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False
    worker = spec["properties"]["rayClusterConfig"]["properties"]["workerGroupSpecs"]["items"]
    assert worker["additionalProperties"] is False
    assert worker["properties"]["rayStartParams"]["additionalProperties"] == {"type": "string"}  # a map stays a map
    preserved = manifest_check.strict_schema(
        {"type": "object", "properties": {"a": {"type": "string"}}, "x-kubernetes-preserve-unknown-fields": True})
    assert "additionalProperties" not in preserved


@pytest.mark.parametrize("rel", APP_DIRS)
def test_ray_service_validates_against_kuberay_crds(rel: str, crds: manifest_check.CrdSchemas) -> None:
    res = ray_service(rel)
    problems = crds.validate(res, rel)
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"},
               "spec": res["spec"]["rayClusterConfig"]}
    problems += crds.validate(cluster, rel + " (as RayCluster)")
    assert not problems, _fmt(problems)


@pytest.mark.parametrize("rel", ALL_DIRS)
def test_core_kinds_validate_against_kubernetes_schemas(rel: str) -> None:
    core = [r for r in rendered(rel) if "." not in r["apiVersion"].rpartition("/")[0]]
    assert core or rel == "overlays/local-kind"
    problems = [p for r in core for p in manifest_check.validate_core(r, rel)]
    assert not problems, _fmt(problems)


@pytest.mark.parametrize("rel", APP_DIRS)
def test_ray_pod_templates_validate_as_core_pod_templates(rel: str) -> None:
    cluster = ray_service(rel)["spec"]["rayClusterConfig"]
    templates = manifest_check._ray_pod_templates(cluster, "/spec/rayClusterConfig")
    assert len(templates) == 2
    problems = [p for path, t in templates for p in manifest_check.validate_pod_template(t, rel, path)]
    assert not problems, _fmt(problems)


def test_core_validation_rejects_unknown_and_mistyped_fields() -> None:
    (pvc,) = [r for r in rendered("base") if r["kind"] == "PersistentVolumeClaim"]
    typo = copy.deepcopy(pvc)
    typo["spec"]["accesModes"] = typo["spec"].pop("accessModes")
    assert "'accesModes' was unexpected" in _fmt(manifest_check.validate_core(typo, "pvc"))
    mistyped = copy.deepcopy(pvc)
    mistyped["spec"]["resources"]["requests"]["storage"] = ["100Gi"]
    (problem,) = manifest_check.validate_core(mistyped, "pvc")
    assert problem.path == "/spec/resources/requests/storage", problem


# -- serveConfigV2 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", APP_DIRS)
def test_serve_config_passes_ray_serve_schema_and_key_names(rel: str) -> None:
    cfg, problems = serve_check.parse_serve_config(ray_service(rel)["spec"]["serveConfigV2"], rel)
    assert cfg is not None
    problems += serve_check.check_serve_schema(cfg, rel)
    assert not problems, _fmt(problems)


@pytest.mark.parametrize("rel", APP_DIRS)
def test_serve_config_is_what_kvstack_serve_config_writes_for_its_app(rel: str) -> None:
    """One source: the RayService's serveConfigV2 is the document ``kvstack serve-config`` writes for a config with
    the same app on an existing cluster (``cluster.serve_config.serve_config_document``), plus per-deployment
    overrides, which must agree with the app (``test_args_overrides_and_pods_agree``)."""
    from cluster.serve_config import ServeFileConfig, serve_config_document
    from deployments.app_config import AppConfig

    deployed = yaml.safe_load(ray_service(rel)["spec"]["serveConfigV2"])
    (app,) = deployed["applications"]
    cfg = ServeFileConfig(cluster={"mode": "existing", "address": "auto"}, http=deployed["http_options"],
                          app=AppConfig.model_validate(app["args"]))
    written = serve_config_document(cfg)
    assert {k: v for k, v in deployed.items() if k != "applications"} == {
        k: v for k, v in written.items() if k != "applications"}
    (want,) = written["applications"]
    assert {k: app[k] for k in ("name", "route_prefix", "import_path")} == {
        k: want[k] for k in ("name", "route_prefix", "import_path")}
    assert AppConfig.model_validate(want["args"]) == AppConfig.model_validate(app["args"])


def test_serve_configs_are_generated_from_their_kvstack_configs(tmp_path: Path) -> None:
    """Every kustomization's serveConfigV2 is ``k8s.tools.serve_configs``'s output for its recipe entry, current
    (``--check``), and a changed source makes it stale."""
    from k8s.tools import serve_configs

    entries = serve_configs.load_recipe()
    assert sorted(e["dir"] for e in entries) == sorted(APP_DIRS)
    assert serve_configs.main(["--check"]) == 0, "run: python -m k8s.tools.serve_configs"
    for e in entries:
        assert ray_service(e["dir"])["spec"]["serveConfigV2"] == serve_configs.output_path(e).read_text()
    (gpu,) = [e for e in entries if e["dir"] == "overlays/gpu"]
    changed = dict(gpu, set={**gpu["set"], "app.engine.max_num_seqs": 17})
    assert serve_configs.stale([changed]) == [serve_configs.output_path(gpu)]


def test_key_name_walk_finds_typos_ray_serve_ignores() -> None:
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load(ray_service("base")["spec"]["serveConfigV2"])
    cfg["applications"][0]["deployments"][1]["autoscaling_config"]["max_replica"] = 3
    cfg["applications"][0]["deployments"][0]["ray_actor_option"] = {"num_cpus": 1}
    ServeDeploySchema.model_validate(cfg)  # Ray Serve's own schema lets both through ...
    found = list(serve_check.unknown_keys(cfg, ServeDeploySchema, ""))  # ... the key-name walk does not
    assert any(f.startswith("applications[0].deployments[1].autoscaling_config.max_replica:") for f in found), found
    assert any(f.startswith("applications[0].deployments[0].ray_actor_option:") for f in found), found
    assert len(found) == 2, found


@pytest.mark.parametrize("rel", APP_DIRS)
def test_serve_args_validate_as_app_config(rel: str) -> None:
    from deployments.app_config import AppConfig

    args, problems = serve_check.parse_args(serve_app(rel), rel, "args")
    assert not problems, _fmt(problems)
    assert isinstance(args, AppConfig)


# The objects the Serve application is made of (issue 6; the lead's deployments/ and router/ land them). Each must
# resolve to a real object of the right kind in this repository.
def _is_request_router(obj: Any) -> bool:
    from ray.serve.request_router import RequestRouter

    return inspect.isclass(obj) and issubclass(obj, RequestRouter)


def _is_builder(obj: Any) -> bool:
    return inspect.isfunction(obj) and len(inspect.signature(obj).parameters) == 1


REQUIRED_OBJECTS: list[tuple[str, Callable[[Any], bool]]] = [
    ("deployments.app:build_app", _is_builder),
    ("deployments.app_config:AppConfig", inspect.isclass),
    ("deployments.replica:VLLMReplica", inspect.isclass),
    ("router.ingress:OpenAIIngress", inspect.isclass),
    ("deployments.request_router:DecisionRequestRouter", _is_request_router),
    ("kvpool.shard.actor:PoolShard", inspect.isclass),
]


@pytest.mark.parametrize(("path", "check"), REQUIRED_OBJECTS, ids=[p for p, _ in REQUIRED_OBJECTS])
def test_app_objects_resolve(path: str, check: Callable[[Any], bool]) -> None:
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    assert hasattr(module, attr), f"{module_name} has no {attr}"
    assert check(getattr(module, attr)), f"{path} is not the expected kind of object ({check.__name__})"


@pytest.mark.parametrize("rel", APP_DIRS)
def test_import_paths_in_manifests_resolve(rel: str) -> None:
    """import_path, request_router_class, the engine's KV connector; deployment names exist in the built app."""
    app = serve_app(rel)
    referenced = {app["import_path"], *(d["request_router_config"]["request_router_class"]
                                        for d in app["deployments"] if "request_router_config" in d)}
    assert referenced == {"deployments.app:build_app", "deployments.request_router.DecisionRequestRouter"}
    args, problems = serve_check.parse_args(app, rel, "args")
    problems += serve_check.check_imports(app, args, rel, "app")
    assert not problems, _fmt(problems)


@pytest.mark.parametrize("rel", APP_DIRS)
def test_built_app_has_the_configured_deployments(rel: str) -> None:
    app = serve_app(rel)
    graph = serve_check.built_deployments(serve_check.resolve(app["import_path"]), app["args"], app["name"])
    classes = {name: f"{obj.__module__}.{obj.__qualname__}" for name, obj in graph.items()}
    assert classes == {INGRESS_DEPLOYMENT: "router.ingress.OpenAIIngress",
                       REPLICA_DEPLOYMENT: "deployments.replica.VLLMReplica",
                       POOL_KEEPER_DEPLOYMENT: "deployments.pool_keeper.PoolKeeper"}
    assert {d["name"] for d in app["deployments"]} == set(graph)


@pytest.mark.parametrize("rel", APP_DIRS)
def test_args_overrides_and_pods_agree(rel: str) -> None:
    app = serve_app(rel)
    args, problems = serve_check.parse_args(app, rel, "args")
    assert args is not None, _fmt(problems)
    cluster = ray_service(rel)["spec"]["rayClusterConfig"]
    problems = serve_check.check_consistency(app, args, cluster, rel, "app", "/spec/rayClusterConfig")
    assert not problems, _fmt(problems)


@pytest.mark.parametrize(("text", "expected"), [("64Gi", 64 * 2**30), ("500m", 0.5), ("8", 8), (1e3, 1000),
                                                ("1.5G", 1.5e9)])
def test_parse_quantity(text: Any, expected: float) -> None:
    assert serve_check.parse_quantity(text) == pytest.approx(expected)


# -- the whole checker, and deliberately broken manifests ---------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("rel", ALL_DIRS)
def test_kustomization_has_no_problems(rel: str, crds: manifest_check.CrdSchemas) -> None:
    resources, problems = manifest_check.check_directory(K8S / rel, crds)
    assert resources
    assert not problems, _fmt(problems)


def _serve(res: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    cfg = yaml.safe_load(res["spec"]["serveConfigV2"])
    edit(cfg["applications"][0])
    res["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _worker(res: dict[str, Any]) -> dict[str, Any]:
    return res["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _container(res: dict[str, Any]) -> dict[str, Any]:
    return _worker(res)["template"]["spec"]["containers"][0]


def _replica_dep(app: dict[str, Any]) -> dict[str, Any]:
    return [d for d in app["deployments"] if d["name"] == REPLICA_DEPLOYMENT][0]


# (id, edit of the base RayService, expected path fragment, expected message fragment)
BROKEN: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("crd-unknown-field", lambda r: _worker(r).update(minReplica=1),
     "/spec/rayClusterConfig/workerGroupSpecs/0", "'minReplica' was unexpected"),
    ("crd-wrong-type", lambda r: _worker(r)["rayStartParams"].update({"object-store-memory": 4294967296}),
     "rayStartParams/object-store-memory", "is not of type 'string'"),
    ("crd-missing-required", lambda r: _worker(r).pop("maxReplicas"),
     "/spec/rayClusterConfig/workerGroupSpecs/0", "'maxReplicas' is a required property"),
    ("pod-unknown-field", lambda r: _container(r).update(imagePullPolice="Always"),
     "workerGroupSpecs/0/template/spec/containers/0", "'imagePullPolice' was unexpected"),
    ("metadata-unknown-field", lambda r: r["metadata"].update(label={"a": "b"}), "/metadata", "'label' was unexpected"),
    ("cel-guarded-field", lambda r: r["spec"].update(managedBy="ray.io/kuberay-operator"),
     "/spec/managedBy", "CEL rules that are not evaluated here"),
    ("no-liveness-probe", lambda r: _container(r).pop("livenessProbe"),
     "workerGroupSpecs/0/template/spec/containers/0", "no livenessProbe"),
    ("autoscaling-off", lambda r: r["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling=False),
     "enableInTreeAutoscaling", "must be true"),
    ("metrics-port-undeclared", lambda r: _worker(r)["rayStartParams"].update({"metrics-export-port": "9999"}),
     "workerGroupSpecs/0/rayStartParams", "metrics-export-port"),
    ("serve-yaml-broken", lambda r: r["spec"].update(serveConfigV2="applications: [\n"), "serveConfigV2",
     "not valid YAML"),
    ("serve-unknown-key", lambda r: _serve(r, lambda a: _replica_dep(a).update(autoscaling_confg={})),
     "deployments[1].autoscaling_confg", "unknown key for DeploymentSchema"),
    ("serve-nested-unknown-key",
     lambda r: _serve(r, lambda a: _replica_dep(a)["autoscaling_config"].update(target_ongoing_request=3)),
     "autoscaling_config.target_ongoing_request", "unknown key for AutoscalingConfig"),
    ("serve-bad-autoscaling",
     lambda r: _serve(r, lambda a: _replica_dep(a)["autoscaling_config"].update(min_replicas=9)),
     "autoscaling_config", "min_replicas"),
    ("serve-schema-type", lambda r: _serve(r, lambda a: _replica_dep(a).update(max_ongoing_requests="many")),
     "max_ongoing_requests", "integer"),
    ("args-unknown-key", lambda r: _serve(r, lambda a: a["args"]["pool"].update(dram_gb=3)),
     "args.pool.dram_gb", "unknown key"),
    ("args-unknown-spec-name", lambda r: _serve(r, lambda a: a["args"]["router"].update(gpu_profile="h100")),
     "args", "unknown GPU 'h100'; known GPUs: a100-sxm4-80gb"),
    ("import-path-typo", lambda r: _serve(r, lambda a: a.update(import_path="deployments.app:build_ap")),
     "import_path", "module 'deployments.app' has no attribute 'build_ap'"),
    ("import-module-missing", lambda r: _serve(r, lambda a: a.update(import_path="deployments.nope:build_app")),
     "import_path", "ModuleNotFoundError: No module named 'deployments.nope'"),
    ("router-class-typo",
     lambda r: _serve(r, lambda a: _replica_dep(a)["request_router_config"].update(
         request_router_class="deployments.request_router.DecisionRouter")),
     "request_router_config", "has no attribute 'DecisionRouter'"),
    ("deployment-name-typo", lambda r: _serve(r, lambda a: _replica_dep(a).update(name="VLLMReplicas")),
     "deployments[1].name", "'VLLMReplicas' is not a deployment of the app"),
    ("override-disagrees-with-args",
     lambda r: _serve(r, lambda a: _replica_dep(a)["autoscaling_config"].update(max_replicas=3)),
     "autoscaling_config.max_replicas", "3 but args.replicas.autoscaling_config.max_replicas is 4"),
    ("gpu-count-mismatch", lambda r: _worker(r)["rayStartParams"].update({"num-gpus": "2"}),
     "rayStartParams/num-gpus", "2 but the container's nvidia.com/gpu limit is 1"),
    ("gpu-missing", lambda r: [_container(r)["resources"][k].pop("nvidia.com/gpu") for k in ("limits", "requests")],
     "workerGroupSpecs/0", "no nvidia.com/gpu limit"),
    ("pool-does-not-fit-memory", lambda r: _serve(r, lambda a: a["args"]["pool"].update(dram_bytes=2**40)),
     "limits/memory", "cannot hold pool.dram_bytes (1024.0 GiB)"),
    ("ssd-dir-not-mounted", lambda r: _serve(r, lambda a: a["args"]["pool"].update(ssd_dir="/data/ssd")),
     "workerGroupSpecs/0", "pool.ssd_dir /data/ssd is not on a mounted volume"),
    ("ssd-volume-too-small",
     lambda r: _worker(r)["template"]["spec"]["volumes"][1]["emptyDir"].update(sizeLimit="10Gi"),
     "workerGroupSpecs/0", "sizeLimit 10Gi < pool.ssd_bytes"),
    ("ssd-disk-not-requested", lambda r: _container(r)["resources"]["requests"].pop("ephemeral-storage"),
     "resources/requests", "ephemeral-storage request 0.0 GiB < pool.ssd_bytes"),
    ("model-not-mounted", lambda r: _container(r)["volumeMounts"].pop(0),
     "workerGroupSpecs/0", "engine.model /models/Qwen3-14B is not on a mounted volume"),
    ("ingress-can-land-on-head",
     lambda r: _serve(r, lambda a: a["deployments"][0]["ray_actor_options"].update(num_cpus=0)),
     "headGroupSpec", "ingress replicas (they load the tokenizer) can run here"),
    ("autoscaling-exceeds-cluster", lambda r: _worker(r).update(maxReplicas=2),
     "max_replicas", "4 replicas, but the worker groups fit at most 2"),
]


@pytest.fixture(scope="module")
def clean_base(crds: manifest_check.CrdSchemas) -> frozenset[str]:
    """What the unedited base reports (nothing once every referenced module exists); edits must add to it."""
    return frozenset(str(p) for p in manifest_check.check_resources([ray_service("base")], crds, "broken"))


@pytest.mark.parametrize(("case", "edit", "path", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_manifest_fails_with_a_useful_message(case: str, edit: Callable[[dict[str, Any]], None], path: str,
                                                     message: str, crds: manifest_check.CrdSchemas,
                                                     clean_base: frozenset[str]) -> None:
    res = ray_service("base")
    edit(res)
    problems = [p for p in manifest_check.check_resources([res], crds, "broken") if str(p) not in clean_base]
    assert problems, f"{case}: the checker found nothing new"
    matching = [p for p in problems if path in p.path and message in p.message]
    assert matching, f"{case}: no problem at {path!r} saying {message!r}; got:\n{_fmt(problems)}"
    assert all(p.where == "broken RayService/kvstack" for p in problems)


@needs_kubectl
def test_cli_passes_on_the_repo_and_fails_on_a_broken_overlay(tmp_path: Path, crds: manifest_check.CrdSchemas,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc = manifest_check.main(["--crds", str(CRD_DIR), str(K8S / "overlays" / "local-kind")])
    out = capsys.readouterr().out
    assert rc == 0, out
    broken = tmp_path / "k8s"
    shutil.copytree(K8S, broken, ignore=shutil.ignore_patterns("tools", "__pycache__"))
    patch = broken / "overlays" / "local-kind" / "rayservice-cpu.yaml"
    op = "path: /spec/rayClusterConfig/workerGroupSpecs/0/maxReplicas\n  value: {}"
    patch.write_text(patch.read_text().replace(op.format("2"), op.format('"2"')))
    rc = manifest_check.main(["--crds", str(CRD_DIR), str(broken / "overlays" / "local-kind")])
    out = capsys.readouterr().out
    assert rc == 1
    assert re.search(r"RayService/kvstack: /spec/rayClusterConfig/workerGroupSpecs/0/maxReplicas: '2' is not of "
                     r"type 'integer'", out), out


# -- monitoring ---------------------------------------------------------------------------------------------------

def _monitors() -> list[dict[str, Any]]:
    return [r for r in rendered("monitoring") if r["kind"] in monitoring_check.STRUCTURAL_KINDS]


@pytest.mark.parametrize("rel", APP_DIRS)
def test_pod_monitor_selects_ray_pods_and_their_ports(rel: str) -> None:
    problems = [p for m in _monitors() for p in monitoring_check.check_structure(m, "monitoring")]
    problems += monitoring_check.check_targets(_monitors(), rendered(rel), "monitoring")
    assert not problems, _fmt(problems)


def test_pod_monitor_mistakes_are_reported() -> None:
    (mon,) = _monitors()
    mon["spec"]["podMetricsEndpoints"][1]["port"] = "kvpool-metric"
    mon["spec"]["podMetricsEndpoints"][0]["metricRelabelings"][0]["action"] = "rename"
    mon["spec"]["podMetricsEndpoint"] = []
    problems = monitoring_check.check_structure(mon, "m") + monitoring_check.check_targets([mon], rendered("base"), "m")
    text = _fmt(problems)
    assert "/spec/podMetricsEndpoints/1/port: no selected pod has a container port named 'kvpool-metric'" in text
    assert "/spec/podMetricsEndpoints/0/metricRelabelings/0/action: unknown action 'rename'" in text
    assert "/spec/podMetricsEndpoint: unknown PodMonitor field" in text
    mon["spec"]["selector"]["matchLabels"] = {"app": "other"}
    assert "selects none of the pod templates" in _fmt(monitoring_check.check_targets([mon], rendered("base"), "m"))


def _dashboard() -> dict[str, Any]:
    (cm,) = [r for r in rendered("monitoring") if r["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    return json.loads(text)


METRIC_SOURCES = {  # metric name prefix -> the module that defines those metrics
    "kvstack_router_": REPO_ROOT / "router" / "metrics.py",
    "kvstack_pool_": REPO_ROOT / "kvpool" / "metrics.py",
    "kvstack_transfer_": REPO_ROOT / "kvpool" / "transfer" / "metrics.py",
}
SCRAPE_LABELS = {"namespace", "pod", "instance", "job", "container", "endpoint", "le"}
RAY_SERVE_LABELS = {"deployment", "replica", "application"}


def vllm_package_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return list(spec.submodule_search_locations)[0]


def test_dashboard_has_engine_panels_next_to_kvstacks() -> None:
    exprs = "\n".join(e for _, e in monitoring_check.dashboard_queries(_dashboard()))
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:prefix_cache_hits_total",
                 "vllm:prefix_cache_queries_total"):
        assert name in exprs, name


def test_dashboard_has_the_panels_issue_6_asks_for() -> None:
    queries = monitoring_check.dashboard_queries(_dashboard())
    assert queries and all(expr.strip() for _, expr in queries)
    exprs = "\n".join(e for _, e in queries)
    for needle in ("kvstack_router_ttft_seconds_bucket", "kvstack_router_regret_seconds_bucket",
                   "by (action) (max without (pod, instance, container, endpoint, job) (rate(kvstack_router_decisions",
                   "by (tier) (max without (pod, instance, container, endpoint, job) (rate(kvstack_router_prefix_hit",
                   "sum by (tier) (kvstack_pool_bytes", "rate(kvstack_transfer_bytes_total"):
        assert needle in exprs, needle
    for title, expr in queries:
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), title


def test_dashboard_metric_and_label_names_exist() -> None:
    import ray

    serve_sources = "\n".join(p.read_text() for p in (Path(ray.__file__).parent / "serve" / "_private").glob("*.py"))
    defined: dict[str, monitoring_check.MetricDef] = {}
    for prefix, source in METRIC_SOURCES.items():
        if source.is_file():
            defined.update(monitoring_check.defined_metrics(source))
    # vLLM's engine metrics, as the endpoint's /metrics serves them (router.engine_metrics: a `replica` label added)
    vllm_loggers = Path(vllm_package_dir()) / "v1" / "metrics" / "loggers.py"
    engine = monitoring_check.vllm_defined_metrics(vllm_loggers, labels=("model_name", "engine", "replica"))
    assert "vllm:num_requests_running" in engine and "vllm:time_to_first_token_seconds_bucket" in engine
    problems = []
    for title, expr in monitoring_check.dashboard_queries(_dashboard()):
        names = monitoring_check.referenced_metrics(expr)
        labels = set(SCRAPE_LABELS)
        for name in names:
            if name.startswith("ray_"):
                if f'"{monitoring_check.base_name(name)[len("ray_"):]}"' not in serve_sources:
                    problems.append(f"{title}: {name} is not a Ray Serve metric")
                labels |= RAY_SERVE_LABELS
                continue
            if name.startswith("vllm:"):
                if name not in engine:
                    problems.append(f"{title}: {name} is not an engine metric of the installed vLLM")
                else:
                    labels |= set(engine[name].labels)
                continue
            prefix = next((p for p in METRIC_SOURCES if name.startswith(p)), None)
            if prefix is None:
                problems.append(f"{title}: {name} has no known kvstack prefix")
            elif not METRIC_SOURCES[prefix].is_file():
                problems.append(f"{title}: {name} needs {METRIC_SOURCES[prefix].relative_to(REPO_ROOT)}, not found")
            elif name not in defined:
                problems.append(f"{title}: {name} is not exposed by {METRIC_SOURCES[prefix].relative_to(REPO_ROOT)}")
            else:
                labels |= set(defined[name].labels)
        for label in monitoring_check.grouping_labels(expr) - labels:
            problems.append(f"{title}: label {label!r} is not a label of {sorted(names)}")
    assert not problems, "\n".join(problems)


def test_defined_metrics_reads_names_types_and_labels(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from prometheus_client import Counter, Gauge, Histogram\n"
        "P = 'kvstack_x_'\n"
        "def make(r):\n"
        "    st = ['shard', 'tier']\n"
        "    Counter(P + 'hits', 'h', st, registry=r)\n"
        "    Counter('kvstack_x_done_total', 'd', registry=r)\n"
        "    Gauge(f'{P}bytes', 'b', labelnames=['tier'], registry=r)\n"
        "    Histogram(P + 'seconds', 's', ['op'], registry=r)\n"
    )
    got = monitoring_check.defined_metrics(src)
    assert got["kvstack_x_hits_total"] == monitoring_check.MetricDef("Counter", ("shard", "tier"))
    assert "kvstack_x_hits" not in got and "kvstack_x_done_total" in got
    assert got["kvstack_x_bytes"].labels == ("tier",)
    assert got["kvstack_x_seconds_bucket"].labels == ("op", "le")
    assert {"kvstack_x_seconds_sum", "kvstack_x_seconds_count"} <= set(got)
