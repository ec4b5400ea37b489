"""The `train-nightly` flow: continue asynchronous RL from the registered model's `best`
version, as a new run whose name and storage root carry the date."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import fsspec
from mlflow import MlflowClient
from prefect import flow

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.pipeline import pipeline


def registered_weights_uri(tracking_uri: str, registered_model: str, alias: str = "best") -> str:
    """Where the weights of `registered_model@alias` live (the LoggedModel's weights URI)."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    version = client.get_model_version_by_alias(registered_model, alias)
    model_id = version.tags.get("asyncrl.model_id") or version.model_id
    if not model_id:
        raise ValueError(f"models:/{registered_model}@{alias} (version {version.version}) names no asyncrl LoggedModel")
    uri = client.get_logged_model(model_id).tags.get("asyncrl.weights_uri")
    if not uri:
        raise ValueError(f"LoggedModel {model_id} has no asyncrl.weights_uri tag")
    return uri


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
