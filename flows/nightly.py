"""The `train-nightly` flow: continue asynchronous RL from the registered model's `best`
version, as a new run whose name and storage root carry the date."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import fsspec
from prefect import flow
from prefect.states import Completed

from asyncrl.tasks.tracking.branch_record import link_first_version
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.promotion_registry import aliased_version

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.pipeline import SKIPPED, pipeline
from asyncrl.tasks.pipeline.train_data import choose_train_data


def nightly_config(
    config: RunConfig, base_model_dir: Path, today: dt.date, require_new_files: bool | None = None
) -> RunConfig:
    """The run config of tonight's continuation: dated name and root, no warm start.
    ``require_new_files`` (None: the config's, or True when ``data.train_path`` is a folder):
    ``data.require_new_files``, so a night with no new train file is skipped."""
    stamp = today.strftime("%Y%m%d")
    data = config.model_dump()
    if require_new_files is None:
        require_new_files = config.data.require_new_files or config.data.train_folder
    data["data"]["require_new_files"] = require_new_files
    data["name"] = f"{config.name}-nightly-{stamp}"
    data["model"]["path"] = str(base_model_dir)
    data["storage"]["root"] = f"{config.storage.root.rstrip('/')}-nightly-{stamp}"
    data["pipeline"].update(init_tiny_model=False, sft_steps=0)
    return RunConfig.model_validate(data)


@flow(name="train-nightly", log_prints=True)
def train_nightly(
    config: RunConfig, registered_model: str, alias: str = "best", date: dt.date | None = None,
    require_new_files: bool | None = None,
) -> Any:  # noqa: ANN401 - the pipeline's result, or a state holding it
    """Download `registered_model@alias` and run the pipeline from it, as the run of `date`
    (default: the day the flow run was scheduled for, so a late or retried run keeps its
    night's name); its register stage's gate compares tonight's best version with that model
    and says so in the final state's message. Its first weight version names the model's
    LoggedModel as its parent, so lineage follows the model across nights. A folder
    ``data.train_path`` trains each night on the files no earlier night trained on; with none
    new (``require_new_files``, see :func:`nightly_config`) the run is Completed as "Skipped"
    before the model is downloaded."""
    from prefect.runtime import flow_run

    today = date or (flow_run.scheduled_start_time or dt.datetime.now(dt.UTC)).date()
    incumbent = aliased_version(config.tracking.mlflow_uri, registered_model, alias)
    if incumbent is None:
        raise ValueError(f"models:/{registered_model}@{alias}: no such registered model or alias to continue from")
    uri = incumbent.weights_uri
    target = Path(config.work_dir) / f"{config.name}-nightly-{today:%Y%m%d}" / "base-model"
    tonight = nightly_config(config, target, today, require_new_files)
    skipped = choose_train_data(tonight, None).skipped  # only looks; the pipeline chooses and records
    if skipped is not None:
        return Completed(name=SKIPPED, message=skipped, data={"run": tonight.name, "skipped": skipped})
    if not (target / "config.json").exists():
        filesystem, path = fsspec.core.url_to_fs(uri, **config.storage.options)
        filesystem.get(path.rstrip("/") + "/", str(target), recursive=True)
    state = pipeline(tonight, return_state=True)
    summary = state.result()
    if state.name == SKIPPED:  # nothing new by the time the run chose
        return Completed(name=SKIPPED, message=state.message, data=summary)
    lineage = RunLineage.resume(config.tracking.mlflow_uri, summary["mlflow_run_id"])
    link_first_version(lineage, incumbent.model_id)
    return Completed(message=state.message, data=summary)
