"""Validate kvstack's Kubernetes manifests without a cluster.

    python -m k8s.tools.manifest_check [--crds DIR] [KUSTOMIZATION_DIR ...]     (from the repository root)

Prints one line per problem (file or overlay, resource, JSON path, what is wrong) and exits 1 if there is any.
Default directories: k8s/base, every k8s/overlays/*, k8s/monitoring. Called by tests/unit/test_k8s_manifests.py.

Checks:
- Every YAML / JSON file under k8s/ parses (``parse_tree``); each kustomization renders with
  ``kubectl kustomize`` (``render``; kubectl ships kustomize — without kubectl nothing can be rendered, and the
  check says so).
- Custom resources validate against the CRDs found in ``--crds`` (default ``../shared/k8s-crds`` next to the
  repository): the CRD's openAPIV3Schema made strict the way the API server's strict field validation is:
  ``additionalProperties: false`` wherever the structural schema lists properties and does not set
  ``x-kubernetes-preserve-unknown-fields``. CEL rules (``x-kubernetes-validations``) cannot be evaluated here, so a
  manifest that sets a CEL-guarded field is reported rather than passed. ``metadata`` is checked as ObjectMeta.
- Core kinds, and every pod template inside a RayService, against the Kubernetes OpenAPI schemas shipped with
  kubernetes-validate (strict: unknown fields rejected), for Kubernetes ``K8S_VERSION``.
- RayService: the embedded ``rayClusterConfig`` also validates as a RayCluster spec; every Ray container has
  liveness and readiness probes; in-tree autoscaling is on; the metrics export port is a declared container port;
  ``serveConfigV2`` passes ``serve_check`` (Ray Serve's schema, key names, AppConfig, imports, consistency).
- Prometheus Operator kinds are validated against their CRD when ``--crds`` holds it, and by ``monitoring_check``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from k8s.tools import monitoring_check, serve_check
from k8s.tools.serve_check import Problem

K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests claim to support (k8s/README.md)
K8S_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = K8S_DIR.parent
DEFAULT_CRD_DIR = REPO_ROOT.parent / "shared" / "k8s-crds"
OBJECT_META_REF = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
CEL_KEY = "x-kubernetes-validations"


# -- rendering ----------------------------------------------------------------------------------------------------

class KustomizeError(Exception):
    """A kustomization did not render (kubectl missing, or kustomize's own error message)."""


def kubectl() -> str | None:
    """The kubectl executable, or None when it is not installed."""
    return shutil.which("kubectl")


def render(directory: Path, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The resources ``kubectl kustomize DIRECTORY`` produces; ``KustomizeError`` with kustomize's message."""
    exe = kubectl()
    if exe is None:
        raise KustomizeError("kubectl not found on PATH: it renders the kustomizations (`kubectl kustomize`)")
    out = subprocess.run([exe, "kustomize", str(directory)], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise KustomizeError(out.stderr.strip() or f"kubectl kustomize exited {out.returncode}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# -- files --------------------------------------------------------------------------------------------------------

def parse_tree(root: Path) -> list[Problem]:
    """Every .yaml/.yml/.json file under ``root`` parses."""
    problems = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".yaml", ".yml"):
            try:
                list(yaml.safe_load_all(path.read_text()))
            except yaml.YAMLError as exc:
                problems.append(Problem(str(path), "", f"not valid YAML: {exc}"))
        elif path.suffix == ".json":
            try:
                json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                problems.append(Problem(str(path), "", f"not valid JSON: {exc}"))
    return problems


# -- CRD schemas --------------------------------------------------------------------------------------------------

def strict_schema(node: Any, *, root: bool = False) -> Any:
    """A copy of an openAPIV3Schema with unknown fields rejected, ``nullable`` honoured, root metadata as ObjectMeta."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = strict_schema(value)
        else:
            out[key] = value
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if not preserve and "additionalProperties" not in node:
        if "properties" in node:
            out["additionalProperties"] = False
        elif node.get("type") == "object" and not node.get("x-kubernetes-embedded-resource"):
            out["additionalProperties"] = False  # a structural object with no fields: anything set would be pruned
    if node.get("nullable") is True and isinstance(node.get("type"), str):
        out["type"] = [node["type"], "null"]
    if root:
        out["properties"]["metadata"] = {"$ref": OBJECT_META_REF}
    return out


def _cel_keyword(validator: Any, rules: Any, instance: Any, schema: Any) -> Iterable[jsonschema.ValidationError]:
    messages = "; ".join(r.get("message") or r.get("rule", "") for r in rules)
    yield jsonschema.ValidationError(f"this field has CEL rules that are not evaluated here ({messages}); "
                                     "check it against a real API server")


@functools.lru_cache(maxsize=1)
def _k8s_registry() -> Any:
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    version = _schema_version()
    defs = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", K8S_VERSION)
    return Resource.from_contents(defs) @ Registry()


def _schema_version() -> str:
    from kubernetes_validate.utils import all_versions, major_minor

    return [v for v in all_versions() if major_minor(v) <= K8S_VERSION][-1]


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {CEL_KEY: _cel_keyword})


@dataclass
class CrdSchemas:
    """(group, version, kind) -> strict JSON schema, from every CRD in a directory."""

    schemas: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    source: dict[tuple[str, str, str], str] = field(default_factory=dict)
    _validators: dict[tuple[str, str, str], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, directory: Path) -> CrdSchemas:
        out = cls()
        for path in sorted(directory.glob("*.y*ml")):
            loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the KubeRay CRDs are ~1 MB each
            for doc in yaml.load_all(path.read_text(), Loader=loader):
                if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec["versions"]:
                    key = (spec["group"], version["name"], spec["names"]["kind"])
                    out.schemas[key] = strict_schema(version["schema"]["openAPIV3Schema"], root=True)
                    out.source[key] = path.name
        return out

    def has(self, group: str, kind: str) -> bool:
        return any(g == group and k == kind for g, _, k in self.schemas)

    def validate(self, resource: dict[str, Any], where: str) -> list[Problem]:
        group, _, version = str(resource.get("apiVersion", "")).rpartition("/")
        key = (group, version, str(resource.get("kind")))
        if key not in self.schemas:
            return [Problem(where, "/apiVersion", f"no CRD version {version!r} of {key[2]} in the CRDs given")]
        if key not in self._validators:
            self._validators[key] = _Validator(self.schemas[key], registry=_k8s_registry())
        validator = self._validators[key]
        return [_schema_problem(where, e) for e in sorted(validator.iter_errors(resource), key=lambda e: list(e.path))]


def _schema_problem(where: str, err: jsonschema.ValidationError) -> Problem:
    path = "/" + "/".join(str(p) for p in err.absolute_path)
    message = err.message
    if err.validator in ("anyOf", "oneOf") and err.context:
        message = "; ".join(sorted({c.message for c in err.context}))
    return Problem(where, path, message)


# -- core kinds ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _core_validator(api_version: str, kind: str) -> Any:
    """kubernetes-validate's strict schema for a core kind (as ``kubernetes_validate.validate`` loads it), cached."""
    import re

    from kubernetes_validate.utils import schema_contents

    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = schema_contents(f"kubernetes-json-schema/v{_schema_version()}-local-strict/{kind.lower()}-{api}.json",
                             K8S_VERSION)
    return jsonschema.Draft202012Validator(schema, registry=_k8s_registry())


def validate_core(resource: dict[str, Any], where: str) -> list[Problem]:
    """A core Kubernetes resource against the Kubernetes OpenAPI schema (unknown fields rejected)."""
    try:
        validator = _core_validator(str(resource.get("apiVersion")), str(resource.get("kind")))
    except FileNotFoundError:
        return [Problem(where, "/kind", f"no Kubernetes {K8S_VERSION} schema for {resource.get('apiVersion')} "
                                        f"{resource.get('kind')}")]
    errors = sorted(validator.iter_errors(resource), key=lambda e: list(e.absolute_path))
    return [_schema_problem(where, e) for e in errors]


def validate_pod_template(template: dict[str, Any], where: str, path: str) -> list[Problem]:
    """A pod template embedded in a custom resource, as a core v1 PodTemplate."""
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    return [Problem(p.where, path + p.path.removeprefix("/template"), p.message) for p in validate_core(wrapper, where)]


# -- RayService ---------------------------------------------------------------------------------------------------

def _ray_pod_templates(cluster: dict[str, Any], base: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(f"{base}/headGroupSpec/template", (cluster.get("headGroupSpec") or {}).get("template") or {})]
    for i, w in enumerate(cluster.get("workerGroupSpecs") or []):
        out.append((f"{base}/workerGroupSpecs/{i}/template", w.get("template") or {}))
    return out


def check_ray_service(res: dict[str, Any], crds: CrdSchemas, where: str,
                      already: list[Problem] | None = None) -> list[Problem]:
    """Everything beyond the RayService CRD schema (whose findings, ``already``, are not repeated)."""
    problems: list[Problem] = []
    spec = res.get("spec") or {}
    cluster = spec.get("rayClusterConfig") or {}
    base = "/spec/rayClusterConfig"
    seen = {(p.path, p.message) for p in already or []}
    if crds.has("ray.io", "RayCluster"):  # the embedded cluster spec must also be a valid RayCluster spec
        as_cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "check"}, "spec": cluster}
        for p in crds.validate(as_cluster, where):
            path = base + p.path.removeprefix("/spec")
            if (path, p.message) not in seen:
                problems.append(Problem(p.where, path, f"(as a RayCluster) {p.message}"))
    for path, template in _ray_pod_templates(cluster, base):
        problems += [p for p in validate_pod_template(template, where, path) if (p.path, p.message) not in seen]
        for c, container in enumerate((template.get("spec") or {}).get("containers") or []):
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in container:
                    problems.append(Problem(where, f"{path}/spec/containers/{c}", f"no {probe}"))
    if cluster.get("enableInTreeAutoscaling") is not True:
        problems.append(Problem(where, f"{base}/enableInTreeAutoscaling", "must be true (Serve autoscaling adds pods)"))
    for group in serve_check.node_groups(cluster, base):
        port = group.start_params.get("metrics-export-port")
        if port is None or int(port) not in group.ports.values() or group.ports.get("metrics") != int(port):
            problems.append(Problem(where, f"{group.path}/rayStartParams", "metrics-export-port must be set and "
                                    "declared as the container port named 'metrics' (scraped by k8s/monitoring)"))

    cfg, errs = serve_check.parse_serve_config(spec.get("serveConfigV2"), where)
    problems += errs
    if cfg is None:
        return problems
    problems += serve_check.check_serve_schema(cfg, where)
    for a, app in enumerate(cfg.get("applications") or []):
        if not isinstance(app, dict):
            continue
        path = f"serveConfigV2.applications[{a}]"
        args, arg_problems = serve_check.parse_args(app, where, f"{path}.args")
        problems += arg_problems
        problems += serve_check.check_imports(app, args, where, path)
        if args is not None:
            problems += serve_check.check_consistency(app, args, cluster, where, path, base)
    return problems


# -- driver -------------------------------------------------------------------------------------------------------

def check_resources(resources: list[dict[str, Any]], crds: CrdSchemas, source: str) -> list[Problem]:
    """Schema and semantic checks of rendered resources (one kustomization's output)."""
    problems: list[Problem] = []
    for res in resources:
        where = f"{source} {res.get('kind')}/{(res.get('metadata') or {}).get('name')}"
        group = str(res.get("apiVersion", "")).rpartition("/")[0]
        kind = str(res.get("kind"))
        schema_problems: list[Problem] = []
        if crds.has(group, kind):
            schema_problems = crds.validate(res, where)
            problems += schema_problems
        elif "." in group and not group.endswith(".k8s.io"):
            if kind not in monitoring_check.STRUCTURAL_KINDS:
                problems.append(Problem(where, "/apiVersion", f"no CRD for {group} {kind} available to validate it"))
        else:
            problems += validate_core(res, where)
        if kind == "RayService":
            problems += check_ray_service(res, crds, where, schema_problems)
        if kind in monitoring_check.STRUCTURAL_KINDS:
            problems += monitoring_check.check_structure(res, where)
    return problems


def check_directory(directory: Path, crds: CrdSchemas) -> tuple[list[dict[str, Any]], list[Problem]]:
    try:
        resources = render(directory)
    except KustomizeError as exc:
        return [], [Problem(str(directory), "kustomization", str(exc))]
    return resources, check_resources(resources, crds, str(directory))


def default_directories() -> list[Path]:
    overlays = sorted(p for p in (K8S_DIR / "overlays").iterdir() if p.is_dir())
    return [K8S_DIR / "base", *overlays, K8S_DIR / "monitoring"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crds", type=Path, default=DEFAULT_CRD_DIR, help="directory of CRD YAML files")
    parser.add_argument("dirs", nargs="*", type=Path, help="kustomization directories")
    args = parser.parse_args(argv)
    if not args.crds.is_dir():
        print(f"CRD directory {args.crds} not found (use --crds)", file=sys.stderr)
        return 2
    crds = CrdSchemas.load(args.crds)
    problems = parse_tree(K8S_DIR)
    rendered: dict[Path, list[dict[str, Any]]] = {}
    for directory in args.dirs or default_directories():
        resources, found = check_directory(directory, crds)
        rendered[directory] = resources
        problems += found
    pods = [r for d, rs in rendered.items() if d.name != "monitoring" for r in rs]
    for directory, resources in rendered.items():
        monitors = [r for r in resources if r.get("kind") in monitoring_check.STRUCTURAL_KINDS]
        if monitors and pods:
            problems += monitoring_check.check_targets(monitors, pods, str(directory))
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {len(rendered)} kustomization(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
