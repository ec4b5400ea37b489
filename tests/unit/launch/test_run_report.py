"""What a run shows in MLflow besides its metrics: the frozen config (secrets redacted), the
reward, pass@1 and staleness plots and the summary as artifacts, MLflow's system metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from mlflow_run import tiny_run
from PIL import Image

from asyncrl.configs.loading import config_from_dict
from asyncrl.configs.processes import PROCESS_NAMES
from asyncrl.tasks.launch.context import CONFIG_ARTIFACT, PROCESS_CONFIG_ARTIFACTS, open_run_context, system_metrics
from asyncrl.tasks.tracking.run_report import PLOTS_DIR, SUMMARY_ARTIFACT, log_run_report, read_curves

API_KEY = "report-canary-api-key-93c1"


def download_text(lineage: object, path: str, dest: Path) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    return Path(lineage.client.download_artifacts(lineage.run_id, path, str(dest))).read_text()  # type: ignore[attr-defined]


def test_the_run_holds_the_plots_and_the_summary(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = tiny_run(tmp_path, tiny_model_dir, steps=3)
    run.recorder.poll()
    evaluations = {0: {"pass_at_1": 0.25, "by_task": {"pass_at_1/math": 0.25}}, 3: {"pass_at_1": 0.5, "by_task": {}}}

    curves = read_curves(run.lineage, evaluations)
    # Each step once (the run and each version's LoggedModel both hold the step's metrics).
    assert curves.reward == pytest.approx({1: 0.2, 2: 0.4, 3: 0.6})
    assert curves.train_pass_at_1 == {"math": pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})}
    assert curves.eval_pass_at_1 == {"all": {0: 0.25, 3: 0.5}, "math": {0: 0.25}}
    assert curves.staleness == {0: 6.0, 1: 6.0}  # counts summed over the 3 steps: 2+2+2, 1+2+3

    summary = {"run": "tiny", "pass_at_1_after": 0.5, "mlflow_uri": "postgresql://u:pw@db/mlflow", "token": "t0k"}
    logged = log_run_report(run.lineage, "tiny", evaluations, summary)
    assert logged == [f"{PLOTS_DIR}/reward.png", f"{PLOTS_DIR}/pass_at_1.png", f"{PLOTS_DIR}/staleness.png", SUMMARY_ARTIFACT]
    client = run.lineage.client
    assert {a.path for a in client.list_artifacts(run.lineage.run_id, PLOTS_DIR)} == {
        f"{PLOTS_DIR}/reward.png", f"{PLOTS_DIR}/pass_at_1.png", f"{PLOTS_DIR}/staleness.png"}  # fmt: skip
    for name in ("reward.png", "pass_at_1.png", "staleness.png"):
        png = client.download_artifacts(run.lineage.run_id, f"{PLOTS_DIR}/{name}", str(tmp_path / "dl"))
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (700, 400)
    stored = json.loads(download_text(run.lineage, SUMMARY_ARTIFACT, tmp_path / "dl"))
    assert stored == {"run": "tiny", "pass_at_1_after": 0.5, "mlflow_uri": "postgresql://u:***@db/mlflow", "token": "***"}


def test_the_frozen_config_is_an_artifact_without_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = config_from_dict({
        "name": "cfg", "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")}, "data": {"train_path": str(tmp_path / "train.parquet")},
        "inference": {"api_key": API_KEY}, "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "system_metrics_interval_s": 0.5},
    })  # fmt: skip
    context = open_run_context(config)
    text = download_text(context.lineage, CONFIG_ARTIFACT, tmp_path / "dl")
    assert API_KEY not in text
    frozen = yaml.safe_load(text)
    assert frozen["inference"]["api_key"] == "***" and frozen["name"] == "cfg"
    # Each process's config beside it, redacted as well; the scheduler's file on disk has the key.
    for process in PROCESS_NAMES:
        shown = download_text(context.lineage, f"{PROCESS_CONFIG_ARTIFACTS}/{process}.yaml", tmp_path / "dl" / process)
        assert API_KEY not in shown and yaml.safe_load(shown)["name"] == "cfg"
    assert "***" in download_text(context.lineage, f"{PROCESS_CONFIG_ARTIFACTS}/scheduler.yaml", tmp_path / "dl" / "s2")
    assert API_KEY in context.paths.process_config("scheduler").read_text()

    with system_metrics(context):
        time.sleep(1.6)
    metrics = context.lineage.client.get_run(context.lineage.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics

    off = config.model_copy(update={"tracking": config.tracking.model_copy(update={"system_metrics": False})})
    context_off = open_run_context(off)  # the same run again (tracking.json)
    assert context_off.lineage.run_id == context.lineage.run_id
    before = len(context.lineage.client.get_metric_history(context.lineage.run_id, "system/cpu_utilization_percentage"))
    with system_metrics(context_off):
        time.sleep(1.0)
    after = len(context.lineage.client.get_metric_history(context.lineage.run_id, "system/cpu_utilization_percentage"))
    assert after == before
