"""No two files of one package import each other, directly or around a longer circle: inside
a package, one file uses the other. Every import counts (top-level, inside a function, under
``TYPE_CHECKING``): each one is a dependency a reader has to follow."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", ".git", "build", "dist", "site", "runs", "tests"}


def _package_graphs() -> dict[Path, dict[str, set[str]]]:
    """Per package directory: module file name -> the files of the same directory it imports."""
    graphs: dict[Path, dict[str, set[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if SKIP & set(path.relative_to(ROOT).parts):
            continue
        package = path.parent
        dotted = "asyncrl." + ".".join(package.relative_to(ROOT).parts) if package != ROOT else "asyncrl"
        edges = graphs.setdefault(package, {}).setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                head, _, leaf = target.rpartition(".")
                if head == dotted and (package / f"{leaf}.py").exists() and leaf != path.stem:
                    edges.add(leaf)
    return graphs


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_scan_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_has_files_that_import_each_other() -> None:
    circles = [
        f"{package.relative_to(ROOT)}: {' <-> '.join(cycle)}"
        for package, graph in _package_graphs().items()
        for cycle in _cycles(graph)
    ]
    assert circles == []
