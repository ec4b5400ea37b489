"""Feeds MLflow from what the trainer leaves in storage: per-step metrics (its JSONL file)
and each published weight version, with the shards it was trained on (the version's
lineage file), as a LoggedModel. The trainer process itself never talks to MLflow."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.lineage import DataRef, RunLineage
from asyncrl.storage.weights import WeightStore
from asyncrl.storage.weight_lineage import read_lineage
from asyncrl.tasks.trainer.metrics import read_jsonl_metrics

LOG = logging.getLogger("asyncrl.lineage")


def shard_ref(root: RunRoot, shard_name: str) -> DataRef:
    """A shard as an MLflow dataset: its URI and the sha256 of its bytes (first 16 hex)."""
    relpath = paths.shard_path(shard_name)
    digest = hashlib.sha256(fs.read_bytes(root, relpath)).hexdigest()[:16]
    return DataRef(name=shard_name, uri=root.display(relpath), digest=digest)


def file_ref(path: str, name: str) -> DataRef:
    """A dataset file as an MLflow dataset (sha256 of its bytes, first 16 hex)."""
    import fsspec

    with fsspec.open(path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:16]
    return DataRef(name=name, uri=str(path), digest=digest)


@dataclass
class LineageRecorder:
    lineage: RunLineage
    root: RunRoot
    metrics_file: Path
    logged_versions: dict[int, str] = field(default_factory=dict)
    """Weight version -> LoggedModel id."""
    metrics_by_step: dict[int, dict[str, float]] = field(default_factory=dict)
    _metric_lines: int = 0

    def adopt_logged_versions(self) -> None:
        """Count the versions this MLflow run already holds as logged (a resumed run)."""
        self.logged_versions.update(self.lineage.logged_versions())

    def poll(self) -> None:
        """Log new metric lines, then every newly published version."""
        self._log_new_metrics()
        store = WeightStore(self.root)
        for version in store.list_versions():
            if version not in self.logged_versions:
                self._log_version(store, version)

    def _log_new_metrics(self) -> None:
        if not self.metrics_file.exists():
            return
        records = read_jsonl_metrics(self.metrics_file)
        for record in records[self._metric_lines :]:
            step = int(record.get("step", 0) or 0)
            values = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            self.metrics_by_step[step] = values
            self.lineage.log_metrics(step, values)
        self._metric_lines = len(records)

    def _log_version(self, store: WeightStore, version: int) -> None:
        info = read_lineage(self.root, version) or {}
        shards = [shard_ref(self.root, name) for name in info.get("shards", [])]
        step = info.get("step")
        metrics = self.metrics_by_step.get(int(step), {}) if isinstance(step, int) else {}
        weights_uri = self.root.display(paths.weights_version_dir(version))
        model_id = self.lineage.log_version(version, weights_uri, shards, metrics)
        self.logged_versions[version] = model_id
        LOG.info("MLflow: weight version %d -> LoggedModel %s (%d shards)", version, model_id, len(shards))
