"""Recurring training through the promotion gate, as the Prefect flows run it: a first pipeline
run registers the model's first version (promoted: no incumbent); a `train-nightly` run dated
as its schedule would date it continues from `@best` with a learning rate that breaks the
model, and its register stage evaluates incumbent and candidate together on a real vLLM
server and rejects it: `best` stays and still loads through MLflow, the candidate is
registered with alias `candidate` and its figures, the decision is the run's final state
message, a markdown artifact and a Prefect event. The night's first version names the
incumbent's LoggedModel as its parent, so lineage walks back across runs to the first run's
data. Then a promotion by hand and a rollback."""

from __future__ import annotations

import datetime as dt
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow import MlflowClient
from ports import restartable_base_port
from prefect_runs import latest_artifacts, read_events

from asyncrl.configs.loading import config_from_dict
from asyncrl.flows.nightly import train_nightly
from asyncrl.flows.pipeline import pipeline
from asyncrl.tasks.tracking.lineage_query import model_history
from asyncrl.tasks.tracking.promotion_registry import aliased_version, promote, rollback

pytestmark = pytest.mark.slow

RUN = "gate"
MODEL = "gate-policy"
NIGHT = dt.date(2026, 12, 1)


def gate_config(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": RUN,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "data" / "train.parquet"), "eval_path": str(tmp_path / "data" / "heldout.parquet"),
                 "max_prompt_tokens": 64},  # fmt: skip
        "rollout": {"n_samples": 2, "max_new_tokens": 16, "eta": 1, "shard_groups": 2, "shard_seconds": 2.0},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": 2, "max_steps": 1, "micro_batch_tokens": 256, "optimizer": {"lr": 1.0e-4}},
        "pipeline": {"init_tiny_model": True, "synthetic_data": {"n_train": 32, "n_heldout": 8}, "sft_steps": 0,
                     "sft_batch_size": 4, "eval_samples": 2, "registered_model": MODEL},  # fmt: skip
        "storage": {"root": str(tmp_path / "store" / RUN)},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": RUN, "system_metrics": False},
    }


def best(uri: str) -> str:
    found = aliased_version(uri, MODEL, "best")
    assert found is not None
    return found.number


def test_a_breaking_night_is_rejected_and_best_stays(prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    since = datetime.now(timezone.utc)
    raw = gate_config(tmp_path)
    config = config_from_dict(raw)
    uri = config.tracking.mlflow_uri
    first = pipeline(config, return_state=True)
    assert first.is_completed() and "no incumbent" in (first.message or ""), first.message
    assert best(uri) == "1"

    raw["trainer"]["optimizer"]["lr"] = 1.0  # one step at the largest rate allowed breaks the model
    night = train_nightly(config_from_dict(raw), MODEL, date=NIGHT, return_state=True)
    assert night.is_completed(), night.message
    summary = night.result()
    assert summary["run"] == f"{RUN}-nightly-20261201" and summary["registered_model_version"] == "2"
    assert "models:/gate-policy/2 rejected over models:/gate-policy/1" in night.message
    assert best(uri) == "1" and aliased_version(uri, MODEL, "current").number == "1"
    assert aliased_version(uri, MODEL, "candidate").number == "2"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    candidate = client.get_model_version(MODEL, "2")
    assert candidate.tags["asyncrl.promotion"] == "rejected" and candidate.tags["asyncrl.promotion.incumbent"] == "models:/gate-policy/1"
    assert "# Promotion: models:/gate-policy/2 rejected" in candidate.description
    mlflow.set_tracking_uri(uri)
    try:  # best still loads
        generator = mlflow.transformers.load_model(f"models:/{MODEL}@best")
        assert generator("1+2=", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("1+2=")
    finally:
        mlflow.set_tracking_uri(None)

    key = f"{RUN}-nightly-20261201-promotion"
    report = latest_artifacts([key])[key].data
    assert "| incumbent models:/gate-policy/1 |" in report and "| candidate models:/gate-policy/2 |" in report
    assert "p-value" in report and "| math |" in report
    events = read_events("asyncrl.promotion.rejected", f"asyncrl.model.{MODEL}", since, 1)
    assert [e.payload["candidate"] for e in events] == ["models:/gate-policy/2"]

    history = "\n".join(model_history(uri, f"models:/{MODEL}@candidate"))
    assert f"run '{RUN}-nightly-20261201'" in history and f"run '{RUN}'" in history, history
    assert "continued from LoggedModel" in history and "train.parquet" in history and history.endswith("registered model)")

    assert "now gate-policy@best" in promote(uri, MODEL, "2")
    assert best(uri) == "2"
    assert rollback(uri, MODEL) == "gate-policy@best and @current rolled back from version 2 to 1"
    assert best(uri) == "1"
