"""Which train files the earlier runs of a registered model trained on, read from MLflow.

Each pipeline run is tagged with its registered model (:data:`REGISTERED_MODEL_TAG`,
``pipeline.registered_model``) and records the train files it trained on as dataset inputs
of context ``training``: name and source URI the file's URI, digest the sha256 of its bytes
(first 16 hex digits). A later run of the same model searches its experiment's FINISHED runs
with that tag and collects those (URI, digest) pairs: a failed or cancelled run did not
finish training on its files, so they count as new again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from mlflow import MlflowClient

from asyncrl.configs.data import DataConfig
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.train_manifest import TrainFile
from asyncrl.tasks.data.loader import dataset_files
from asyncrl.tasks.data.train_files import train_files
from asyncrl.tasks.tracking.lineage_recorder import file_ref
from asyncrl.tasks.tracking.mlflow_run import TRAINING_CONTEXT, DataRef, RunLineage

REGISTERED_MODEL_TAG = "asyncrl.registered_model"
"""Tag of a pipeline run: the registered model it trains (``pipeline.registered_model``)."""
SKIPPED_TAG = "asyncrl.skipped"
"""Tag of a run that ended without training: why (``data.require_new_files``)."""
CONTEXT_TAG = "mlflow.data.context"
MAX_TAG_LENGTH = 5000


def tag_registered_model(lineage: RunLineage, registered_model: str) -> None:
    """Mark the run as one of ``registered_model``'s (idempotent: a resumed run sets it again)."""
    lineage.client.set_tag(lineage.run_id, REGISTERED_MODEL_TAG, registered_model)


def mark_skipped(lineage: RunLineage, reason: str) -> None:
    """Say on the run why it ended without training (:data:`SKIPPED_TAG`)."""
    lineage.client.set_tag(lineage.run_id, SKIPPED_TAG, reason[:MAX_TAG_LENGTH])


def train_file_refs(files: Iterable[TrainFile]) -> list[DataRef]:
    """The chosen files of a folder as MLflow datasets: named by their URI, since MLflow keeps
    one dataset per (name, digest) in an experiment, with the source it was first logged with."""
    return [DataRef(name=file.uri, uri=file.uri, digest=file.digest) for file in files]


def train_datasets(data: DataConfig, root: RunRoot) -> list[DataRef]:
    """What a run trains on, as the MLflow datasets it records: a folder's chosen files
    (:func:`train_file_refs`), else the file at ``data.train_path`` (a mixture: it and its
    sources) by its name."""
    chosen = train_files(data, root)
    if chosen is not None:
        return train_file_refs(chosen)
    return [file_ref(path, Path(path).name) for path in dataset_files(data.train_path)]


def _runs_filter(registered_model: str) -> tuple[str, bool]:
    """The search filter, and whether it selects by the tag (a name holding both quote marks
    is compared here instead: MLflow's filter strings cannot escape them)."""
    finished = "attributes.status = 'FINISHED'"
    for quote in ("'", '"'):
        if quote not in registered_model:
            return f"tags.`{REGISTERED_MODEL_TAG}` = {quote}{registered_model}{quote} and {finished}", True
    return finished, False


def earlier_train_files(
    tracking_uri: str, experiment: str, registered_model: str, exclude_run_id: str | None = None
) -> frozenset[TrainFile]:
    """The (URI, digest) of every train file the FINISHED runs of ``registered_model`` in
    ``experiment`` recorded (inputs of context ``training``), except run ``exclude_run_id``'s
    (the asking run itself). An experiment that does not exist yet has none."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return frozenset()
    query, by_tag = _runs_filter(registered_model)
    files: set[TrainFile] = set()
    token: str | None = None
    while True:
        page = client.search_runs([found.experiment_id], filter_string=query, max_results=1000, page_token=token)
        for run in page:
            if run.info.run_id == exclude_run_id:
                continue
            if not by_tag and run.data.tags.get(REGISTERED_MODEL_TAG) != registered_model:
                continue
            for given in run.inputs.dataset_inputs if run.inputs else ():
                if {tag.key: tag.value for tag in given.tags}.get(CONTEXT_TAG) != TRAINING_CONTEXT:
                    continue
                try:
                    uri = str(json.loads(given.dataset.source).get("uri") or given.dataset.name)
                except (ValueError, AttributeError):
                    uri = given.dataset.name
                files.add(TrainFile(uri, given.dataset.digest))
        token = page.token
        if not token:
            return frozenset(files)
