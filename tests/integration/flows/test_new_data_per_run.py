"""Recurring training on a growing data folder, against a real MLflow store (SQLite): each
run of a registered model trains on the files no earlier finished run of that model trained
on, and records exactly those as its MLflow dataset inputs (name and source: the file's URI,
digest: sha256 of its bytes); with ``data.require_new_files`` and nothing new the pipeline
flow ends Completed, named "Skipped", saying why, before any stage."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.train_manifest import read_train_manifest
from asyncrl.tasks.launch.context import open_run_context
from asyncrl.tasks.pipeline.train_data import choose_train_data
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.tracking.train_history import REGISTERED_MODEL_TAG, SKIPPED_TAG, train_datasets

MODEL = "policy-on-a-folder"


def write_jsonl(path: Path, count: int, start: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": f"{i}+3=?", "answer": f"#### {i + 3}"}) + "\n"
                            for i in range(start, start + count)))  # fmt: skip
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.fixture
def tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def night(tmp_path: Path, tracking_uri: str, name: str, registered_model: str = MODEL, **data: Any) -> RunConfig:
    return RunConfig.model_validate({
        "name": name,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "prompts") + "/", **data},
        "storage": {"root": str(tmp_path / "roots" / name)},
        "tracking": {"mlflow_uri": tracking_uri, "experiment": "nightly"},
        "pipeline": {"registered_model": registered_model},
    })  # fmt: skip


def train_night(config: RunConfig, status: str = "FINISHED") -> tuple[str, list[str]]:
    """What the pipeline does around RL for the train files: open the run, choose, record the
    chosen files as the RL phase does (``run_rl``), end the run. Its id and the chosen URIs."""
    context = open_run_context(config)
    choice = choose_train_data(config, context.lineage)
    assert choice.skipped is None and choice.selection is not None
    for ref in train_datasets(config.data, context.paths.root):
        context.lineage.log_dataset(ref)
    context.lineage.end(status)
    return context.lineage.run_id, [file.uri for file in choice.selection.files]


def recorded_inputs(tracking_uri: str, run_id: str) -> set[tuple[str, str, str, str]]:
    run = MlflowClient(tracking_uri).get_run(run_id)
    return {
        (d.dataset.name, json.loads(d.dataset.source)["uri"], d.dataset.digest, {t.key: t.value for t in d.tags}["mlflow.data.context"])
        for d in run.inputs.dataset_inputs
    }  # fmt: skip


def test_a_second_run_of_the_registered_model_trains_on_the_new_files_only_and_records_them(
    tmp_path: Path, tracking_uri: str
) -> None:
    prompts = tmp_path / "prompts"
    a, b = write_jsonl(prompts / "2026-12-01.jsonl", 3), write_jsonl(prompts / "2026-12-02.jsonl", 2, start=10)

    first_id, first = train_night(night(tmp_path, tracking_uri, "night-1"))
    assert first == [str(a), str(b)]
    assert MlflowClient(tracking_uri).get_run(first_id).data.tags[REGISTERED_MODEL_TAG] == MODEL

    c = write_jsonl(prompts / "2026-12-03.jsonl", 2, start=20)
    write_jsonl(b, 4, start=30)  # rewritten with other prompts: new again
    failed = write_jsonl(prompts / "2026-12-04.jsonl", 1, start=40)
    # A failed run of the model, and a finished run of another model, do not count as trained on.
    train_night(night(tmp_path, tracking_uri, "night-2-failed"), status="FAILED")
    train_night(night(tmp_path, tracking_uri, "other-model", registered_model="another-policy"))

    second_config = night(tmp_path, tracking_uri, "night-2")
    second_id, second = train_night(second_config)
    assert second == [str(b), str(c), str(failed)]
    assert recorded_inputs(tracking_uri, second_id) == {
        (str(path), str(path), digest(path), "training") for path in (b, c, failed)
    }
    manifest = read_train_manifest(run_paths(second_config).root)
    assert manifest is not None and [f.uri for f in manifest.selection.new] == second

    # A restart of night 2 keeps its files, whatever arrived since.
    write_jsonl(prompts / "2026-12-05.jsonl", 1, start=50)
    context = open_run_context(second_config)
    again = choose_train_data(second_config, context.lineage)
    assert again.reused and again.selection == manifest.selection
    context.lineage.end()

    # Replay: one new file, replay_fraction 0.5 -> ceil(0.5 x 1) = 1 earlier file again.
    _, third = train_night(night(tmp_path, tracking_uri, "night-3", replay_fraction=0.5))
    assert str(prompts / "2026-12-05.jsonl") in third and len(third) == 2
    assert set(third) - {str(prompts / "2026-12-05.jsonl")} <= {str(a), str(b), str(c), str(failed)}


def test_require_new_files_with_nothing_new_ends_the_pipeline_skipped_with_its_reason(
    prefect_server: None, tmp_path: Path, tracking_uri: str
) -> None:
    from asyncrl.flows.pipeline import SKIPPED, pipeline

    write_jsonl(tmp_path / "prompts" / "2026-12-01.jsonl", 3)
    train_night(night(tmp_path, tracking_uri, "night-1"))

    config = night(tmp_path, tracking_uri, "night-2", require_new_files=True)
    state = pipeline(config, return_state=True)

    assert state.is_completed() and state.name == SKIPPED == "Skipped"
    assert state.message.startswith(f"data.require_new_files: nothing new at {tmp_path / 'prompts'}/: each of its 1 data file(s)")
    assert f"an earlier run of registered model {MODEL!r}" in state.message
    result = state.result()
    assert result["skipped"] == state.message and result["run"] == "night-2"
    run = MlflowClient(tracking_uri).get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags[SKIPPED_TAG] == state.message
    assert run.inputs.dataset_inputs == []
    assert read_train_manifest(run_paths(config).root) is None  # nothing chosen: a later start chooses afresh
