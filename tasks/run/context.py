"""What every flow does first: open the run root, freeze the config into it, lay out the
local scratch directory, and (for runs that record lineage) attach the run's MLflow run.
Plain functions; the flows call them."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml

from asyncrl.configs.loading import frozen_yaml, public_dict
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.lineage import RunLineage


PRIVATE_CONFIG = "run-config.private.yaml"


@dataclass(frozen=True)
class RunPaths:
    """The run root in storage and the local scratch directory of one run."""

    root: RunRoot
    work_dir: Path
    private_config: Path
    """The full config (secrets included) for the processes this run starts: mode 0600,
    local, never uploaded. The run root holds the redacted `config.yaml`."""

    def log(self, name: str) -> Path:
        return self.work_dir / "logs" / name


def run_paths(config: RunConfig) -> RunPaths:
    """The run's paths as :func:`prepare_run` lays them out, writing nothing."""
    return RunPaths(
        root=open_root(config.storage.root, config.storage.options),
        work_dir=config.run_work_dir,
        private_config=config.run_work_dir / PRIVATE_CONFIG,
    )


def prepare_run(config: RunConfig) -> RunPaths:
    """Open the root, write `config.yaml` once (a restarted run must keep its config), and
    write the private config for child processes."""
    run = run_paths(config)
    root = run.root
    frozen = frozen_yaml(config).encode()
    try:
        fs.put_if_absent(root, paths.CONFIG, frozen)
    except FileExistsError:
        existing = yaml.safe_load(fs.read_bytes(root, paths.CONFIG))
        if existing.get("name") != config.name:
            raise ValueError(
                f"{root.display(paths.CONFIG)}: the run root belongs to run {existing.get('name')!r}, "
                f"not {config.name!r}; use another storage.root"
            ) from None
    (run.work_dir / "logs").mkdir(parents=True, exist_ok=True)
    full = config.model_dump(mode="json")
    if config.rollout.api_key is not None:
        full["rollout"]["api_key"] = config.rollout.api_key.get_secret_value()
    descriptor = os.open(run.private_config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(descriptor, "w") as handle:
        yaml.safe_dump(full, handle, sort_keys=False)
    return run


TRACKING_FILE = "tracking.json"


@dataclass(frozen=True)
class RunContext:
    """Everything the stages of one run share, built once by :func:`open_run_context`: the
    validated config, its paths and the run's one MLflow run."""

    config: RunConfig
    paths: RunPaths
    lineage: RunLineage


def open_run_context(config: RunConfig) -> RunContext:
    """:func:`prepare_run`, then the run's MLflow run: the one recorded in the run root's
    ``tracking.json`` (marked running again: a re-run or retry of a run continues its
    record), else a new one, recorded there before anything is logged to it."""
    run_paths = prepare_run(config)
    tracking = config.tracking
    recorded = fs.read_json_object(run_paths.root, TRACKING_FILE)
    if recorded is not None and recorded.get("mlflow_uri") == tracking.mlflow_uri:
        lineage = RunLineage.resume(tracking.mlflow_uri, str(recorded["mlflow_run_id"]))
        lineage.client.update_run(lineage.run_id, status="RUNNING")
        return RunContext(config, run_paths, lineage)
    lineage = RunLineage.start(tracking.mlflow_uri, tracking.experiment, config.name, public_dict(config))
    record = {"mlflow_uri": tracking.mlflow_uri, "mlflow_run_id": lineage.run_id}
    fs.put_atomic_replace(run_paths.root, TRACKING_FILE, json.dumps(record).encode())
    return RunContext(config, run_paths, lineage)
