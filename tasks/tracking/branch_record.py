"""The MLflow record of a replay or a fork: a run of its own, its weight versions as LoggedModels
(the lineage recorder's, as a training run logs them), linked to the run it branched from:
the run carries the parent run and step as tags, and its first LoggedModel names the parent's
LoggedModel of that step as its parent (``asyncrl.parent_model_id``), so ``asyncrl lineage``
walks from the branch into the parent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.tracking.lineage_recorder import LineageRecorder
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.model_registry import UnknownLoggedVersionError, logged_model_id

PARENT_RUN_TAG = "asyncrl.parent_run_id"
PARENT_STEP_TAG = "asyncrl.branch_step"
PARENT_MODEL_TAG = "asyncrl.parent_model_id"


@dataclass(frozen=True)
class BranchParent:
    """Where a branch starts: the parent's MLflow run and the weight version it starts from."""

    run_id: str
    version: int
    step: int


def parent_model_id(tracking_uri: str, parent: BranchParent) -> str | None:
    """The parent's LoggedModel of ``parent.version``, or None where its run holds none."""
    try:
        return logged_model_id(RunLineage.resume(tracking_uri, parent.run_id), parent.version)
    except UnknownLoggedVersionError:
        return None


def link_first_version(lineage: RunLineage, parent: str) -> str | None:
    """Name LoggedModel ``parent`` (another run's) as the parent of the run's first weight
    version, so ``asyncrl lineage`` walks from this run into that one; the first version's
    LoggedModel id, None when the run logged none."""
    logged = lineage.logged_versions()
    if not logged:
        return None
    first = logged[min(logged)]
    lineage.client.set_logged_model_tags(first, {PARENT_MODEL_TAG: parent})
    return first


def record_branch(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    root: RunRoot,
    metrics_file: Path,
    params: Mapping[str, Any],
    tags: Mapping[str, str],
    parent: BranchParent | None,
    report: str,
    shards_root: RunRoot,
) -> str:
    """The branch's MLflow run (module docstring), finished; ``report`` (the comparison's JSON)
    is its artifact ``replay.json``; the shards its versions name are read in ``shards_root``
    (the parent's run root). Returns the run's id."""
    lineage = RunLineage.start(
        tracking_uri, experiment, run_name, params,
        tags={**tags, **({PARENT_RUN_TAG: parent.run_id, PARENT_STEP_TAG: str(parent.step)} if parent else {})},
    )  # fmt: skip
    recorder = LineageRecorder(lineage, root, metrics_file, shards_root=shards_root)
    recorder.poll()
    if parent is not None:
        linked = parent_model_id(tracking_uri, parent)
        if linked is not None:
            link_first_version(lineage, linked)
    lineage.log_text(report, "replay.json")
    lineage.end()
    return lineage.run_id
