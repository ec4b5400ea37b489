"""User code imports only public names: an example (``examples/``), the template of a user's
module, imports from asyncrl nothing but names a package lists in its ``__all__``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def private_imports(source: str) -> list[str]:
    """Every asyncrl import of ``source`` that does not name a package's public name: a plain
    ``import asyncrl...``, an import from a module (not a package), or a name outside the
    package's ``__all__``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "asyncrl"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "asyncrl":
            module = importlib.import_module(node.module)
            public = set(getattr(module, "__all__", ())) if hasattr(module, "__path__") else set()
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name not in public]
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_import_only_public_names(path: Path) -> None:
    assert private_imports(path.read_text()) == []


def test_an_import_of_an_internal_module_is_named() -> None:
    source = (
        "import asyncrl.tasks.agent.episode\n"
        "from asyncrl.tasks.agent.episode import EpisodeContext\n"
        "from asyncrl.tasks.agent import EpisodeContext, load_episode\n"
    )
    assert private_imports(source) == [
        "import asyncrl.tasks.agent.episode",
        "from asyncrl.tasks.agent.episode import EpisodeContext",
        "from asyncrl.tasks.agent import load_episode",
    ]
