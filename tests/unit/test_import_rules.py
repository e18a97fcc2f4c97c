"""The rooms' import rules (DESIGN.md, "Layout") and no import cycle between modules, read from the source.

Every ``import`` / ``from … import`` of the project's own modules is collected with ``ast`` — at module level and inside
functions alike, so a cycle hidden behind a function-level import counts too — and checked: a room imports only the
rooms below it (``configs ← kvpool ← router ← deployments ← cluster ← bench``; ``k8s/tools`` checks the app from
outside and generates serveConfigV2 with the config loader of ``cluster``), bench never imports the CLI's commands (``cluster.commands``: it talks to ``kvstack serve`` as a subprocess;
``cluster.cli`` finds bench's commands by module name), and the module graph has no cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOMS = ("configs", "kvpool", "router", "deployments", "cluster", "bench", "k8s")
ALLOWED = {
    "configs": set(),
    "kvpool": {"configs"},
    "router": {"configs", "kvpool"},
    "deployments": {"configs", "kvpool", "router"},
    "cluster": {"configs", "kvpool", "router", "deployments"},
    "bench": {"configs", "kvpool", "router", "deployments", "cluster"},
    # k8s.tools.serve_configs writes serveConfigV2 from a kvstack config: the config file's loader (cluster.serve_config)
    "k8s": {"configs", "kvpool", "router", "deployments", "cluster"},
}
FORBIDDEN = {"bench": ("cluster.commands",), "k8s": ("cluster.commands",)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (anywhere in its source)."""
    modules = {_module_name(p): p for room in ROOMS for p in (REPO / room).rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
        graph.setdefault(name, set())
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_rooms_import_only_the_rooms_below() -> None:
    wrong = []
    for module, targets in import_graph().items():
        room = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != room and other not in ALLOWED[room]:
                wrong.append(f"{module} -> {target}")
            if any(target == f or target.startswith(f + ".") for f in FORBIDDEN.get(room, ())):
                wrong.append(f"{module} -> {target} (forbidden)")
    assert not wrong, "imports against the arrows:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the walk found the project's modules"
    assert not cycles(graph), cycles(graph)
