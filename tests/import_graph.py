"""The module import graph of spark_hvd, read from the source (no imports run).

Every ``import`` / ``from ... import`` counts, wherever it sits (module level, inside
a function, under ``try`` or ``if TYPE_CHECKING:``): a function-level import is a
dependency all the same, only a later one, and a type-only one is a dependency of the
design (two modules that name each other's types are one module cut in two). An edge goes to
the deepest module the statement names (``from spark_hvd import _core`` -> ``spark_hvd._core``);
importing a submodule also runs its package's ``__init__``, but that edge is left
out: a package that re-exports its submodules is not a cycle.

``python tests/import_graph.py`` prints the cycles, if any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
# Importable name -> source folder (pyproject.toml's package-dir).
PACKAGES = {"spark_hvd": ROOT / "spark_hvd", "spark_hvd.estimators": ROOT / "estimators"}

Graph = Dict[str, Set[str]]


def modules() -> Dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found: Dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package] + parts)] = path
    found["spark_hvd._core"] = ROOT / "csrc" / "python" / "bindings.cc"  # the extension
    return found


def _imports(tree: ast.AST) -> Iterator[ast.AST]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _deepest(name: str, known: Dict[str, Path]) -> Optional[str]:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def build_graph() -> Graph:
    """module -> the package modules it imports."""
    known = modules()
    graph: Graph = {name: set() for name in known}
    for name, path in known.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(name, path.name == "__init__.py", node)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                dep = _deepest(target, known)
                if dep is not None and dep != name:
                    graph[name].add(dep)
    return graph


def cycles(graph: Graph) -> List[List[str]]:
    """One cycle per strongly connected component with more than one module
    (Tarjan's algorithm), each as a path that returns to its start."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: Graph, component: Set[str]) -> List[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    start = min(component)
    parents: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def format_cycles(found: List[List[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in found)


def layers(graph: Graph) -> List[Tuple[str, ...]]:
    """Modules in dependency order: each layer imports only from the layers before it."""
    remaining = {v: set(ws) for v, ws in graph.items()}
    out = []
    while remaining:
        ready = tuple(sorted(v for v, ws in remaining.items() if not ws & remaining.keys()))
        if not ready:
            raise ValueError("the graph has cycles:\n" + format_cycles(cycles(graph)))
        out.append(ready)
        for v in ready:
            del remaining[v]
    return out


if __name__ == "__main__":
    found = cycles(build_graph())
    print(format_cycles(found) if found else "no import cycles")
    sys.exit(1 if found else 0)
