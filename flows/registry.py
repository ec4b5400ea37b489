"""The `promote` and `rollback` flows: move a registered model's `best` and `current` by hand
from the Prefect UI, as ``asyncrl promote`` / ``asyncrl rollback`` do
(:mod:`asyncrl.tasks.tracking.promotion_registry`); the final state's message says what moved,
a refused version fails the run naming it."""

from __future__ import annotations

from prefect import flow
from prefect.states import Completed

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
from asyncrl.tasks.tracking.promotion_registry import promote, rollback


@flow(name="promote", log_prints=True)
def promote_version(config: RunConfig, registered_model: str, version: str) -> Completed:
    """Make `registered_model` version `version` its `best` and `current` (the config gives the
    MLflow store and the storage where its weights are checked)."""
    apply_storage_credentials(config.storage)
    line = promote(config.tracking.mlflow_uri, registered_model, version, config.storage.options)
    print(line)
    return Completed(message=line, data=line)


@flow(name="rollback", log_prints=True)
def rollback_best(config: RunConfig, registered_model: str) -> Completed:
    """Move `registered_model`'s `best` and `current` back to the version the promoted one replaced."""
    apply_storage_credentials(config.storage)
    line = rollback(config.tracking.mlflow_uri, registered_model, config.storage.options)
    print(line)
    return Completed(message=line, data=line)
