"""The package's layers, and a reader of its imports that finds cycles and upward edges.

The subpackages form a stack; a module may import its own subpackage and those below it,
never one above (:data:`LAYERS`, lowest first; subpackages on one line are peers and may
not import each other). The reader parses every module with :mod:`ast`, so imports at
module level and inside functions count alike, and nothing is imported to check.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "physicsnemo_foldcp"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("versions",),
    ("distributed",),
    ("core",),
    ("features",),
    ("sharding",),
    ("dispatch",),
    ("ops",),
    ("kernels",),
    ("boltz",),
    ("models",),
    ("data", "testing"),
    ("training",),
    ("lightning", "cli"),
)
"""The subpackages (and top-level modules), lowest first. The package's ``__init__`` is
above them all: it re-exports the public names."""


@dataclass(frozen=True)
class Edge:
    """One import of the package's own code.

    Attributes
    ----------
    source, target : str
        Dotted module names (``physicsnemo_foldcp.ops.maps``).
    line : int
        Line of the import statement in ``source``.
    in_function : bool
        Whether the import is inside a function body.
    """

    source: str
    target: str
    line: int
    in_function: bool


def module_files(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, module: str, is_package: bool, known: Iterable[str]) -> list[str]:
    known = set(known)
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    out = []
    for alias in node.names:
        candidate = f"{prefix}.{alias.name}"
        out.append(candidate if candidate in known else prefix)
    return out


def import_edges(files: Mapping[str, Path]) -> list[Edge]:
    """Every import of the package by its own modules, module-level and function-level."""
    edges = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        stack: list[tuple[ast.AST, bool]] = [(tree, False)]
        while stack:
            node, in_function = stack.pop()
            inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, is_package, files):
                    if target == PACKAGE or target.startswith(PACKAGE + "."):
                        edges.append(Edge(module, target, node.lineno, in_function))
            stack.extend((child, inside) for child in ast.iter_child_nodes(node))
    return sorted(edges, key=lambda e: (e.source, e.line, e.target))


def subpackage(module: str) -> str | None:
    """The subpackage (or top-level module) a module belongs to; ``None`` for the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_of(name: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """Index of the layer that holds subpackage ``name``.

    Raises
    ------
    KeyError
        If ``name`` is in no layer (a new subpackage must be placed in :data:`LAYERS`).
    """
    for index, layer in enumerate(layers):
        if name in layer:
            return index
    raise KeyError(f"subpackage {name!r} is in no layer of {PACKAGE}.testing.layers.LAYERS")


def layer_violations(
    edges: Iterable[Edge], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """Every import that points up, or sideways to a peer subpackage, one line each."""
    problems = []
    for e in edges:
        source, target = subpackage(e.source), subpackage(e.target)
        if source is None or source == target:
            continue
        if target is None:
            problems.append(f"{e.source}:{e.line} imports the package root {e.target}")
            continue
        if layer_of(target, layers) >= layer_of(source, layers):
            where = "in a function" if e.in_function else "at module level"
            problems.append(
                f"{e.source}:{e.line} imports {e.target} {where}: {source} may import only "
                f"layers below it, and {target} is not below it"
            )
    return problems


def module_cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """Import cycles between modules (strongly connected components of two or more).

    A package's ``__init__`` importing its own submodules is no cycle by itself (each
    submodule is loaded after the package object exists); those edges are left out.
    """
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target.startswith(e.source + "."):
            continue
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


__all__ = [
    "LAYERS",
    "Edge",
    "import_edges",
    "layer_of",
    "layer_violations",
    "module_cycles",
    "module_files",
    "subpackage",
]
