"""Render a kustomization directory in Python: exactly the subset of kustomize that kvstack's k8s/ uses.

Who calls it: ``k8s/tools/manifest_check.py`` (and through it ``tests/unit/test_k8s_manifests.py``) to get the
resources an overlay produces, on machines without kubectl. The test cross-checks the output against
``kubectl kustomize`` where kubectl is installed.

Supported, and nothing else (anything else raises ``KustomizeError`` naming the file and key, so a manifest that
needs more kustomize than this never renders silently wrong):
- ``resources``: YAML files (any number of documents) and directories holding a ``kustomization.yaml``.
- ``patches``: ``path`` or inline ``patch``, with an optional ``target`` (group, version, kind, name, namespace).
  A patch is either an RFC 6902 op list (add, remove, replace, move, copy, test; needs a target) or a
  strategic-merge document whose only directive is ``$patch: delete`` (drops the matching resource).
- ``namespace``: sets ``metadata.namespace`` on every namespaced resource.
- ``images``: ``name`` with ``newName`` / ``newTag`` / ``digest``, applied to every ``containers`` and
  ``initContainers`` list anywhere in a resource (kustomize's behaviour for custom resources too).
- ``configMapGenerator``: ``name``, ``files`` (key = file name), ``literals``, ``options.labels``; only with
  ``generatorOptions.disableNameSuffixHash: true``.
Order within one kustomization: resources, generators, patches, namespace, images (as kustomize applies them).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {
    "apiVersion", "kind", "resources", "patches", "namespace", "images", "configMapGenerator", "generatorOptions",
}
# Kinds that kustomize's namespace transformer leaves alone (cluster-scoped).
CLUSTER_SCOPED_KINDS = {
    "Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
    "PriorityClass", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "APIService", "RuntimeClass",
}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not implement, or a patch does not apply."""


def load_yaml_documents(path: Path) -> list[Resource]:
    """Every non-empty document of a YAML file; each must be a mapping."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise KustomizeError(f"{path}: not valid YAML: {exc}") from None
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise KustomizeError(f"{path}: document {i} is a {type(doc).__name__}, expected a mapping")
    return docs


def find_kustomization(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def render(directory: Path) -> list[Resource]:
    """The resources ``kustomize build directory`` would print, in input order."""
    directory = Path(directory)
    kfile = find_kustomization(directory)
    docs = load_yaml_documents(kfile)
    if len(docs) != 1:
        raise KustomizeError(f"{kfile}: expected one document, found {len(docs)}")
    kust = docs[0]
    unknown = sorted(set(kust) - SUPPORTED_KEYS)
    if unknown:
        raise KustomizeError(f"{kfile}: kustomization keys not supported by kustomize_lite: {', '.join(unknown)}")

    out: list[Resource] = []
    for entry in kust.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            out.extend(render(target))
        elif target.is_file():
            out.extend(copy.deepcopy(load_yaml_documents(target)))
        else:
            raise KustomizeError(f"{kfile}: resources: {entry!r} does not exist")
    out.extend(_generate_configmaps(kust, directory, kfile))
    for i, patch in enumerate(kust.get("patches", [])):
        out = _apply_patch_entry(out, patch, directory, f"{kfile}: patches[{i}]")
    if "namespace" in kust:
        for res in out:
            if res.get("kind") not in CLUSTER_SCOPED_KINDS:
                res.setdefault("metadata", {})["namespace"] = kust["namespace"]
    for i, image in enumerate(kust.get("images", [])):
        _apply_image(out, image, f"{kfile}: images[{i}]")
    return out


# -- generators ---------------------------------------------------------------------------------------------------

def _generate_configmaps(kust: Resource, directory: Path, kfile: Path) -> list[Resource]:
    generators = kust.get("configMapGenerator", [])
    if not generators:
        return []
    options = kust.get("generatorOptions", {})
    if set(options) - {"disableNameSuffixHash"} or options.get("disableNameSuffixHash") is not True:
        raise KustomizeError(f"{kfile}: configMapGenerator needs generatorOptions.disableNameSuffixHash: true only")
    out = []
    for i, gen in enumerate(generators):
        where = f"{kfile}: configMapGenerator[{i}]"
        unknown = set(gen) - {"name", "files", "literals", "options"}
        if unknown or set(gen.get("options", {})) - {"labels"}:
            raise KustomizeError(f"{where}: unsupported keys {sorted(unknown) or sorted(gen['options'])}")
        data: dict[str, str] = {}
        for f in gen.get("files", []):
            if "=" in f:
                raise KustomizeError(f"{where}: 'key=path' file entries are not supported")
            path = directory / f
            if not path.is_file():
                raise KustomizeError(f"{where}: file {f!r} does not exist")
            data[Path(f).name] = path.read_text()
        for lit in gen.get("literals", []):
            key, sep, value = lit.partition("=")
            if not sep:
                raise KustomizeError(f"{where}: literal {lit!r} is not key=value")
            data[key] = value
        meta: dict[str, Any] = {"name": gen["name"]}
        labels = gen.get("options", {}).get("labels")
        if labels:
            meta["labels"] = dict(labels)
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    return out


# -- patches ------------------------------------------------------------------------------------------------------

def _group_version(res: Resource) -> tuple[str, str]:
    api = str(res.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    return group, version


def _matches(res: Resource, target: dict[str, Any], where: str) -> bool:
    unknown = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unknown:
        raise KustomizeError(f"{where}: target keys not supported: {sorted(unknown)}")
    group, version = _group_version(res)
    meta = res.get("metadata", {})
    checks = {
        "group": group, "version": version, "kind": res.get("kind"), "name": meta.get("name"),
        "namespace": meta.get("namespace"),
    }
    return all(checks[k] == v for k, v in target.items())


def _apply_patch_entry(resources: list[Resource], entry: dict[str, Any], directory: Path, where: str) -> list[Resource]:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown:
        raise KustomizeError(f"{where}: keys not supported: {sorted(unknown)}")
    if ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{where}: give exactly one of 'path' and 'patch'")
    if "path" in entry:
        text = (directory / entry["path"]).read_text()
        where = f"{where} ({entry['path']})"
    else:
        text = entry["patch"]
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KustomizeError(f"{where}: not valid YAML: {exc}") from None
    target = entry.get("target")

    if isinstance(body, list):  # RFC 6902
        if target is None:
            raise KustomizeError(f"{where}: a JSON 6902 patch needs a target")
        hits = [i for i, r in enumerate(resources) if _matches(r, target, where)]
        if not hits:
            raise KustomizeError(f"{where}: no resource matches target {target}")
        for i in hits:
            resources[i] = apply_json6902(resources[i], body, where)
        return resources

    if isinstance(body, dict):  # strategic merge: only whole-resource deletion is supported
        if body.get("$patch") != "delete":
            raise KustomizeError(f"{where}: strategic-merge patches other than '$patch: delete' are not supported")
        if target is None:
            group, version = _group_version(body)
            target = {"kind": body.get("kind"), "name": body.get("metadata", {}).get("name"), "version": version}
            if group:
                target["group"] = group
        kept = [r for r in resources if not _matches(r, target, where)]
        if len(kept) == len(resources):
            raise KustomizeError(f"{where}: '$patch: delete' matches no resource ({target})")
        return kept

    raise KustomizeError(f"{where}: a patch must be an op list or a mapping, got {type(body).__name__}")


def _pointer(path: str, where: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"{where}: JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], where: str, path: str) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        node = _child(node, part, where, path)
    return node, parts[-1]


def _child(node: Any, part: str, where: str, path: str) -> Any:
    if isinstance(node, dict):
        if part not in node:
            raise KustomizeError(f"{where}: path {path}: no key {part!r}")
        return node[part]
    if isinstance(node, list):
        index = _index(node, part, where, path, allow_end=False)
        return node[index]
    raise KustomizeError(f"{where}: path {path}: cannot descend into a {type(node).__name__} at {part!r}")


def _index(node: list[Any], part: str, where: str, path: str, *, allow_end: bool) -> int:
    if part == "-" and allow_end:
        return len(node)
    if not part.isdigit() or (part != "0" and part.startswith("0")):
        raise KustomizeError(f"{where}: path {path}: {part!r} is not a list index")
    index = int(part)
    if index > len(node) or (index == len(node) and not allow_end):
        raise KustomizeError(f"{where}: path {path}: index {index} out of range (length {len(node)})")
    return index


def _get(doc: Any, path: str, where: str) -> Any:
    node = doc
    for part in _pointer(path, where):
        node = _child(node, part, where, path)
    return node


def _remove(doc: Any, path: str, where: str) -> Any:
    parts = _pointer(path, where)
    if not parts:
        raise KustomizeError(f"{where}: cannot remove the whole document")
    parent, last = _parent(doc, parts, where, path)
    if isinstance(parent, dict):
        if last not in parent:
            raise KustomizeError(f"{where}: remove {path}: no key {last!r}")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, where, path, allow_end=False))
    raise KustomizeError(f"{where}: remove {path}: parent is a {type(parent).__name__}")


def _add(doc: Any, path: str, value: Any, where: str, *, replace: bool) -> Any:
    parts = _pointer(path, where)
    if not parts:
        return value
    parent, last = _parent(doc, parts, where, path)
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise KustomizeError(f"{where}: replace {path}: no key {last!r} (use add)")
        parent[last] = value
    elif isinstance(parent, list):
        index = _index(parent, last, where, path, allow_end=not replace)
        if replace:
            parent[index] = value
        else:
            parent.insert(index, value)
    else:
        raise KustomizeError(f"{where}: {path}: parent is a {type(parent).__name__}")
    return doc


def apply_json6902(doc: Resource, ops: list[Any], where: str = "patch") -> Resource:
    """Apply an RFC 6902 op list to a copy of ``doc``; any failing op (including ``test``) raises."""
    out: Any = copy.deepcopy(doc)
    for n, op in enumerate(ops):
        here = f"{where}: op {n}"
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise KustomizeError(f"{here}: each op needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise KustomizeError(f"{here}: {kind} needs a 'value'")
        if kind == "add":
            out = _add(out, path, copy.deepcopy(op["value"]), here, replace=False)
        elif kind == "replace":
            out = _add(out, path, copy.deepcopy(op["value"]), here, replace=True)
        elif kind == "remove":
            _remove(out, path, here)
        elif kind in ("move", "copy"):
            if "from" not in op:
                raise KustomizeError(f"{here}: {kind} needs 'from'")
            value = _remove(out, op["from"], here) if kind == "move" else copy.deepcopy(_get(out, op["from"], here))
            out = _add(out, path, value, here, replace=False)
        elif kind == "test":
            actual = _get(out, path, here)
            if actual != op["value"]:
                raise KustomizeError(
                    f"{here}: test {path} failed: expected {json.dumps(op['value'])}, found {json.dumps(actual)}"
                )
        else:
            raise KustomizeError(f"{here}: unknown op {kind!r}")
    return out


# -- images -------------------------------------------------------------------------------------------------------

def _split_image(ref: str) -> tuple[str, str, str]:
    """(name, ':tag' or '', '@digest' or '')."""
    name, at, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, at + digest


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _apply_image(resources: list[Resource], image: dict[str, Any], where: str) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown or "name" not in image:
        raise KustomizeError(f"{where}: needs 'name'; unsupported keys {sorted(unknown)}")
    for res in resources:
        for container in _containers(res):
            ref = container.get("image")
            if not isinstance(ref, str):
                continue
            name, tag, digest = _split_image(ref)
            if name != image["name"]:
                continue
            if "newName" in image:
                name = image["newName"]
            if "newTag" in image:
                tag, digest = ":" + str(image["newTag"]), ""
            if "digest" in image:
                tag, digest = "", "@" + str(image["digest"])
            container["image"] = name + tag + digest
