"""serve_app's import graph, read from the source (ast, nothing imported): an edge a → b for every
`import` of b in module a, wherever it stands (module level, inside a function, under
`TYPE_CHECKING`): a deferred import is still a dependency, only a later one. `from p import name`
is an edge to `p.name` when that is a module, else to `p`. A package's `__init__` counts only where
it is imported by name (importing `p.q` runs `p/__init__.py` too, but that is Python's mechanics,
not a dependency anyone wrote)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

PACKAGE = "serve_app"


def module_files(root: Path) -> dict[str, Path]:
    """Module name → file, for every module of the package under `root` (the repository)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports anywhere in its source."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up `level - 1` packages
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in out if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (each is at least one cycle),
    sorted; [] for an acyclic graph. Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def unit(module: str) -> str:
    """The part of the package a module belongs to: its subpackage (`engine`, `serving`, ...) or,
    for a top-level module, the module itself (`config`, `types`, ...)."""
    return module.split(".")[1] if module != PACKAGE else PACKAGE


def unit_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The graph between units (edges inside a unit dropped)."""
    out: dict[str, set[str]] = {unit(m): set() for m in graph}
    for module, deps in graph.items():
        out[unit(module)].update(unit(d) for d in deps if unit(d) != unit(module))
    return out
