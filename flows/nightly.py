"""The `train-nightly` flow: continue asynchronous RL from the registered model's `best`
version, as a new run whose name and storage root carry the date."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import fsspec
from asyncrl.tasks.tracking.model_registry import registered_weights_uri
from prefect import flow

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.pipeline import pipeline


def nightly_config(config: RunConfig, base_model_dir: Path, today: dt.date) -> RunConfig:
    """The run config of tonight's continuation: dated name and root, no warm start."""
    stamp = today.strftime("%Y%m%d")
    data = config.model_dump()
    data["name"] = f"{config.name}-nightly-{stamp}"
    data["model"]["path"] = str(base_model_dir)
    data["storage"]["root"] = f"{config.storage.root.rstrip('/')}-nightly-{stamp}"
    data["pipeline"].update(init_tiny_model=False, sft_steps=0)
    return RunConfig.model_validate(data)


@flow(name="train-nightly", log_prints=True)
def train_nightly(config: RunConfig, registered_model: str, alias: str = "best") -> dict[str, Any]:
    """Download `registered_model@alias` and run the pipeline from it."""
    today = dt.datetime.now(dt.UTC).date()
    uri = registered_weights_uri(config.tracking.mlflow_uri, registered_model, alias)
    target = Path(config.work_dir) / f"{config.name}-nightly-{today:%Y%m%d}" / "base-model"
    if not (target / "config.json").exists():
        filesystem, path = fsspec.core.url_to_fs(uri, **config.storage.options)
        filesystem.get(path.rstrip("/") + "/", str(target), recursive=True)
    return pipeline(nightly_config(config, target, today))
