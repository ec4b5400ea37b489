"""Promotion history in a real MLflow registry (SQLite store) over real run roots: a rejected
candidate never moves `best`; promote and rollback keep the history in the versions' tags;
a version that does not exist, or whose weights are gone, is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.model_registry import register_version
from asyncrl.tasks.tracking.promotion_registry import (
    UnknownRegisteredVersionError, aliased_version, promote, record_decision, rollback,
)  # fmt: skip

NAME = "policy"


@pytest.fixture
def tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def register_run(tmp_path: Path, tracking_uri: str, run: str, model_dir: Path) -> str:
    """A run root with weight version 1, its MLflow run and LoggedModel, registered as a candidate."""
    root = open_root(str(tmp_path / run), {})
    WeightStore(root).publish(1, model_dir)
    lineage = RunLineage.start(tracking_uri, "exp", run, {})
    model = lineage.log_version(1, root.display("weights/v000001"), {"version": 1, "step": 1, "shards": []}, {})
    number = register_version(root, lineage, 1, model, NAME, ["candidate"])
    lineage.end()
    return number


def best(tracking_uri: str) -> str | None:
    found = aliased_version(tracking_uri, NAME, "best")
    return None if found is None else found.number


def test_rejection_promotion_and_rollbacks_keep_the_history(tmp_path: Path, tracking_uri: str, tiny_model_dir: Path) -> None:
    assert aliased_version(tracking_uri, NAME, "best") is None  # no model yet
    first = register_run(tmp_path, tracking_uri, "night-1", tiny_model_dir)
    record_decision(tracking_uri, NAME, first, {"asyncrl.promotion": "promoted"}, "first", True, None)
    assert best(tracking_uri) == first

    second = register_run(tmp_path, tracking_uri, "night-2", tiny_model_dir)
    record_decision(tracking_uri, NAME, second, {"asyncrl.promotion": "rejected"}, "# Promotion: rejected", False, first)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    rejected = client.get_model_version(NAME, second)
    assert best(tracking_uri) == first and aliased_version(tracking_uri, NAME, "current").number == first
    assert aliased_version(tracking_uri, NAME, "candidate").number == second
    assert rejected.tags["asyncrl.promotion"] == "rejected" and "# Promotion: rejected" in rejected.description
    assert "asyncrl.promotion.previous" not in rejected.tags

    assert "now policy@best" in promote(tracking_uri, NAME, second)
    assert best(tracking_uri) == second
    assert client.get_model_version(NAME, second).tags["asyncrl.promotion.previous"] == first
    assert "is policy@best already" in promote(tracking_uri, NAME, second)

    assert rollback(tracking_uri, NAME) == f"policy@best and @current rolled back from version {second} to {first}"
    assert best(tracking_uri) == first and aliased_version(tracking_uri, NAME, "current").number == first
    assert client.get_model_version(NAME, second).tags["asyncrl.promotion"] == "rolled_back"
    with pytest.raises(UnknownRegisteredVersionError, match=f"models:/policy/{first} .* replaced no earlier version"):
        rollback(tracking_uri, NAME)


def test_a_missing_version_or_one_whose_weights_are_gone_is_refused_by_name(
    tmp_path: Path, tracking_uri: str, tiny_model_dir: Path
) -> None:
    first = register_run(tmp_path, tracking_uri, "night-1", tiny_model_dir)
    record_decision(tracking_uri, NAME, first, {}, "first", True, None)
    second = register_run(tmp_path, tracking_uri, "night-2", tiny_model_dir)
    with pytest.raises(UnknownRegisteredVersionError, match="models:/policy/7: no such registered model version"):
        promote(tracking_uri, NAME, "7")
    with pytest.raises(UnknownRegisteredVersionError, match="models:/nothing@best: no such model"):
        rollback(tracking_uri, "nothing")
    shutil.rmtree(tmp_path / "night-2" / "weights" / "v000001")
    with pytest.raises(UnknownRegisteredVersionError, match=f"models:/policy/{second}: its weights are gone"):
        promote(tracking_uri, NAME, second)
    assert best(tracking_uri) == first

    promote(tracking_uri, NAME, first)  # already best: nothing changes
    third = register_run(tmp_path, tracking_uri, "night-3", tiny_model_dir)
    promote(tracking_uri, NAME, third)
    shutil.rmtree(tmp_path / "night-1" / "weights" / "v000001")
    with pytest.raises(UnknownRegisteredVersionError, match=f"models:/policy/{first}: its weights are gone"):
        rollback(tracking_uri, NAME)
    assert best(tracking_uri) == third
