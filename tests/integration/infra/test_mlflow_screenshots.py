"""The MLflow UI in a real browser: ``infra/mlflow_screenshots.py`` starts ``mlflow server`` on a
run's store and takes the run page, its plots, the model list and the registered version with
headless Chromium. Skipped where Debian's ``chromium`` is not installed."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from mlflow_run import tiny_run
from PIL import Image

from asyncrl.tasks.tracking.model_registry import register_version
from asyncrl.tasks.tracking.run_report import log_run_report

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)"),
]
SCRIPT = Path(__file__).resolve().parents[3] / "infra" / "mlflow_screenshots.py"


def load_script():  # noqa: ANN201 - the script as a module
    spec = importlib.util.spec_from_file_location("mlflow_screenshots", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_screenshots_of_the_run_and_the_registered_model(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tiny_run(tmp_path, tiny_model_dir, steps=2)
    register_version(run.root, run.lineage, 2, run.recorder.logged_versions[2], "shot-policy", ["best"])
    log_run_report(run.lineage, "tiny", {2: {"pass_at_1": 0.5}}, {"run": "tiny"})
    run.lineage.end()

    taken = load_script().take_screenshots(run.lineage.tracking_uri, tmp_path / "shots", "shot-policy", wait_s=6.0)
    assert [p.name for p in taken] == [
        "mlflow-run.png", "mlflow-run-plots.png", "mlflow-models.png", "mlflow-registered-model.png",
        "mlflow-registered-version.png"]  # fmt: skip
    for path in taken:
        with Image.open(path) as image:
            assert image.size == (1600, 1000)
            colours = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
            assert len(colours) > 50, f"{path.name} looks blank"  # a rendered page, not an empty one
