"""Every name of asyncrl has one import path: a ``from asyncrl.X import Y`` anywhere in the
repository (library, tests, benchmarks) takes Y from the module that defines it, never from a
module that only imported it (no re-exports). User code (``examples/``) is the one exception:
it takes a package's public names, those its ``__init__`` lists in ``__all__``, from the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", ".git", "build", "dist", "site", "runs"}


def _python_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


def _module_path(module: str) -> Path | None:
    """The file of ``asyncrl.a.b`` (a module or a package's __init__), None when absent."""
    parts = module.split(".")[1:]
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _defined_names(path: Path) -> set[str]:
    """Top-level names a module binds itself: functions, classes, assignments, and names bound
    under top-level if/try blocks; names it imports do not count."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


def _public_names(path: Path) -> set[str]:
    """The names a package's ``__init__`` lists in its literal ``__all__`` (none for a module)."""
    if path.name != "__init__.py":
        return set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {str(name) for name in ast.literal_eval(node.value)}
    return set()


def test_every_imported_asyncrl_name_comes_from_the_module_that_defines_it() -> None:
    defined: dict[str, set[str]] = {}
    wrong: list[str] = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("asyncrl"):
                continue
            module = node.module or ""
            source = _module_path(module)
            if source is None:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {module}")
                continue
            names = defined.setdefault(module, _defined_names(source))
            if path.relative_to(ROOT).parts[0] == "examples":
                names = names | _public_names(source)
            for alias in node.names:
                is_submodule = _module_path(f"{module}.{alias.name}") is not None
                if alias.name not in names and not is_submodule:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} is not defined in {module}")
    assert not wrong, "\n".join(wrong)
