"""MLflow lineage of a train run: params, step metrics, one LoggedModel per weight version,
and the data each version was trained on: the prompt dataset as a run input (source URI +
digest), the trajectory shards of each step as one JSON manifest artifact of the version's
LoggedModel (:data:`MANIFEST_ARTIFACT`), so the records per step do not grow with its shards.
A registered version's LoggedModel also holds its HF weights in MLflow's transformers flavor
(:meth:`RunLineage.log_hf_model`), logged once, when it is registered.

Uses an explicit `MlflowClient` and run id (never MLflow's global active run), so two
runs in one process cannot mix their records. Secrets never arrive here: callers pass
`configs.loading.public_dict(config)`, and `flatten_params` refuses nothing but keeps
what it is given, so the redaction stays in one place.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS
from mlflow.entities import DatasetInput, InputTag, LoggedModelOutput, Metric, Param
from mlflow.entities import Dataset as DatasetEntity

TRAINING_CONTEXT = "training"
EVALUATION_CONTEXT = "evaluation"
MAX_PARAM_LENGTH = 6000


MANIFEST_ARTIFACT = "lineage/manifest.json"
"""Path, in a version's LoggedModel artifacts, of its lineage manifest (step, parent version,
the shards it was trained on, the prompt datasets)."""
HF_FLAVOR_TAG = "asyncrl.hf_flavor"
BASE_MODEL_TAG = "asyncrl.base_model"
"""Tag of a LoRA version's LoggedModel: the base model its adapter applies to."""
"""Set on a LoggedModel once its HF weights are logged in the transformers flavor."""
TEXT_GENERATION = "text-generation"


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


def default_artifact_location(tracking_uri: str) -> str | None:
    """Beside a SQLite store (``sqlite:///<dir>/<file>``): ``file://<dir>/mlartifacts``
    (absolute), so a run's artifacts live with its store, not in ``./mlruns`` of whatever
    directory the flow ran in; any other store: None (the server's or file store's default)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or tracking_uri == f"{prefix}:memory:":
        return None
    return (Path(tracking_uri[len(prefix):]).resolve().parent / "mlartifacts").as_uri()


class RunLineage:
    """The MLflow records of one train run (one MLflow run)."""

    def __init__(self, client: MlflowClient, experiment_id: str, run_id: str, tracking_uri: str) -> None:
        self.client = client
        self.experiment_id = experiment_id
        self.run_id = run_id
        self.tracking_uri = tracking_uri

    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str] | None = None,
        artifact_location: str | None = None,
    ) -> RunLineage:
        """Create (or reuse) the experiment, open a run and log the flattened params. A new
        experiment keeps its artifacts at ``artifact_location``, by default
        :func:`default_artifact_location` (an existing one keeps its own)."""
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        location = artifact_location or default_artifact_location(tracking_uri)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment, artifact_location=location)
        run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
        lineage = cls(client, experiment_id, run.info.run_id, tracking_uri)
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
        return cls(client, run.info.experiment_id, run_id, tracking_uri)

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

    def metric_steps(self, key: str) -> set[int]:
        """The steps at which the run holds metric ``key`` (none: empty)."""
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}

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
        parent_model_id: str | None = None,
    ) -> str:
        """Record weight version `version` as a LoggedModel at step = version.

        What it was trained on is ONE JSON artifact of the model, :data:`MANIFEST_ARTIFACT`
        (`manifest`: at least ``shards``, a list of objects with ``name``; the recorder adds
        step, version, parent version, each shard's URI, digest, rows and groups, and the prompt
        datasets), so the MLflow calls per version are a constant number whatever the shards
        per step: create the model, the artifact, the metrics, the run's output link, finalize. The model's tags name
        the weights' URI in the store, the training step, the parent version (and its
        LoggedModel when known) and the shards (``asyncrl.trained_on``, cut to MLflow's
        limit); the step metrics are logged against the model. When `weights_dir` is given the
        HF files are also copied into the model's artifacts.
        """
        shards = manifest.get("shards") or []
        names = [str(shard["name"]) for shard in shards]
        tags = {
            "asyncrl.version": str(version),
            "asyncrl.weights_uri": weights_uri,
            "asyncrl.lineage_artifact": MANIFEST_ARTIFACT,
            "asyncrl.trained_on": ",".join(names)[:MAX_PARAM_LENGTH],
        }
        for key in ("step", "parent_version"):
            if manifest.get(key) is not None:
                tags[f"asyncrl.{key}"] = str(manifest[key])
        if parent_model_id is not None:
            tags["asyncrl.parent_model_id"] = parent_model_id
        model = self.client.create_logged_model(
            experiment_id=self.experiment_id,
            name=f"policy-v{version}",
            source_run_id=self.run_id,
            tags=tags,
            params={"version": str(version)},
        )
        try:
            if weights_dir is not None:
                self.client.log_model_artifacts(model.model_id, str(weights_dir))
            self._log_model_json(model.model_id, {**manifest, "model_id": model.model_id}, MANIFEST_ARTIFACT)
            self.log_metrics(version, metrics, model_id=model.model_id)
            # the run's output at this step: its page lists its models
            self.client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step=version)])
        except Exception:
            self.client.finalize_logged_model(model.model_id, "FAILED")
            raise
        self.client.finalize_logged_model(model.model_id, "READY")
        return model.model_id

    def _log_model_json(self, model_id: str, content: Mapping[str, Any], artifact_file: str) -> None:
        directory, _, name = artifact_file.rpartition("/")
        with tempfile.TemporaryDirectory(prefix="asyncrl-mlflow-") as tmp:
            local = Path(tmp) / name
            local.write_text(json.dumps(content, indent=1))
            self.client.log_model_artifact(model_id, str(local), directory or None)

    def read_manifest(self, model_id: str) -> dict[str, Any]:
        """The lineage manifest of a LoggedModel (:data:`MANIFEST_ARTIFACT`)."""
        from mlflow.artifacts import load_dict

        location = self.client.get_logged_model(model_id).artifact_location.rstrip("/")
        return load_dict(f"{location}/{MANIFEST_ARTIFACT}")

    def log_hf_model(self, model_id: str, hf_dir: Path) -> bool:
        """Put the HF model directory ``hf_dir`` (weights, config, tokenizer) into the
        LoggedModel's artifacts in MLflow's transformers flavor (task text-generation, with its
        pyfunc flavor for ``mlflow models serve``), so ``mlflow.transformers.load_model`` of the
        model, or of a registered version of it, returns a pipeline that generates.

        Once per model: a model tagged :data:`HF_FLAVOR_TAG` is left as it is (False). The
        requirements are pinned to the installed versions instead of MLflow's inference, which
        imports the model in a subprocess."""
        if self.has_hf_model(model_id):
            return False
        model = self.client.get_logged_model(model_id)
        import mlflow.transformers
        from mlflow.models import Model

        with tempfile.TemporaryDirectory(prefix="asyncrl-hf-flavor-") as tmp:
            local = Path(tmp) / "model"
            mlflow_model = Model(artifact_path=model.artifact_location, run_id=self.run_id, model_id=model_id)
            flavor_log = logging.getLogger("mlflow.transformers")
            level = flavor_log.level
            flavor_log.setLevel(logging.ERROR)  # it warns that a local checkpoint has no hub model card or licence
            try:
                mlflow.transformers.save_model(
                    str(hf_dir), path=str(local), task=TEXT_GENERATION, mlflow_model=mlflow_model,
                    pip_requirements=_pinned_requirements(),
                )
            finally:
                flavor_log.setLevel(level)
            self.client.log_model_artifacts(model_id, str(local))
        self.client.set_logged_model_tags(model_id, {HF_FLAVOR_TAG: "transformers"})
        return True

    def log_adapter(self, model_id: str, adapter_dir: Path) -> None:
        """Put a LoRA adapter's files under ``adapter/`` of the LoggedModel's artifacts and tag
        the model with the base model its ``adapter_config.json`` names
        (:data:`BASE_MODEL_TAG`)."""
        import shutil

        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        with tempfile.TemporaryDirectory(prefix="asyncrl-adapter-") as tmp:
            shutil.copytree(adapter_dir, Path(tmp) / "adapter")
            self.client.log_model_artifacts(model_id, tmp)
        self.client.set_logged_model_tags(
            model_id, {BASE_MODEL_TAG: str(config.get("base_model_name_or_path") or ""), "asyncrl.lora_rank": str(config.get("r"))}
        )

    def has_hf_model(self, model_id: str) -> bool:
        """The LoggedModel holds its HF weights in the transformers flavor (:meth:`log_hf_model`)."""
        return self.client.get_logged_model(model_id).tags.get(HF_FLAVOR_TAG) == "transformers"

    def log_text(self, text: str, artifact_file: str) -> None:
        """A text artifact of the run (``artifact_file``: run-relative path)."""
        self.client.log_text(self.run_id, text, artifact_file)

    def log_files(self, local_dir: Path, artifact_path: str) -> None:
        """Every file of ``local_dir`` as run artifacts under ``artifact_path``."""
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

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
        copied = ("asyncrl.version", "asyncrl.step", "asyncrl.weights_uri")
        registered = self.client.create_model_version(
            registered_name, source=model.artifact_location, run_id=self.run_id, model_id=model_id,
            tags={"asyncrl.model_id": model_id, **{key: model.tags[key] for key in copied if key in model.tags}},
            description=(
                f"Weight version {model.tags.get('asyncrl.version', '?')} (training step "
                f"{model.tags.get('asyncrl.step', '?')}) of run {self.run_id}; LoggedModel {model_id}; "
                f"weights in the store at {model.tags.get('asyncrl.weights_uri', '?')}."
            ),
        )
        for alias in aliases:
            self.client.set_registered_model_alias(registered_name, alias, registered.version)
        # As MLflow's own registration does: the UI's model list shows the versions from this tag.
        listed = json.loads(model.tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
        listed.append({"name": registered_name, "version": str(registered.version)})
        self.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(listed)})
        return str(registered.version)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

    @contextmanager
    def system_metrics(self, interval_s: float) -> Iterator[None]:
        """MLflow's own system metrics (``system/cpu_utilization_percentage``, memory, disk,
        network; GPU where there is one) of this machine, sampled every ``interval_s`` into the
        run while the block runs; a resumed run goes on after its last sample's step."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            self.run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=self.tracking_uri
        )
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()


def _pinned_requirements() -> list[str]:
    """pip requirements of a logged HF model: the installed MLflow, transformers, torch,
    tokenizers and safetensors."""
    from importlib.metadata import PackageNotFoundError, version

    pinned = []
    for package in ("mlflow", "transformers", "torch", "tokenizers", "safetensors"):
        try:
            pinned.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            pinned.append(package)
    return pinned


def _now_ms() -> int:
    return int(time.time() * 1000)
