"""The import layers hold: the HTTP ingress and the request router import neither torch nor the engine,
``workers/`` never imports ``cluster/``, and no project modules import each other in a circle.

Both checks read the code, not a run of the server: the first imports the ingress modules in a fresh
interpreter where torch and ``workers.engine`` cannot be imported; the second parses every ``.py`` under
``cluster/`` and ``workers/`` (module-level and function-level imports; ``if TYPE_CHECKING:`` blocks, which
never run, are left out).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "workers")

# What a ``num_cpus: 0`` ingress replica and the request router inside every DeploymentHandle import.
INGRESS_MODULES = (
    "cluster.ingress.openai_api", "cluster.ingress.protocol", "cluster.ingress.responses", "cluster.ingress.messages", "cluster.routing.request_router",
    "cluster.ingress.clients", "cluster.ingress.pools", "cluster.ingress.auth", "cluster.ingress.limits", "cluster.ingress.drain",
)
BLOCKED = ("torch", "workers.engine")

_NO_TORCH = """
import importlib, sys

BLOCKED = {blocked!r}

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"the ingress must not import {{name}}")
        return None

sys.meta_path.insert(0, Refuse())
for module in {modules!r}:
    importlib.import_module(module)
"""

def test_ingress_imports_neither_torch_nor_the_engine():
    code = _NO_TORCH.format(blocked=BLOCKED, modules=INGRESS_MODULES)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    """(line, dotted name) of everything ``tree`` imports, at any depth except ``if TYPE_CHECKING:`` bodies;
    ``from a import b`` gives ``a.b`` (a submodule or a name in ``a``, settled by the caller)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base
        stack.extend(ast.iter_child_nodes(node))


def _project_graph() -> tuple[dict[str, dict[str, int]], dict[str, list[tuple[int, str]]]]:
    """The project's import graph: module -> {imported project module: first line}, and the raw imported
    names per module (for rules about names outside the graph)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    raw: dict[str, list[tuple[int, str]]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = sorted(set(_imported_names(tree, module, path.name == "__init__.py")))
        raw[module] = names
        edges: dict[str, int] = {}
        for line, name in names:
            target = name
            while target and target not in files:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph, raw


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a module path
    that starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_circle(graph, set(c), c[0]) for c in components]


def _one_circle(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")


def _describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_workers_never_import_cluster():
    _, raw = _project_graph()
    upward = [f"{m}:{line} imports {name}" for m, names in raw.items() if m.startswith("workers")
              for line, name in names if name == "cluster" or name.startswith("cluster.")]
    assert not upward, "workers/ must not import cluster/:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph, _ = _project_graph()
    circles = _cycles(graph)
    assert not circles, "import circles:\n" + "\n".join(_describe(graph, c) for c in circles)


def test_cycle_finder_reports_a_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _describe(graph, ["a", "b", "c", "a"]) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_graph_reads_function_level_imports_and_skips_type_checking():
    tree = ast.parse("import a.b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from c import d\n"
                     "def f():\n    from .e import g\n")
    assert sorted(_imported_names(tree, "pkg.mod", False)) == [(1, "a.b"), (2, "typing.TYPE_CHECKING"),
                                                               (6, "pkg.e.g")]


# cluster/'s wings from the ground floor up: a wing imports only wings on its own floor or below
# (cluster/README.md). Two wings on one floor do not import each other.
WING_FLOORS = {"config": 0, "observability": 1, "ingress": 2, "replica": 3, "routing": 3, "deploy": 4,
               "evaluation": 4, "cli": 5}


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "cluster" and len(parts) > 1 else None


def test_cluster_wings_never_import_upward():
    graph, _ = _project_graph()
    wrong = []
    for module, edges in graph.items():
        src = _wing(module)
        if src is None:
            continue
        assert src in WING_FLOORS, f"{module}: cluster/{src} is not a known wing (add it to WING_FLOORS and the README)"
        for target, line in edges.items():
            dst = _wing(target)
            if dst is None or dst == src:
                continue
            if WING_FLOORS[dst] >= WING_FLOORS[src]:
                wrong.append(f"{module}:{line} (cluster/{src}, floor {WING_FLOORS[src]}) imports {target} "
                             f"(cluster/{dst}, floor {WING_FLOORS[dst]})")
    assert not wrong, "imports that go up (or sideways) between cluster/ wings:\n" + "\n".join(sorted(wrong))
