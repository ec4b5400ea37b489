"""A small finished run for the MLflow tests: a local run root whose weight versions are real
copies of the tiny model (each with its lineage file), a shard per RL step, a prompt dataset
file, the run root's ``tracking.json`` and its MLflow run on SQLite, filled by the real
:class:`LineageRecorder`. Plain functions, no pytest."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from run_root_builder import RunRootBuilder

from asyncrl.storage import fs
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.storage.paths import TRACKING_FILE
from asyncrl.tasks.tracking.lineage_recorder import LineageRecorder, file_ref


@dataclass(frozen=True)
class TinyRun:
    root: RunRoot
    lineage: RunLineage
    recorder: LineageRecorder
    data_file: Path
    shards: dict[int, str]
    """RL step -> the shard it was trained on."""


def tiny_run(tmp_path: Path, model_dir: Path, steps: int = 2, run_name: str = "tiny") -> TinyRun:
    """Versions 0 (the warm start) .. ``steps``, version v trained at step v on one shard;
    per-step metrics (reward, pass@1, staleness counts) in the trainer's metrics file."""
    root = open_root(str(tmp_path / "store"))
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lineage = RunLineage.start(uri, "tiny-exp", run_name, {"name": run_name})
    fs.put_atomic_replace(root, TRACKING_FILE, json.dumps({"mlflow_uri": uri, "mlflow_run_id": lineage.run_id}).encode())
    dataset = file_ref(str(data_file), data_file.name)
    lineage.log_dataset(dataset)
    builder = RunRootBuilder(root, tmp_path)
    metrics_file = tmp_path / "trainer-metrics.jsonl"
    shards: dict[int, str] = {}
    for version in range(steps + 1):
        local = tmp_path / f"weights-v{version}"
        shutil.copytree(model_dir, local)
        if version:
            shards[version] = builder.shard({2 * version: [version - 1, version - 1], 2 * version + 1: [version - 1]})
        lineage_info = {"version": version, "parent_version": version - 1 if version else None, "step": version,
                        "shards": [shards[version]] if version else []}  # fmt: skip
        (local / LINEAGE_FILE).write_text(json.dumps(lineage_info))
        WeightStore(root).publish(version, local)
        if version:
            record = {"step": version, "reward_mean": 0.2 * version, "pass_at_1/math": 0.1 * version,
                      "staleness/count_0": 2.0, "staleness/count_1": float(version)}  # fmt: skip
            with metrics_file.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
    recorder = LineageRecorder(lineage, root, metrics_file, [dataset])
    recorder.poll()
    return TinyRun(root, lineage, recorder, data_file, shards)
