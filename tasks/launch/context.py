"""What every flow does first: open the run root, freeze the config into it, lay out the
local scratch directory, and (for runs that record lineage) attach the run's MLflow run.
Plain functions; the flows call them."""

from __future__ import annotations

from asyncrl.storage.paths import TRACKING_FILE
from asyncrl.tasks.system.run_paths import RunPaths, run_paths

import errno
import json
import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncrl.configs.loading import frozen_yaml, private_dict, public_dict
from asyncrl.configs.processes import ProcessConfig, ProcessName, process_configs
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.secrets import strip_uri_password
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.tracking.mlflow_run import RunLineage


TRAJECTORY_KEYS: tuple[str, ...] = (
    "seed",
    "model.path",
    "model.dtype",
    "data.train_path",
    "data.sft_path",
    "data.max_prompt_tokens",
    "data.prompt_format",
    "rollout.n_samples",
    "rollout.max_new_tokens",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.eta",
    "rollout.interrupt_mode",
    "rollout.ignore_eos",
    "rollout.dynamic_filter",
    "rollout.adaptive_staleness",
    "trainer.batch_groups",
    "trainer.mini_batches",
    "trainer.objective",
    "trainer.eps_clip",
    "trainer.eps_clip_high",
    "trainer.behav_weight_cap",
    "trainer.behav_cap_mode",
    "trainer.behav_weight_floor",
    "trainer.behav_weight_level",
    "trainer.advantage",
    "trainer.max_staleness",
    "trainer.optimizer",
    "reward",
    "pipeline.synthetic_data",
    "pipeline.sft_steps",
    "pipeline.sft_batch_size",
    "pipeline.sft_optimizer",
)
"""Config keys (a key stands for everything under it) that shape the trajectories and weights a
run root holds: a restart must keep them. The others (trainer.max_steps, inference.num_servers,
ports, cpu_cores, checkpoint_every, shard timing, tracking, run.*...) may change."""
FREE_KEYS: tuple[str, ...] = ("reward.pool",)
"""Keys under a trajectory key that may still change (how many reward workers score)."""


class RunRootMismatchError(ValueError):
    """The run root was started with another config than the one given (names each key)."""


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:  # noqa: ANN401 - YAML data
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def _trajectory_view(data: Mapping[str, Any]) -> dict[str, Any]:
    """The trajectory-relevant leaves of a config as plain data, by dotted key."""
    view: dict[str, Any] = {}
    for key, value in _leaves(data, ""):
        relevant = any(key == k or key.startswith(k + ".") for k in TRAJECTORY_KEYS)
        free = any(key == k or key.startswith(k + ".") for k in FREE_KEYS)
        if relevant and not free:
            view[key] = value
    return view


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:  # noqa: ANN401 - YAML data
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def config_differences(existing: Mapping[str, Any], config: RunConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in the run root, value given) for each trajectory key that differs,
    sorted by key; a section set on one side and null on the other is one difference.

    Keys the run root's `config.yaml` does not hold (written by an older version) are not
    compared: nothing says what they were."""
    given = yaml.safe_load(frozen_yaml(config))  # the same plain form as the file
    old, new = _trajectory_view(existing), _trajectory_view(given)
    differences: list[tuple[str, Any, Any]] = []
    for key in old:
        if key in new:
            if old[key] != new[key]:
                differences.append((key, old[key], new[key]))
        elif any(other.startswith(key + ".") for other in new):  # null (or {}) then, a section now
            differences.append((key, old[key], _lookup(given, key)))
    for key in new:
        if key not in old and any(other.startswith(key + ".") for other in old):  # a section then, null now
            differences.append((key, _lookup(existing, key), new[key]))
    return sorted(differences, key=lambda difference: difference[0])


def read_run_root_config(root: RunRoot) -> dict[str, Any] | None:
    """The run root's frozen `config.yaml`, or None if it has none; ``ValueError`` naming the
    file if it is not a YAML mapping."""
    try:
        raw = fs.read_bytes(root, paths.CONFIG)
    except FileNotFoundError:
        return None
    try:
        content = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{root.display(paths.CONFIG)}: not a readable config ({type(exc).__name__}); "
                         "the run root is damaged: use another storage.root") from None
    if not isinstance(content, dict):
        raise ValueError(f"{root.display(paths.CONFIG)}: not a YAML mapping; the run root is damaged: "
                         "use another storage.root")
    return content


def check_run_root(config: RunConfig, root: RunRoot, existing: Mapping[str, Any]) -> None:
    """Refuse ``config`` for a run root frozen with another run's name or with other
    trajectory settings (:data:`TRAJECTORY_KEYS`), naming each differing key."""
    where = root.display(paths.CONFIG)
    if existing.get("name") != config.name:
        raise RunRootMismatchError(
            f"{where}: the run root belongs to run {existing.get('name')!r}, "
            f"not {config.name!r}; use another storage.root"
        )
    differences = config_differences(existing, config)
    if differences:
        listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in differences)
        raise RunRootMismatchError(
            f"{where}: run {config.name!r} was started with other settings that shape its trajectories "
            f"({listed}); restore them to resume this run, or start a new run (another name and "
            "storage.root) with the new settings"
        )


def require_store_credentials(config: RunConfig) -> None:
    """A config naming ``storage.credentials_block`` needs that Prefect Secret block loaded into
    this process's environment first, which only the flows do
    (:func:`asyncrl.flows.prefect_api.credentials.apply_storage_credentials`); anywhere else
    the store's credentials must already be in the environment. ``ValueError`` naming the field
    otherwise, before the store is touched."""
    block = config.storage.credentials_block
    if block is not None and not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        raise ValueError(
            f"storage.credentials_block: the Prefect Secret block {block!r} is loaded by the flows only "
            "(asyncrl run, a deployment); here set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
        )


def check_resumable(config: RunConfig) -> None:
    """Before anything starts: raise as :func:`prepare_run` would for a run root started with
    another config. Reads only."""
    require_store_credentials(config)
    root = run_paths(config).root
    existing = read_run_root_config(root)
    if existing is not None:
        check_run_root(config, root, existing)


def _no_space(exc: OSError, where: str) -> OSError | None:
    """A full disk reported without a file name, as ``OSError(ENOSPC)`` naming ``where``."""
    if exc.errno == errno.ENOSPC and exc.filename is None:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
    return None


def write_process_config(run: RunPaths, process: ProcessName, config: ProcessConfig) -> Path:
    """``process``'s config, secrets included, at :meth:`RunPaths.process_config` (mode 0600);
    a full disk raises ``OSError(ENOSPC)`` naming the file. Returns the path."""
    path = run.process_config(process)
    _write_private_config(path, private_dict(config))
    return path


def _write_private_config(path: Path, full: dict[str, Any]) -> None:
    """Write ``path`` (mode 0600) whole or not at all: a temporary file beside it, renamed over
    it. Components placed on one machine each prepare the run while the processes started
    before them read their configs; a file truncated and rewritten in place was once read
    empty (a scheduler exiting with "name: Field required")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(descriptor, "w") as handle:
            yaml.safe_dump(full, handle, sort_keys=False)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise _no_space(exc, str(path)) or exc


def prepare_run(config: RunConfig) -> RunPaths:
    """Open the root (the store's credentials in the environment: :func:`require_store_credentials`;
    the processes the run starts inherit them), write `config.yaml`
    once (a restarted run must keep its config), and write each process's config
    (:func:`~asyncrl.configs.processes.process_configs`, secrets included, mode 0600).

    A run root frozen with another run's name or other trajectory settings
    (:data:`TRAJECTORY_KEYS`) is refused (:class:`RunRootMismatchError`, naming each differing
    key with both values) before anything is written."""
    require_store_credentials(config)
    run = run_paths(config)
    root = run.root
    existing = read_run_root_config(root)
    if existing is not None:
        check_run_root(config, root, existing)
    else:
        try:
            fs.put_if_absent(root, paths.CONFIG, frozen_yaml(config).encode())
        except FileExistsError:  # another start froze it just now
            check_run_root(config, root, read_run_root_config(root) or {})
        except OSError as exc:
            raise _no_space(exc, root.display(paths.CONFIG)) or exc
    (run.work_dir / "logs").mkdir(parents=True, exist_ok=True)
    for process, process_config in process_configs(config).items():
        write_process_config(run, process, process_config)
    return run


@dataclass(frozen=True)
class RunContext:
    """Everything the stages of one run share, built once by :func:`open_run_context`: the
    validated config, its paths and the run's one MLflow run."""

    config: RunConfig
    paths: RunPaths
    lineage: RunLineage


CONFIG_ARTIFACT = "config.yaml"
"""The frozen config (secrets redacted) as an artifact of the MLflow run."""

PROCESS_CONFIG_ARTIFACTS = "processes"
"""The MLflow run's folder of each process's config (secrets redacted), ``<process>.yaml``."""


def open_run_context(config: RunConfig) -> RunContext:
    """:func:`prepare_run`, then the run's MLflow run: the one recorded in the run root's
    ``tracking.json`` (marked running again: a re-run or retry of a run continues its
    record), else a new one, recorded there before anything is logged to it. The record
    names the tracking URI without its password. The frozen config (:func:`frozen_yaml`,
    secrets redacted) is the run's artifact :data:`CONFIG_ARTIFACT`, and each process's
    config (redacted) one in :data:`PROCESS_CONFIG_ARTIFACTS`."""
    run_paths = prepare_run(config)
    tracking = config.tracking
    shown_uri = strip_uri_password(tracking.mlflow_uri)
    recorded = fs.read_json_object(run_paths.root, TRACKING_FILE)
    if recorded is not None and recorded.get("mlflow_uri") == shown_uri:
        lineage = RunLineage.resume(tracking.mlflow_uri, str(recorded["mlflow_run_id"]))
        lineage.client.update_run(lineage.run_id, status="RUNNING")
    else:
        lineage = RunLineage.start(
            tracking.mlflow_uri, tracking.experiment, config.name, public_dict(config),
            artifact_location=tracking.artifact_location,
        )
        record = {"mlflow_uri": shown_uri, "mlflow_run_id": lineage.run_id}
        fs.put_atomic_replace(run_paths.root, TRACKING_FILE, json.dumps(record).encode())
    lineage.log_text(frozen_yaml(config), CONFIG_ARTIFACT)
    for process, process_config in process_configs(config).items():
        lineage.log_text(frozen_yaml(process_config), f"{PROCESS_CONFIG_ARTIFACTS}/{process}.yaml")
    return RunContext(config, run_paths, lineage)


def system_metrics(context: RunContext) -> AbstractContextManager[None]:
    """MLflow's system metrics of this machine into the run while the block runs, when
    ``tracking.system_metrics`` is on (every ``tracking.system_metrics_interval_s``)."""
    tracking = context.config.tracking
    if not tracking.system_metrics:
        return nullcontext()
    return context.lineage.system_metrics(tracking.system_metrics_interval_s)
