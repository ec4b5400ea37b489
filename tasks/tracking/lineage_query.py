"""Reading lineage back, both ways (``asyncrl lineage``).

Down: a weight version (or a registered ``models:/NAME/N`` / ``models:/NAME@alias``) -> its
registered versions -> its LoggedModel (status, metrics) -> its weights in the store -> its
training step and parent -> the shards manifest -> the prompt datasets. Up: a dataset file
(by the sha256 digest the run recorded) -> the runs that used it -> their LoggedModels and
registered versions. Each call reads a bounded number of records: the one version's model,
manifest and registrations, or per run using the dataset its models and registrations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.configs.secrets import REDACTED
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.storage.weights import WeightStore
from asyncrl.storage.paths import TRACKING_FILE
from asyncrl.tasks.tracking.branch_record import PARENT_RUN_TAG, PARENT_STEP_TAG
from asyncrl.tasks.tracking.lineage_recorder import file_ref
from asyncrl.tasks.tracking.model_registry import logged_model_id


@dataclass(frozen=True)
class RunStore:
    """A run root and the MLflow run it records to."""

    root: RunRoot
    lineage: RunLineage


def check_mlflow_uri(uri: str) -> None:
    """Refuse a URI MLflow cannot open as given: a redacted password, or a SQLite file that
    is not there (MLflow would create an empty store instead of failing)."""
    if f":{REDACTED}@" in uri:
        raise ValueError(f"MLflow URI {uri}: its password is hidden; pass --mlflow-uri with the real URI")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise FileNotFoundError(
            f"MLflow store {uri}: no such SQLite file (relative paths are read from the current directory: "
            "run from where the run was started, or pass --mlflow-uri)"
        )


def open_lineage(uri: str, run_id: str) -> RunLineage:
    """The MLflow run ``run_id`` at ``uri``; ValueError naming both if it is not there."""
    from mlflow.exceptions import MlflowException

    check_mlflow_uri(uri)
    try:
        return RunLineage.resume(uri, run_id)
    except MlflowException as exc:
        raise ValueError(f"MLflow store {uri}: run {run_id} not found ({exc.message})") from None


def open_run_store(root: RunRoot, mlflow_uri: str | None = None) -> RunStore:
    """The run root ``root`` and its MLflow run, named in its ``tracking.json`` (the tracking
    URI there unless ``mlflow_uri`` is given)."""
    recorded = fs.read_json_object(root, TRACKING_FILE)
    if recorded is None:
        raise FileNotFoundError(
            f"{root.display(TRACKING_FILE)}: not found; {root.uri} is not the run root of a run with an MLflow "
            "record (asyncrl run and the train flow write it)"
        )
    return RunStore(root, open_lineage(mlflow_uri or str(recorded["mlflow_uri"]), str(recorded["mlflow_run_id"])))


def _registered_version(client: Any, tracking_uri: str, uri: str) -> Any:  # noqa: ANN401 - an MlflowClient; a ModelVersion
    from mlflow.exceptions import MlflowException

    rest = uri.removeprefix("models:/")
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            return client.get_model_version_by_alias(name, alias)
        name, _, number = rest.partition("/")
        if not number.isdigit():
            raise ValueError(f"{uri}: expected models:/NAME/NUMBER or models:/NAME@ALIAS")
        return client.get_model_version(name, number)
    except MlflowException as exc:
        raise ValueError(f"{uri}: not in the registry of {tracking_uri} ({exc.message})") from None


def resolve_version(store: RunStore, ref: str) -> tuple[int, str]:
    """(weight version, LoggedModel id) of ``ref``: a weight version number of the run, or a
    registered version ``models:/NAME/N`` / ``models:/NAME@ALIAS`` of one of its models."""
    lineage = store.lineage
    if ref.startswith("models:/"):
        registered = _registered_version(lineage.client, lineage.tracking_uri, ref)
        model_id = registered.model_id or registered.tags.get("asyncrl.model_id")
        model = lineage.client.get_logged_model(model_id) if model_id else None
        if model is None or model.source_run_id != lineage.run_id:
            owner = model.source_run_id if model is not None else "no asyncrl run"
            raise ValueError(f"{ref}: belongs to {owner}, not to run {lineage.run_id} of {store.root.uri}")
        return int(model.tags["asyncrl.version"]), model.model_id
    if not ref.isdigit():
        raise ValueError(f"{ref!r}: expected a weight version number, models:/NAME/N or models:/NAME@ALIAS")
    return int(ref), logged_model_id(lineage, int(ref))


def _registrations(lineage: RunLineage, model_id: str) -> list[tuple[str, str, list[str]]]:
    """(name, number, aliases) of each registered version of the model."""
    found = []
    for version in lineage.client.search_model_versions(f"run_id = '{lineage.run_id}'"):
        if (version.model_id or version.tags.get("asyncrl.model_id")) == model_id:
            full = lineage.client.get_model_version(version.name, version.version)
            found.append((version.name, str(version.version), sorted(full.aliases)))
    return found


def version_lineage(store: RunStore, ref: str) -> list[str]:
    """The chain of ``ref`` (see the module docstring), one line per link."""
    lineage, root = store.lineage, store.root
    version, model_id = resolve_version(store, ref)
    model = lineage.client.get_logged_model(model_id)
    run = lineage.client.get_run(lineage.run_id)
    lines = [f"weight version {version} of run {run.info.run_name!r} (MLflow run {lineage.run_id}, {lineage.tracking_uri})"]
    parent_run = run.data.tags.get(PARENT_RUN_TAG)
    if parent_run:
        parent_name = lineage.client.get_run(parent_run).info.run_name
        lines.append(f"  branch of       run {parent_name!r} (MLflow run {parent_run}) from its step "
                     f"{run.data.tags.get(PARENT_STEP_TAG)}, {run.data.tags.get('asyncrl.kind', 'replay')} of {run.data.tags.get('asyncrl.parent_root')}")  # fmt: skip
    for name, number, aliases in _registrations(lineage, model_id):
        shown = f" (aliases: {', '.join(aliases)})" if aliases else ""
        lines.append(f"  registered      models:/{name}/{number}{shown}")
    status = str(model.status).removeprefix("LoggedModelStatus.")
    flavor = ", transformers flavor" if lineage.has_hf_model(model_id) else ""
    lines.append(f"  LoggedModel     {model_id} {model.name!r} [{status}{flavor}] {model.artifact_location}")
    for metric in sorted(model.metrics or [], key=lambda m: m.key):
        if metric.key.startswith("eval_") or metric.key == "reward_mean":
            on = f" on {metric.dataset_name} ({metric.dataset_digest})" if metric.dataset_name else ""
            lines.append(f"    {metric.key} = {metric.value:.4g}{on}")
    where = model.tags.get("asyncrl.weights_uri", root.display(paths.weights_version_dir(version)))
    if fs.exists(root, paths.weights_complete_marker(version)):
        state = "pinned" if version in WeightStore(root).pinned_versions() else "complete"
    else:
        state = "pruned from the store (its lineage file is kept)"
    lines.append(f"  weights         {where} ({state})")
    manifest = lineage.read_manifest(model_id)
    parent = manifest.get("parent_version")
    parent_model = model.tags.get("asyncrl.parent_model_id")
    lines.append(
        f"  step            {manifest.get('step')}, parent version {parent}"
        + (f" (LoggedModel {parent_model})" if parent_model else "")
    )
    shards = manifest.get("shards") or []
    rows = sum(s.get("rows") or 0 for s in shards)
    groups = sum(s.get("groups") or 0 for s in shards)
    lines.append(f"  shards manifest {model.artifact_location.rstrip('/')}/{model.tags.get('asyncrl.lineage_artifact')}: "
                 f"{len(shards)} shards, {rows} rows, {groups} groups")  # fmt: skip
    for shard in shards:
        lines.append(f"    {shard['name']} sha256:{shard['digest']} rows {shard['rows']} groups {shard['groups']} {shard['uri']}")
    for dataset in manifest.get("datasets") or []:
        lines.append(f"  prompt dataset  {dataset['name']} sha256:{dataset['digest']} {dataset['uri']}")
    return lines


def dataset_lineage(lineage_uri: str, path: str) -> list[str]:
    """The runs of the MLflow store at ``lineage_uri`` that recorded the dataset file ``path``
    (by its digest) as an input, with their weight versions and registered versions."""
    from mlflow import MlflowClient

    check_mlflow_uri(lineage_uri)
    ref = file_ref(path, Path(path).name)
    client = MlflowClient(tracking_uri=lineage_uri, registry_uri=lineage_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"dataset.digest = '{ref.digest}'") if experiments else []
    lines = [f"dataset {ref.name} sha256:{ref.digest} ({path}): used by {len(runs)} run(s) in {lineage_uri}"]
    for run in runs:
        contexts = sorted({
            tag.value for found in run.inputs.dataset_inputs if found.dataset.digest == ref.digest
            for tag in found.tags if tag.key == "mlflow.data.context"
        })  # fmt: skip
        lines.append(f"  run {run.info.run_name!r} {run.info.run_id} [{run.info.status}] as {', '.join(contexts) or 'input'}")
        versions = RunLineage(client, run.info.experiment_id, run.info.run_id, lineage_uri).logged_versions()
        if versions:
            held = sorted(versions)
            lines.append(f"    weight versions {held[0]}..{held[-1]}: {len(held)} LoggedModels")
        for version in client.search_model_versions(f"run_id = '{run.info.run_id}'"):
            model_id = version.model_id or version.tags.get("asyncrl.model_id")
            weight = next((v for v, m in versions.items() if m == model_id), "?")
            lines.append(f"    registered models:/{version.name}/{version.version} = weight version {weight} ({model_id})")
    return lines


def model_history(tracking_uri: str, ref: str, max_runs: int = 100) -> list[str]:
    """A registered version's history across runs (``asyncrl lineage models:/NAME@ALIAS`` with
    no run named): from its LoggedModel to the first version of its run, that run's dataset
    inputs (SFT and RL files, with digests), then across the link a scheduled run's first
    version carries (``asyncrl.parent_model_id``, another run's LoggedModel) into the run it
    continued, and so on back to the first run. Per run a bounded number of reads (its
    LoggedModels, its inputs); at most ``max_runs`` runs."""
    from mlflow import MlflowClient

    check_mlflow_uri(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    registered = _registered_version(client, tracking_uri, ref)
    model = client.get_logged_model(registered.model_id or registered.tags.get("asyncrl.model_id"))
    lines = [f"{ref} = version {registered.version} of {registered.name}"]
    for _ in range(max_runs):
        run = client.get_run(model.source_run_id)
        lineage = RunLineage(client, model.experiment_id, run.info.run_id, tracking_uri)
        versions = lineage.logged_versions()
        first = client.get_logged_model(versions[min(versions)]) if versions else model
        lines.append(
            f"  weight version {model.tags.get('asyncrl.version')} of run {run.info.run_name!r} "
            f"(MLflow run {run.info.run_id}; its versions {min(versions, default='?')}..{max(versions, default='?')})"
        )
        for found in run.inputs.dataset_inputs:
            context = next((t.value for t in found.tags if t.key == "mlflow.data.context"), "input")
            lines.append(f"    {context:<9} {found.dataset.name} sha256:{found.dataset.digest} {found.dataset.source}")
        parent = first.tags.get("asyncrl.parent_model_id")
        if not parent:
            lines.append("  (the first run: it continued from no registered model)")
            return lines
        model = client.get_logged_model(parent)
        lines.append(f"  continued from LoggedModel {parent}")
    lines.append(f"  ... (stopped after {max_runs} runs)")
    return lines
