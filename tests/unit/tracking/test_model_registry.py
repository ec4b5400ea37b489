"""Registering a weight version: its files come through the one weight fetch, checked against
the version's manifest, so a corrupt version is refused before anything is logged."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightIntegrityError, WeightStore
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.model_registry import register_version


@pytest.fixture
def tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_registered_version_logs_the_fetched_files_and_a_corrupt_one_is_refused(
    tmp_path: Path, tracking_uri: str, tiny_model_dir: Path
) -> None:
    root = open_root(str(tmp_path / "store"), {})
    store = WeightStore(root)
    store.publish(1, tiny_model_dir)
    store.publish(2, tiny_model_dir)
    lineage = RunLineage.start(tracking_uri, "exp", "run-1", {})
    model_1 = lineage.log_version(1, root.uri + "/weights/v000001", {"version": 1, "step": 1, "shards": []}, {})
    model_2 = lineage.log_version(2, root.uri + "/weights/v000002", {"version": 2, "step": 2, "shards": []}, {})

    assert register_version(root, lineage, 1, model_1, "policy", ["best"]) == "1"
    assert lineage.has_hf_model(model_1) and 1 in store.pinned_versions()

    stored = next((tmp_path / "store" / "weights").glob("v000002/model.safetensors"))
    stored.write_bytes(b"not the bytes the manifest hashed")
    with pytest.raises(WeightIntegrityError):
        register_version(root, lineage, 2, model_2, "policy", ["best"])
    assert not lineage.has_hf_model(model_2)
    lineage.end()
