"""MLflow lineage of a train run: params, step metrics, one LoggedModel per weight version,
and the data each version was trained on: the prompt dataset as a run input (source URI +
digest), the trajectory shards of each step as one JSON manifest artifact per version
(``lineage/v{version:06d}.json``), so the records per step do not grow with its shards.

Uses an explicit `MlflowClient` and run id (never MLflow's global active run), so two
runs in one process cannot mix their records. Secrets never arrive here: callers pass
`configs.loading.public_dict(config)`, and `flatten_params` refuses nothing but keeps
what it is given, so the redaction stays in one place.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param
from mlflow.entities import Dataset as DatasetEntity

TRAINING_CONTEXT = "training"
EVALUATION_CONTEXT = "evaluation"
MAX_PARAM_LENGTH = 6000


LINEAGE_ARTIFACT_DIR = "lineage"


def manifest_artifact_path(version: int) -> str:
    """Run-relative artifact path of the lineage manifest of weight version ``version``."""
    return f"{LINEAGE_ARTIFACT_DIR}/v{version:06d}.json"


@dataclass(frozen=True)
class DataRef:
    """A dataset file a run depends on (prompt dataset, held-out set)."""

    name: str
    uri: str
    digest: str


def flatten_params(nested: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`; values rendered as strings, cut to MLflow's limit."""
    flat: dict[str, str] = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LENGTH]
    return flat


def _dataset_entity(ref: DataRef) -> DatasetEntity:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow warns that local sources are "artifact" sources
        source = resolve_dataset_source(ref.uri)
    return MetaDataset(source=source, name=ref.name, digest=ref.digest)._to_mlflow_entity()


class RunLineage:
    """The MLflow records of one train run (one MLflow run)."""

    def __init__(self, client: MlflowClient, experiment_id: str, run_id: str) -> None:
        self.client = client
        self.experiment_id = experiment_id
        self.run_id = run_id

    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str] | None = None,
    ) -> RunLineage:
        """Create (or reuse) the experiment, open a run and log the flattened params."""
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
        lineage = cls(client, experiment_id, run.info.run_id)
        flat = flatten_params(params)
        items = [Param(k, v) for k, v in flat.items()]
        for start in range(0, len(items), 100):  # MLflow's batch limit on params
            client.log_batch(lineage.run_id, params=items[start : start + 100])
        return lineage

    @classmethod
    def resume(cls, tracking_uri: str, run_id: str) -> RunLineage:
        """Reattach to an existing run (after a restart)."""
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        run = client.get_run(run_id)
        return cls(client, run.info.experiment_id, run_id)

    def log_metrics(self, step: int, metrics: Mapping[str, float], model_id: str | None = None) -> None:
        """Log finite scalar metrics at `step` (optionally linked to a LoggedModel)."""
        timestamp = _now_ms()
        batch = [
            Metric(key, float(value), timestamp, step, model_id=model_id)
            for key, value in metrics.items()
            if value is not None and float(value) == float(value)  # drop None and NaN
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_dataset(self, ref: DataRef, context: str = TRAINING_CONTEXT) -> None:
        """Record a dataset (file, shard) as an input of the run."""
        tags = [InputTag(key="mlflow.data.context", value=context)]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(dataset=_dataset_entity(ref), tags=tags)])

    def logged_versions(self) -> dict[int, str]:
        """Weight version -> id of the READY LoggedModel this run already holds for it (a
        re-run or retry of the run continues its record instead of logging versions twice)."""
        found: dict[int, str] = {}
        for model in self.client.search_logged_models(experiment_ids=[self.experiment_id]):
            version = model.tags.get("asyncrl.version", "")
            if model.source_run_id == self.run_id and version.isdigit() and str(model.status) in ("READY", "LoggedModelStatus.READY"):
                found[int(version)] = model.model_id
        return found

    def log_version(
        self,
        version: int,
        weights_uri: str,
        manifest: Mapping[str, Any],
        metrics: Mapping[str, float],
        weights_dir: Path | None = None,
    ) -> str:
        """Record weight version `version` as a LoggedModel at step = version.

        What it was trained on is ONE JSON artifact of the run, ``lineage/v{version:06d}.json``
        (`manifest`: at least ``shards``, a list of objects with ``name``; the recorder adds
        step, version, parent version and each shard's URI, digest, rows and groups), so the
        MLflow calls per version are a constant number whatever the shards per step: create
        the model, the artifact, the metrics, finalize. The model's tags name the weights'
        URI, the artifact and the shards (``asyncrl.trained_on``, cut to MLflow's limit); the
        step metrics are logged against the model. When `weights_dir` is given the HF files
        are also copied into the model's artifacts.
        """
        shards = manifest.get("shards") or []
        names = [str(shard["name"]) for shard in shards]
        artifact = manifest_artifact_path(version)
        model = self.client.create_logged_model(
            experiment_id=self.experiment_id,
            name=f"policy-v{version}",
            source_run_id=self.run_id,
            tags={
                "asyncrl.version": str(version),
                "asyncrl.weights_uri": weights_uri,
                "asyncrl.lineage_artifact": artifact,
                "asyncrl.trained_on": ",".join(names)[:MAX_PARAM_LENGTH],
            },
            params={"version": str(version)},
        )
        try:
            if weights_dir is not None:
                self.client.log_model_artifacts(model.model_id, str(weights_dir))
            self.client.log_dict(self.run_id, {**manifest, "model_id": model.model_id}, artifact)
            self.log_metrics(version, metrics, model_id=model.model_id)
        except Exception:
            self.client.finalize_logged_model(model.model_id, "FAILED")
            raise
        self.client.finalize_logged_model(model.model_id, "READY")
        return model.model_id

    def log_evaluation(self, model_id: str, version: int, metrics: Mapping[str, float], dataset: DataRef) -> None:
        """Evaluation metrics linked to the model and the held-out dataset."""
        self.log_dataset(dataset, context=EVALUATION_CONTEXT)
        batch = [
            Metric(key, float(value), _now_ms(), version, model_id=model_id,
                   dataset_name=dataset.name, dataset_digest=dataset.digest)
            for key, value in metrics.items()
        ]
        self.client.log_batch(self.run_id, metrics=batch)

    def register(self, model_id: str, registered_name: str, aliases: Sequence[str]) -> str:
        """Register the LoggedModel in the Model Registry and point `aliases` at it.

        MLflow reserves the alias `latest` (`models:/<name>/latest` already resolves to
        the newest version), so it is refused here rather than half-way through.
        """
        from mlflow.exceptions import MlflowException

        reserved = [alias for alias in aliases if alias.lower() == "latest"]
        if reserved:
            raise ValueError("alias 'latest' is reserved by MLflow; models:/<name>/latest already names the newest version")

        try:
            self.client.create_registered_model(registered_name)
        except MlflowException as exc:
            if "already exists" not in str(exc).lower() and "RESOURCE_ALREADY_EXISTS" not in str(exc):
                raise
        existing = [
            v for v in self.client.search_model_versions(f"name='{registered_name}'")
            if v.tags.get("asyncrl.model_id") == model_id
        ]  # fmt: skip
        if existing:  # a re-run of the same run: the model is registered already
            for alias in aliases:
                self.client.set_registered_model_alias(registered_name, alias, existing[0].version)
            return str(existing[0].version)
        model = self.client.get_logged_model(model_id)
        registered = self.client.create_model_version(
            registered_name, source=model.artifact_location, run_id=self.run_id, model_id=model_id,
            tags={"asyncrl.model_id": model_id, "asyncrl.version": model.tags.get("asyncrl.version", "")},
        )
        for alias in aliases:
            self.client.set_registered_model_alias(registered_name, alias, registered.version)
        return str(registered.version)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def _now_ms() -> int:
    return int(time.time() * 1000)
