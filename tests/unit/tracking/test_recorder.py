"""The lineage recorder's storage side: each version once, from LATEST down to the last one
logged, with one manifest per version; a poll with nothing new costs one read."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.tasks.tracking.mlflow_run import DataRef
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.tracking.lineage_recorder import LineageRecorder

RUN_ID = "run-r"


class FakeLineage:
    """Stands in for :class:`RunLineage` (MLflow itself is tested in test_lineage.py)."""

    def __init__(self, logged: dict[int, str] | None = None) -> None:
        self.logged = dict(logged or {})
        self.versions: list[tuple[int, str, dict[str, Any], dict[str, float]]] = []
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.parents: dict[int, str | None] = {}

    def logged_versions(self) -> dict[int, str]:
        return dict(self.logged)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_version(self, version: int, weights_uri: str, manifest: Mapping[str, Any], metrics: Mapping[str, float],
                    parent_model_id: str | None = None) -> str:
        self.versions.append((version, weights_uri, dict(manifest), dict(metrics)))
        self.parents[version] = parent_model_id
        return f"m-{version}"


def group(gid: str) -> list[Sample]:
    return [Sample(prompt_id="p", group_id=gid, prompt_token_ids=[1], output_token_ids=[2], behaviour_logprobs=[-1.0],
                   token_versions=[0], reward=0.0, finish_reason="stop", submit_time=1.0, finish_time=1.0)] * 2  # fmt: skip


def publish(root: RunRoot, tmp_path: Path, version: int, step: int, shards: list[str],
            metrics: dict[str, float] | None = None) -> None:  # fmt: skip
    local = tmp_path / f"v{version}"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"\0" * 8)
    carried = {} if metrics is None else {"metrics": metrics}
    (local / LINEAGE_FILE).write_text(json.dumps({"version": version, "parent_version": version - 1, "step": step,
                                                  "shards": shards, **carried}))  # fmt: skip
    WeightStore(root).publish(version, local)


def consumed_shard(root: RunRoot, *gids: str) -> str:
    name = ShardWriter(root, RUN_ID).write_groups([group(g) for g in gids]).name
    ShardReader(root, RUN_ID).retire([name])
    return name


def test_each_version_once_with_one_manifest_and_a_constant_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = open_root(str(tmp_path / "run"))
    metrics = tmp_path / "metrics.jsonl"
    lineage = FakeLineage()
    dataset = DataRef("train.parquet", "/data/train.parquet", "0123abcd")
    recorder = LineageRecorder(lineage, root, metrics, [dataset])  # type: ignore[arg-type]
    recorder.poll()
    assert lineage.versions == []

    publish(root, tmp_path, 0, 0, [])
    first = consumed_shard(root, "g0", "g1")
    metrics.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n" + '{"step": 2, "lo')  # a torn last line waits
    publish(root, tmp_path, 1, 1, [first])
    recorder.poll()
    assert [v for v, *_ in lineage.versions] == [0, 1]
    _, uri, manifest, step_metrics = lineage.versions[1]
    data = fs.read_bytes(root, paths.consumed_shard_path(first))
    assert uri == root.display("weights/v000001") and step_metrics["loss"] == 0.5
    assert manifest == {"version": 1, "step": 1, "parent_version": 0, "shards": [
        {"name": first, "uri": root.display(paths.consumed_shard_path(first)),
         "digest": hashlib.sha256(data).hexdigest()[:16], "rows": 4, "groups": 2}],
        "datasets": [{"name": "train.parquet", "uri": "/data/train.parquet", "digest": "0123abcd"}]}  # fmt: skip
    assert lineage.parents == {0: None, 1: "m-0"}
    assert [s for s, _ in lineage.metrics] == [1]

    # Nothing new: one read of LATEST (and the metrics file, local), no listing, no HEAD.
    calls: list[str] = []
    for name in ("read_bytes", "exists", "list_dir"):
        real = getattr(fs, name)
        monkeypatch.setattr(fs, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    recorder.poll()
    assert calls == ["read_bytes"] and len(lineage.versions) == 2
    monkeypatch.undo()

    # Versions pruned before they were logged are skipped with a warning; the rest are logged.
    with metrics.open("a") as handle:
        handle.write('ss": 0.25}\n')
    for version in (2, 3, 4):
        publish(root, tmp_path, version, version, [consumed_shard(root, f"g{version + 1}")])
    assert WeightStore(root).prune(keep_latest=1, referenced=[0, 1]) == [2, 3]
    with caplog.at_level(logging.WARNING, logger="asyncrl.lineage"):
        recorder.poll()
    assert [v for v, *_ in lineage.versions] == [0, 1, 4]
    assert "weight version 2 was not logged" in caplog.text and "weight version 3 was not logged" in caplog.text
    assert [s for s, _ in lineage.metrics] == [1, 2] and lineage.metrics[1][1]["loss"] == 0.25
    assert recorder.logged_versions == {0: "m-0", 1: "m-1", 4: "m-4"}


def test_a_resumed_recorder_goes_on_after_the_versions_mlflow_holds(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    for version in range(3):
        publish(root, tmp_path, version, version, [consumed_shard(root, f"g{version}")] if version else [])
    lineage = FakeLineage({0: "m-0", 1: "m-1"})
    recorder = LineageRecorder(lineage, root, tmp_path / "none.jsonl")  # type: ignore[arg-type]
    recorder.adopt_logged_versions()
    recorder.poll()
    assert [v for v, *_ in lineage.versions] == [2]


def test_metrics_of_a_trainer_on_another_machine_come_with_its_versions(tmp_path: Path) -> None:
    """No metrics file here (the trainer runs elsewhere): each version's lineage carries its
    step's figures, logged once at that step and attached to the version; with a metrics file
    here, the file is the source and the lineage's copy is not logged again."""
    root = open_root(str(tmp_path / "run"))
    shard = consumed_shard(root, "g0")
    publish(root, tmp_path, 1, 1, [shard], {"reward_mean": 0.25, "loss": 1.5, "grad_norm": float("nan")})
    lineage = FakeLineage()
    recorder = LineageRecorder(lineage, root, tmp_path / "absent-metrics.jsonl")  # type: ignore[arg-type]
    recorder.poll()
    recorder.poll()
    assert [step for step, _ in lineage.metrics] == [1]
    assert lineage.metrics[0][1]["reward_mean"] == 0.25 and lineage.versions[0][3]["loss"] == 1.5
    assert recorder.metrics_by_step[1]["reward_mean"] == 0.25

    local_file = tmp_path / "metrics.jsonl"
    local_file.write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    other = FakeLineage()
    LineageRecorder(other, root, local_file).poll()  # type: ignore[arg-type]
    assert other.metrics == [(1, {"reward_mean": 0.5})] and other.versions[0][3] == {"reward_mean": 0.5}


def test_evaluations_during_training_are_logged_at_step_version_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each record of ``evaluations/`` becomes ``eval/*`` metrics at step = its version, once
    the evaluator's state says it is there; a poll with nothing new reads the state only; a
    resumed recorder logs none that the MLflow run holds already."""
    from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState

    def result(version: int, pass_at_1: float) -> dict[str, Any]:
        return {"version": version, "pass_at_1": pass_at_1, "prompts": 4, "samples_per_prompt": 2,
                "mean_output_tokens": 9.0, "by_task": {"pass_at_1/math": pass_at_1}, "wall_s": 3.0, "skipped": []}

    root = open_root(str(tmp_path / "run"))
    store = EvaluationStore(root)
    lineage = FakeLineage()
    lineage.metric_steps = lambda key: set()  # type: ignore[attr-defined]
    recorder = LineageRecorder(lineage, root, tmp_path / "none.jsonl", follow_evaluations=True)  # type: ignore[arg-type]
    recorder.adopt_logged_versions()
    recorder.poll()
    assert lineage.metrics == [] and recorder.evaluations == {}
    store.write(0, result(0, 0.25))  # written, but the state does not say so yet
    store.set_state(EvaluatorState(every=2, done=-1, current=2))
    recorder.poll()
    assert lineage.metrics == []
    store.set_state(EvaluatorState(every=2, done=0, current=2))
    store.write(2, result(2, 0.5))
    store.set_state(EvaluatorState(every=2, done=2, current=None))
    recorder.poll()
    assert lineage.metrics == [
        (0, {"eval/pass_at_1": 0.25, "eval/prompts": 4.0, "eval/mean_output_tokens": 9.0, "eval/pass_at_1/math": 0.25}),
        (2, {"eval/pass_at_1": 0.5, "eval/prompts": 4.0, "eval/mean_output_tokens": 9.0, "eval/pass_at_1/math": 0.5}),
    ]
    assert {v: r.pass_at_1 for v, r in recorder.evaluations.items()} == {0: 0.25, 2: 0.5}

    calls: list[str] = []
    for name in ("read_bytes", "list_dir"):
        real = getattr(fs, name)
        monkeypatch.setattr(fs, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    recorder.poll()
    assert calls == ["read_bytes", "read_bytes"] and len(lineage.metrics) == 2  # LATEST and the state
    monkeypatch.undo()

    resumed = FakeLineage()
    resumed.metric_steps = lambda key: {0, 2} if key == "eval/pass_at_1" else set()  # type: ignore[attr-defined]
    again = LineageRecorder(resumed, root, tmp_path / "none.jsonl", follow_evaluations=True)  # type: ignore[arg-type]
    again.adopt_logged_versions()
    store.write(4, result(4, 0.75))
    store.set_state(EvaluatorState(every=2, done=4, current=None))
    again.poll()
    assert [step for step, _ in resumed.metrics] == [4] and sorted(again.evaluations) == [0, 2, 4]
