"""Registering a weight version in the MLflow Model Registry so that it loads: its weights are
pinned in the store (retention never deletes them), put once into its LoggedModel in MLflow's
transformers flavor, and the LoggedModel is registered with the given aliases. The pipeline's
`register` stage and ``asyncrl register`` both go through :func:`register_version`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence

from pathlib import Path

from asyncrl.storage.fs import RunRoot
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.model.lora_adapter import is_adapter_dir, merge_adapter
from asyncrl.tasks.model.weight_fetch import fetch_version
from asyncrl.tasks.tracking.mlflow_run import RunLineage


class UnknownLoggedVersionError(ValueError):
    """The MLflow run holds no LoggedModel for the weight version asked for (names the ones it holds)."""


def logged_model_id(lineage: RunLineage, version: int) -> str:
    """The id of the LoggedModel of weight ``version`` in the run, or
    :class:`UnknownLoggedVersionError` listing the versions the run holds."""
    logged = lineage.logged_versions()
    if version not in logged:
        held = sorted(logged)
        listed = f"{held[0]}..{held[-1]} ({len(held)} versions)" if len(held) > 3 else str(held)
        raise UnknownLoggedVersionError(
            f"weight version {version}: MLflow run {lineage.run_id} ({lineage.tracking_uri}) has no LoggedModel "
            f"for it; it holds versions {listed}"
        )
    return logged[version]


def register_version(
    root: RunRoot,
    lineage: RunLineage,
    version: int,
    model_id: str,
    name: str,
    aliases: Sequence[str],
    base_model_dir: Path | None = None,
) -> str:
    """Pin weight ``version`` in the store, log its HF files (fetched from the store and
    checked against its manifest by the one weight fetch, :func:`~asyncrl.tasks.model.weight_fetch.fetch_version`) into LoggedModel ``model_id`` in the transformers flavor
    unless it holds them already, and register it as ``name`` with ``aliases``; the registered
    version number (the existing one when the model is registered under ``name`` already).

    A LoRA run's version is an adapter: the LoggedModel then holds the adapter itself under
    ``adapter/`` (its ``adapter_config.json`` names the base model) and, in the transformers
    flavor, the merged model (:func:`~asyncrl.tasks.model.lora_adapter.merge_adapter` of it
    into ``base_model_dir``, the run's ``model.path``), so it loads as any other version.
    ``ValueError`` for an adapter without ``base_model_dir``, before anything is logged."""
    store = WeightStore(root)
    store.pin(version)
    if not lineage.has_hf_model(model_id):
        with tempfile.TemporaryDirectory(prefix="asyncrl-register-") as tmp:
            files = fetch_version(root, version, Path(tmp) / "weights-cache")
            if is_adapter_dir(files):
                if base_model_dir is None:
                    raise ValueError(
                        f"weight version {version} is a LoRA adapter: registering it needs its base model (model.path)"
                    )
                lineage.log_adapter(model_id, files)
                files = merge_adapter(base_model_dir, files, Path(tmp) / "merged")
            lineage.log_hf_model(model_id, files)
    return lineage.register(model_id, name, aliases)
