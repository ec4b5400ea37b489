"""`lint-imports` fails when a file breaks a layer rule: an import up the ordered layers, a
framework imported outside its layer, a process entry point imported as a library. Each
case adds one offending file to a copy of the package and runs the real `lint-imports` on it;
the unchanged copy passes, so a failure is the offending file's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked Python files and pyproject.toml under ``<tmp>/asyncrl`` (tests left out)."""
    files = subprocess.run(
        ["git", "ls-files", "*.py", "pyproject.toml"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    base = tmp_path_factory.mktemp("contracts") / "asyncrl"
    for name in files:
        if name.startswith("tests/"):
            continue
        target = base / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
    return base


def _lint(package: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(package / "pyproject.toml")],
        cwd=package.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_unchanged_package_keeps_every_contract(package_copy: Path) -> None:
    result = _lint(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("offender", "source", "broken"),
    [
        ("storage/probe_upward.py", "import asyncrl.flows\n", "Layers:"),
        ("tasks/algo/probe_upward.py", "from asyncrl.tasks.trainer import step\n", "Layers:"),
        ("storage/probe_mlflow.py", "import mlflow\n", "Only tasks/tracking/ imports MLflow"),
        ("tasks/scheduler/probe_vllm.py", "import vllm\n", "Only tasks/inference/ imports vLLM"),
        ("tasks/trainer/probe_run_config.py", "from asyncrl.configs.run_config import RunConfig\n",
         "Each process reads its own config"),
        ("tasks/launch/probe_entry.py", "import asyncrl.tasks.trainer.main\n", "No process entry point"),
    ],
)
def test_an_offending_import_breaks_its_contract(package_copy: Path, offender: str, source: str, broken: str) -> None:
    path = package_copy / offender
    path.write_text(source)
    try:
        result = _lint(package_copy)
    finally:
        path.unlink()
    assert result.returncode != 0
    report = result.stdout.split("Broken contracts", 1)[-1]
    assert broken in report, result.stdout
    assert offender.replace("/", ".").removesuffix(".py") in report.replace("\n", "")
