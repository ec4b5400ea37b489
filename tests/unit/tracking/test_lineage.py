"""MLflow lineage on a real SQLite tracking store: from a checkpoint back to its data."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from asyncrl.configs.loading import config_from_dict, public_dict
from asyncrl.tasks.tracking.mlflow_run import MANIFEST_ARTIFACT, DataRef, RunLineage, default_artifact_location, flatten_params


@pytest.fixture
def tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def shard_entry(name: str, rows: int = 4, groups: int = 2) -> dict[str, object]:
    return {"name": name, "uri": f"s3://b/run/consumed/{name}", "digest": hashlib.sha256(name.encode()).hexdigest()[:16],
            "rows": rows, "groups": groups}


def test_flatten_params() -> None:
    assert flatten_params({"a": {"b": 1, "c": {"d": None}}, "e": "x"}) == {"a.b": "1", "a.c.d": "None", "e": "x"}


def test_version_lineage_links_model_to_its_shards(tmp_path: Path, tracking_uri: str) -> None:
    config = config_from_dict(
        {
            "model": {"path": "/m"},
            "data": {"train_path": "/d.parquet"},
            "storage": {"root": "s3://b/run", "options": {"endpoint_url": "http://127.0.0.1:8333"}},
            "tracking": {"mlflow_uri": "postgresql://mlflow:s3cr3t@db/mlflow"},
        }
    )
    lineage = RunLineage.start(tracking_uri, "exp", "run-1", public_dict(config))
    dataset = DataRef("train.parquet", str(tmp_path / "train.parquet"), "abc123")
    lineage.log_dataset(dataset)
    lineage.log_metrics(1, {"loss": 0.5, "reward_mean": 0.25, "skipped": float("nan")})

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    manifest_v1 = {"version": 1, "step": 1, "parent_version": 0,
                   "shards": [shard_entry("shard-00000001.arrow"), shard_entry("shard-00000002.arrow")]}
    model_v1 = lineage.log_version(1, "s3://b/run/weights/v000001", manifest_v1, {"loss": 0.4}, weights_dir=weights)
    manifest_v2 = {"version": 2, "step": 2, "parent_version": 1, "shards": [shard_entry("shard-00000003.arrow", 6, 3)]}
    model_v2 = lineage.log_version(2, "s3://b/run/weights/v000002", manifest_v2, {"loss": 0.3})
    lineage.log_evaluation(model_v2, 2, {"pass_at_1": 0.5}, DataRef("heldout", str(tmp_path / "h.parquet"), "d1"))
    version = lineage.register(model_v2, "asyncrl-policy", ["current", "best"])
    lineage.end()

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    run = client.get_run(lineage.run_id)
    assert run.data.params["storage.root"] == "s3://b/run"
    assert "AKIASECRET" not in repr(run.data.params) and "s3cr3t" not in repr(run.data.params)
    assert run.data.metrics["loss"] == pytest.approx(0.3)
    # The prompt and held-out datasets are run inputs; the shards are not (one manifest per step).
    input_names = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert input_names == {"train.parquet", "heldout"}

    model = client.get_logged_model(model_v1)
    assert model.tags["asyncrl.trained_on"] == "shard-00000001.arrow,shard-00000002.arrow"
    assert str(model.status) in ("READY", "LoggedModelStatus.READY")
    assert model.tags["asyncrl.lineage_artifact"] == MANIFEST_ARTIFACT == "lineage/manifest.json"
    assert (model.tags["asyncrl.step"], model.tags["asyncrl.parent_version"]) == ("1", "0")
    assert model.tags["asyncrl.weights_uri"] == "s3://b/run/weights/v000001"
    assert {a.path for a in client.list_logged_model_artifacts(model_v1)} == {"config.json", "lineage"}

    # One manifest artifact per version, on its LoggedModel: from the model back to its shards'
    # names, digests, rows, groups; the run itself gets no artifact per step.
    assert lineage.read_manifest(model_v2) == {**manifest_v2, "model_id": model_v2}
    assert client.list_artifacts(lineage.run_id, "lineage") == []
    mlflow.set_tracking_uri(tracking_uri)
    found = mlflow.search_logged_models(
        experiment_ids=[lineage.experiment_id], filter_string="tags.`asyncrl.version` = '2'", output_format="list"
    )
    assert [m.model_id for m in found] == [model_v2]
    registered = client.get_model_version_by_alias("asyncrl-policy", "best")
    assert str(registered.version) == version
    assert registered.tags["asyncrl.model_id"] == model_v2
    assert registered.source == client.get_logged_model(model_v2).artifact_location



def test_a_sqlite_store_keeps_its_artifacts_beside_it_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    store = tmp_path / "run" / "mlflow.db"
    store.parent.mkdir()
    lineage = RunLineage.start(f"sqlite:///{store}", "exp", "run-1", {"name": "run-1"})
    lineage.log_text("name: run-1\n", "config.yaml")
    lineage.end()
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    assert client.get_experiment(lineage.experiment_id).artifact_location == (store.parent / "mlartifacts").as_uri()
    assert list((store.parent / "mlartifacts").rglob("config.yaml"))
    assert not (elsewhere / "mlruns").exists()
    chosen = RunLineage.start(f"sqlite:///{store}", "exp-2", "run-2", {}, artifact_location=(tmp_path / "art").as_uri())
    assert client.get_experiment(chosen.experiment_id).artifact_location == (tmp_path / "art").as_uri()
    chosen.end()
    assert default_artifact_location("http://mlflow:5000") is None
    assert default_artifact_location("sqlite:///runs/demo/mlflow.db") == (Path.cwd() / "runs" / "demo" / "mlartifacts").as_uri()
