"""Checks of k8s/monitoring: the PodMonitor's shape and targets, and the Grafana dashboard's metric names.

Who calls it: ``k8s/tools/manifest_check.py`` (structure and targets) and tests/unit/test_k8s_manifests.py
(dashboard metric names against the metrics the code defines).

- ``check_structure``: the Prometheus Operator fields used here, by name (the CRD is validated too when the CRD
  directory holds ``monitoring.coreos.com`` CRDs); relabel actions and regexes.
- ``check_targets``: the PodMonitor's selector matches the kvstack pod templates and each endpoint's port name is a
  container port of a selected pod (otherwise Prometheus silently scrapes nothing).
- ``dashboard_queries`` / ``referenced_metrics``: every PromQL expression of the dashboard and the metric names in it.
- ``defined_metrics``: the sample names a Python module exposes, read from its source (``Counter("name", ...)``,
  ``Histogram(PREFIX + "x", ...)``, ...) without importing it: a counter ``x`` exposes ``x_total``, a histogram
  ``x_bucket``/``x_sum``/``x_count``.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k8s.tools.serve_check import Problem

STRUCTURAL_KINDS = {"PodMonitor", "ServiceMonitor"}
_SPEC_KEYS = {
    "PodMonitor": {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels",
                   "sampleLimit", "targetLimit", "labelLimit", "attachMetadata"},
    "ServiceMonitor": {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels",
                       "sampleLimit", "targetLimit", "labelLimit", "attachMetadata"},
}
_ENDPOINT_KEYS = {"port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
                  "honorLabels", "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig",
                  "bearerTokenSecret",
                  "basicAuth", "authorization", "followRedirects", "enableHttp2", "filterRunning", "proxyUrl"}
_RELABEL_KEYS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
_RELABEL_ACTIONS = {"replace", "keep", "drop", "keepequal", "dropequal", "hashmod", "labelmap", "labeldrop",
                    "labelkeep", "lowercase", "uppercase"}
_METRIC_RE = re.compile(r"\b((?:kvstack|ray)_[a-zA-Z0-9_]+|vllm:[a-zA-Z0-9_]+)")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def check_structure(res: dict[str, Any], where: str) -> list[Problem]:
    problems: list[Problem] = []
    kind = str(res.get("kind"))
    spec = res.get("spec") or {}
    for key in sorted(set(spec) - _SPEC_KEYS[kind]):
        problems.append(Problem(where, f"/spec/{key}", f"unknown {kind} field"))
    if not (spec.get("selector") or {}).get("matchLabels"):
        problems.append(Problem(where, "/spec/selector", "needs matchLabels"))
    list_key = "podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"
    endpoints = spec.get(list_key) or []
    if not endpoints:
        problems.append(Problem(where, f"/spec/{list_key}", "no endpoints"))
    for i, ep in enumerate(endpoints):
        base = f"/spec/{list_key}/{i}"
        for key in sorted(set(ep) - _ENDPOINT_KEYS):
            problems.append(Problem(where, f"{base}/{key}", "unknown endpoint field"))
        for rk in ("relabelings", "metricRelabelings"):
            for j, rule in enumerate(ep.get(rk) or []):
                here = f"{base}/{rk}/{j}"
                for key in sorted(set(rule) - _RELABEL_KEYS):
                    problems.append(Problem(where, f"{here}/{key}", "unknown relabel field"))
                if rule.get("action", "replace").lower() not in _RELABEL_ACTIONS:
                    problems.append(Problem(where, f"{here}/action", f"unknown action {rule.get('action')!r}"))
                try:
                    re.compile(str(rule.get("regex", "(.*)")))
                except re.error as exc:
                    problems.append(Problem(where, f"{here}/regex", f"invalid regex: {exc}"))
    return problems


def _pod_templates(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Pod templates anywhere in a resource (RayService / RayCluster groups, Deployments, ...)."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            tmpl = node.get("template")
            if isinstance(tmpl, dict) and isinstance(tmpl.get("spec"), dict) and "containers" in tmpl["spec"]:
                found.append(tmpl)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(res.get("spec"))
    return found


def check_targets(monitors: list[dict[str, Any]], resources: list[dict[str, Any]], source: str) -> list[Problem]:
    templates = [t for r in resources for t in _pod_templates(r)]
    problems: list[Problem] = []
    for mon in monitors:
        where = f"{source} {mon.get('kind')}/{(mon.get('metadata') or {}).get('name')}"
        want = ((mon.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        selected = [t for t in templates
                    if all(((t.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in want.items())]
        if not selected:
            problems.append(Problem(where, "/spec/selector/matchLabels", f"{want} selects none of the pod templates"))
            continue
        ports = {p.get("name") for t in selected for c in t["spec"].get("containers") or []
                 for p in c.get("ports") or []}
        key = "podMetricsEndpoints" if mon.get("kind") == "PodMonitor" else "endpoints"
        for i, ep in enumerate((mon.get("spec") or {}).get(key) or []):
            if "port" in ep and ep["port"] not in ports:
                problems.append(Problem(where, f"/spec/{key}/{i}/port",
                                        f"no selected pod has a container port named {ep['port']!r} (has: "
                                        f"{', '.join(sorted(p for p in ports if p))})"))
    return problems


# -- dashboard ----------------------------------------------------------------------------------------------------

def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel (rows included)."""
    out = []

    def panels(items: list[dict[str, Any]]) -> None:
        for panel in items:
            for target in panel.get("targets") or []:
                out.append((str(panel.get("title")), str(target.get("expr", ""))))
            panels(panel.get("panels") or [])

    panels(dashboard.get("panels") or [])
    return out


def referenced_metrics(expr: str) -> set[str]:
    return set(_METRIC_RE.findall(expr))


def base_name(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _string_value(node: ast.AST, consts: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_value(node.left, consts), _string_value(node.right, consts)
        return left + right if left is not None and right is not None else None
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            s = _string_value(v.value if isinstance(v, ast.FormattedValue) else v, consts)
            if s is None:
                return None
            parts.append(s)
        return "".join(parts)
    return None


_EXPOSED = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
    "Info": ("_info",),
    "Enum": ("",),
}


@dataclass(frozen=True)
class MetricDef:
    type: str
    labels: tuple[str, ...]


def _string_list(node: ast.AST, lists: dict[str, list[str]], consts: dict[str, str]) -> list[str] | None:
    if isinstance(node, ast.Name):
        return lists.get(node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [_string_value(e, consts) for e in node.elts]
        return None if any(v is None for v in values) else [v for v in values if v is not None]
    return None


def defined_metrics(path: Path) -> dict[str, MetricDef]:
    """Exposed sample name -> (type, label names) for every prometheus_client metric constructed in ``path``."""
    tree = ast.parse(path.read_text())
    consts: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _string_value(node.value, consts)
            if value is not None:
                consts[node.targets[0].id] = value
    lists: dict[str, list[str]] = {}
    for node in ast.walk(tree):  # label lists bound to a name (``st = ["shard", "tier"]``)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values = _string_list(node.value, {}, consts)
            if values is not None:
                lists[node.targets[0].id] = values
    out: dict[str, MetricDef] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if func not in _EXPOSED:
            continue
        name = _string_value(node.args[0], consts)
        if name is None:
            continue
        label_node = node.args[2] if len(node.args) > 2 else next(
            (k.value for k in node.keywords if k.arg == "labelnames"), None)
        labels = tuple(_string_list(label_node, lists, consts) or ()) if label_node is not None else ()
        if func == "Counter" and name.endswith("_total"):
            name = name[: -len("_total")]
        for suffix in _EXPOSED[func]:
            out[name + suffix] = MetricDef(func, labels + (("le",) if suffix == "_bucket" else ()))
    return out


_VLLM_KINDS = {"_counter_cls": "Counter", "_gauge_cls": "Gauge", "_histogram_cls": "Histogram"}


def vllm_defined_metrics(path: Path, labels: tuple[str, ...] = ("model_name", "engine")) -> dict[str, MetricDef]:
    """Exposed sample name -> (type, labels) of vLLM's engine metrics, read from the source of vLLM's Prometheus
    stat logger (``vllm/v1/metrics/loggers.py``: ``self._gauge_cls(name="vllm:...", ...)``). Every one carries
    vLLM's ``model_name`` and ``engine`` labels (some more, which the dashboard does not use)."""
    out: dict[str, MetricDef] = {}
    for match in re.finditer(r"self\.(_counter_cls|_gauge_cls|_histogram_cls)\(\s*name=\"(vllm:[a-zA-Z0-9_]+)\"",
                             path.read_text()):
        kind = _VLLM_KINDS[match.group(1)]
        name = match.group(2)
        for suffix in _EXPOSED[kind]:
            out[name + suffix] = MetricDef(kind, labels)
    return out


def grouping_labels(expr: str) -> set[str]:
    """Label names in the ``by (...)`` / ``without (...)`` clauses of a PromQL expression."""
    out: set[str] = set()
    for match in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        out |= {label.strip() for label in match.group(1).split(",") if label.strip()}
    return out


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
