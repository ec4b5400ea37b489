"""``asyncrl replay RUN_ROOT``: the trainer alone, over a finished (or running) run's ledger, in
order, from that run's first weights; then every weight version it published is compared with
the original's by the SHA-256 of its files.

Why it can be exact: all of a run's asynchrony is in generation, whose output is stored (the
shards) along with which step trained which shards (the ledger). Training is then a function of
(first weights, ledger, shards, trainer settings, thread count), and the replay gives the
trainer the same of each (:class:`~asyncrl.tasks.trainer.step_source.LedgerReplay`). A version
that still differs is named with its first differing tensor and the largest difference: a
mismatch is never silent. The original run root is only read. A LoRA run's first weights are
an adapter: its replay trains on the original's base model (``model.path``) from that adapter,
published as the replay's version 0.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.configs.loading import apply_overrides, config_from_dict, parse_override
from asyncrl.configs.processes import process_configs
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.secrets import REDACTED, strip_uri_password
from asyncrl.configs.storage import StorageConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weight_lineage import read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.launch.context import prepare_run, read_run_root_config, write_process_config
from asyncrl.tasks.model.weight_diff import TensorDifference, tensor_difference
from asyncrl.tasks.pipeline.progress import StageProgress
from asyncrl.tasks.pipeline.stages import run_with_metrics
from asyncrl.tasks.placement.launch_settings import trainer_launch
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.tasks.tracking.branch_record import BranchParent, record_branch
from asyncrl.tasks.trainer.checkpoint import CHECKPOINT_COMPLETE, complete_checkpoints
from asyncrl.tasks.trainer.process import TrainerLaunch


class ReplayError(ValueError):
    """A run root that cannot be replayed; the message names what is missing."""


@dataclass(frozen=True)
class StepComparison:
    """The weights after one step (0: the first weights) in both runs: identical when every
    weight file's SHA-256 agrees. Versions are matched by step, not by number: after a
    trainer restart rolled a step back, the original's labels run ahead of its steps."""

    step: int
    version: int
    replay_version: int
    identical: bool
    files_differing: list[str]
    first_tensor: str | None = None
    max_abs_diff: float | None = None
    note: str = ""


def step_versions(store: WeightStore) -> dict[int, int]:
    """Step -> the version that holds the weights after it (its lineage's ``step``; the newest
    where a rolled-back step was published twice), of published and pruned versions alike;
    the lowest version holds step 0's (the first weights)."""
    versions = sorted(set(store.list_versions()) | set(store.pruned_versions()))
    found: dict[int, int] = {0: versions[0]} if versions else {}
    for version in versions:
        lineage = read_lineage(store.root, version) or {}
        step = lineage.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            found[step] = max(version, found.get(step, version))
    return found


def check_fork_overrides(overrides: Sequence[str]) -> None:
    """A fork changes how the trainer learns from the same samples: ``trainer.*`` keys only
    (not ``trainer.max_steps``: the original's ledger sets it). ``ReplayError`` names a key
    that would change which samples exist or how many steps there are."""
    for override in overrides:
        key = ".".join(parse_override(override)[0])
        if not key.startswith("trainer.") or key == "trainer.max_steps":
            raise ReplayError(
                f"{key}: a replay trains on the original run's samples, so only trainer settings may change "
                "(trainer.optimizer.lr, trainer.objective, trainer.clip_eps, ...); this key would change "
                "which samples exist or how many steps there are"
            )


def replayable(original: RunRoot) -> tuple[dict[str, Any], int]:
    """The original's frozen config and its last recorded step; ``ReplayError`` naming the
    file when it is not a run root or recorded no step."""
    frozen = read_run_root_config(original)
    if frozen is None:
        raise ReplayError(f"{original.display('config.yaml')}: not found; {original.uri} is not a run root")
    steps = Ledger(original).last_step()
    if not steps:
        raise ReplayError(f"{original.display('ledger')}: no step recorded; nothing to replay")
    return frozen, steps


def replay_config(
    original: RunRoot,
    frozen: dict[str, Any],
    steps: int,
    to: StorageConfig,
    work_dir: Path,
    initial: Path,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """The replay's run config: the original's frozen config with its own run root ``to``,
    scratch ``work_dir``, the original's first weights ``initial`` as the model, as many steps
    as the original recorded, and nothing around RL (no evaluation, no secrets: the frozen
    config has them redacted); with ``overrides`` (trainer keys: :func:`check_fork_overrides`),
    a fork. ``frozen`` and ``steps``: :func:`replayable` of the original."""
    check_fork_overrides(overrides)
    raw = json.loads(json.dumps(frozen))
    lora = bool((raw.get("trainer") or {}).get("lora"))
    if lora:
        changed = [o.split("=", 1)[0] for o in overrides if o.split("=", 1)[0].startswith("trainer.lora")]
        if changed:
            raise ReplayError(
                f"{changed[0]}: a fork of a LoRA run keeps its adapters' shape (its first adapter is the original's)"
            )
        check_lora_base(original, str((raw.get("model") or {}).get("path", "")))
    raw.update(work_dir=str(work_dir), storage=to.model_dump(mode="json"))
    if not lora:  # a LoRA run's first weights are an adapter of its base, model.path, kept
        raw["model"] = {**raw.get("model", {}), "path": str(initial)}
    raw["trainer"] = {**raw.get("trainer", {}), "max_steps": steps}
    raw["pipeline"] = {**raw.get("pipeline", {}), "eval_every": 0, "synthetic_data": None}
    raw.setdefault("inference", {})["api_key"] = None
    raw["tracking"] = {**raw.get("tracking", {}), "mlflow_uri": f"sqlite:///{work_dir / 'mlflow.db'}"}
    raw["placement"] = {}  # the trainer on this machine
    return config_from_dict(apply_overrides(raw, list(overrides)), source=original.display("config.yaml"))


def check_lora_base(original: RunRoot, base: str) -> None:
    """A LoRA run's replay trains adapters on the original's base model (its ``model.path``):
    ``ReplayError`` naming it when it is a local path that is not there."""
    if "://" not in base and not (Path(base) / "config.json").is_file():
        raise ReplayError(
            f"{original.display('config.yaml')}: model.path {base!r}: the base model of this LoRA run is not "
            "there; a replay trains the run's adapters on it"
        )


def tensor_difference_of(a: WeightStore, va: int, b: WeightStore, vb: int, scratch: Path) -> TensorDifference | None:
    """Version ``va`` of ``a`` against ``vb`` of ``b`` tensor by tensor (downloaded under
    ``scratch``, removed after), or None when either version's files are pruned."""
    try:
        left = a.download(va, scratch / f"a-v{va}")
        right = b.download(vb, scratch / f"b-v{vb}")
    except UnknownWeightVersionError:
        return None
    found = tensor_difference(left, right)
    for directory in (left, right):
        shutil.rmtree(directory)
    return found


def compare_steps(
    original: WeightStore, replay: WeightStore, steps: int, scratch: Path, first_step: int = 0
) -> tuple[list[StepComparison], list[int]]:
    """The weights after each step ``first_step``..``steps`` in both stores, by their weight-file digests;
    for a step whose weights differ and whose files are still in both, the first differing
    tensor and the largest difference. Returns the comparisons and the steps the original has
    no digests of (pruned by a version of asyncrl that did not keep them)."""
    theirs_at, mine_at = step_versions(original), step_versions(replay)
    compared, unknown = [], []
    for step in range(first_step, steps + 1):
        if step not in mine_at:
            raise ReplayError(f"the replay published no weights for step {step}")
        version, replayed = theirs_at.get(step), mine_at[step]
        try:
            theirs = original.weight_digests(version) if version is not None else None
        except UnknownWeightVersionError:
            theirs = None
        if theirs is None or version is None:
            unknown.append(step)
            continue
        mine = replay.weight_digests(replayed)
        differing = sorted(name for name in set(mine) | set(theirs) if mine.get(name) != theirs.get(name))
        if not differing:
            compared.append(StepComparison(step, version, replayed, True, []))
            continue
        found = tensor_difference_of(original, version, replay, replayed, scratch)
        if found is None:
            compared.append(StepComparison(step, version, replayed, False, differing, note="weights pruned: digests compared only"))
            continue
        compared.append(StepComparison(step, version, replayed, False, differing, found.first_tensor, found.max_abs_diff))
    return compared, unknown


def check_checkpoint_kept(original: RunRoot, step: int) -> None:
    """``ReplayError`` naming the checkpoints the original kept, when ``step`` is not one."""
    kept = complete_checkpoints(original)
    if step not in kept:
        raise ReplayError(
            f"--from-step {step}: {original.display(paths.CHECKPOINTS_DIR)} holds complete checkpoints of steps "
            f"{kept} (trainer.keep_checkpoints of the run kept only these)"
        )


def copy_checkpoint(original: RunRoot, target: RunRoot, step: int, scratch: Path) -> None:
    """The original's complete checkpoint of ``step`` into ``target`` (its completion marker
    last, as the trainer writes it), so a trainer there resumes from it; ``ReplayError``
    names the checkpoints the original kept when it has no such one."""
    check_checkpoint_kept(original, step)
    directory = paths.checkpoint_dir(step)
    files = sorted(fs.list_tree(original, directory), key=lambda name: name == CHECKPOINT_COMPLETE)
    for name in files:
        local = scratch / name
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.download_file(original, paths.join(directory, name), local)
        fs.upload_file(target, local, paths.join(directory, name))
    shutil.rmtree(scratch, ignore_errors=True)


@dataclass(frozen=True)
class ReplaySetup:
    """A replay made ready by :func:`prepare_replay`: its run config, paths and trainer launch."""

    original: RunRoot
    config: RunConfig
    run: RunPaths
    launch: TrainerLaunch
    from_step: int
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class ReplayRequest:
    """What to replay: the run root ``original_uri`` (its store ``options``), into run root
    ``to`` (default ``<work_dir>/store``, never inside the original), from the first weights or
    from the original's checkpoint of step ``from_step``; trainer ``overrides`` make it a fork."""

    original_uri: str
    work_dir: Path
    to: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    from_step: int = 0


def prepare_replay(request: ReplayRequest) -> ReplaySetup:
    """Everything before training: the checks (``ReplayError`` naming what is missing, before
    anything is written), the original's first weights downloaded, the replay's run root with
    the trainer's config naming the original (``replay_of``) and, with ``from_step``, the
    original's checkpoint."""
    work_dir, to, options, overrides, from_step = (
        request.work_dir, request.to, request.options, request.overrides, request.from_step
    )
    original = open_root(request.original_uri, options)
    target = StorageConfig(root=to or str(work_dir / "store"), options=options)
    if open_root(target.root, target.options).uri.rstrip("/").startswith(original.uri.rstrip("/")):
        raise ReplayError(f"--to {target.root}: inside the original run root {original.uri}; a replay never writes there")
    frozen, steps = replayable(original)
    if from_step and not 0 < from_step < steps:
        raise ReplayError(f"--from-step {from_step}: must lie between 1 and the original's last step less one ({steps - 1})")
    if from_step:
        check_checkpoint_kept(original, from_step)
    initial = work_dir / "initial-weights"
    config = replay_config(original, frozen, steps, target, work_dir, initial, overrides)  # before anything is downloaded
    work_dir.mkdir(parents=True, exist_ok=True)
    if not initial.is_dir():
        try:
            WeightStore(original).download(0, initial)
        except UnknownWeightVersionError as exc:
            raise ReplayError(f"{original.uri}: its first weights (version 0) are needed to replay from the start; {exc.message}") from None
    run = prepare_run(config)
    if from_step:
        copy_checkpoint(original, run.root, from_step, work_dir / "checkpoint-copy")
    elif config.trainer.lora is not None and WeightStore(run.root).latest() is None:
        WeightStore(run.root).publish(0, initial)  # the original's first adapter, which the trainer goes on from
    trainer = process_configs(config).trainer.model_copy(update={"replay_of": StorageConfig(root=original.uri, options=options)})
    write_process_config(run, "trainer", trainer)
    return ReplaySetup(original, config, run, trainer_launch(config, run, mode="rl"), from_step, tuple(overrides))


def train_replay(setup: ReplaySetup) -> None:
    """The trainer over the original's ledger, to its last step (its progress in the run's
    ``progress.json``); :class:`~asyncrl.tasks.launch.supervisor.ComponentFailed` with the log's
    last lines if it fails."""
    progress = StageProgress(setup.run.work_dir, "replay", setup.config.trainer.max_steps, "steps")
    run_with_metrics(setup.launch, lambda step, m: progress.update(step, f"loss {m.get('loss', 0.0):.4g}"))
    progress.finish(f"{setup.config.trainer.max_steps} steps trained")


def compare_replay(setup: ReplaySetup, scratch: Path) -> dict[str, Any]:
    """The report: ``versions_compared``, ``versions_identical``, ``first_difference`` (None
    when none), ``steps_without_digests`` (the original pruned their weights without keeping
    the digests: not compared, and said so) and every step's comparison (:class:`StepComparison`)."""
    steps, first_step = setup.config.trainer.max_steps, setup.from_step + 1 if setup.from_step else 0
    comparisons, unknown = compare_steps(WeightStore(setup.original), WeightStore(setup.run.root), steps, scratch, first_step)
    first = next((c for c in comparisons if not c.identical), None)
    return {
        "original": setup.original.uri,
        "replay": setup.run.root.uri,
        "from_step": setup.from_step,
        "overrides": list(setup.overrides),
        "steps": steps,
        "versions_compared": len(comparisons),
        "versions_identical": sum(c.identical for c in comparisons),
        "first_difference": None if first is None else asdict(first),
        "steps_without_digests": unknown,
        "comparisons": [asdict(c) for c in comparisons],
        "trainer_log": str(setup.launch.log_path),
    }


def branch_tracking(setup: ReplaySetup) -> tuple[str, BranchParent | None]:
    """Where the branch's MLflow run goes and what it links to: the original's MLflow (its
    run root's ``tracking.json``) when that can be opened from here (no hidden password, its
    SQLite file present), with the parent's run and the version of the step it starts from;
    else the replay's own SQLite file in its work directory, with no parent run."""
    recorded = fs.read_json_object(setup.original, paths.TRACKING_FILE) or {}
    uri, run_id = str(recorded.get("mlflow_uri", "")), str(recorded.get("mlflow_run_id", ""))
    reachable = uri and f":{REDACTED}@" not in uri and (
        not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists()
    )
    if not (reachable and run_id):
        return setup.config.tracking.mlflow_uri, None
    version = step_versions(WeightStore(setup.original)).get(setup.from_step)
    return uri, None if version is None else BranchParent(run_id, version, setup.from_step)


def record_replay(setup: ReplaySetup, report: dict[str, Any]) -> str:
    """The branch's MLflow run (:func:`~asyncrl.tasks.tracking.branch_record.record_branch`),
    recorded in the replay's run root as a run's is (``tracking.json``); returns its id."""
    uri, parent = branch_tracking(setup)
    kind = "fork" if setup.overrides else "replay"
    run_id = record_branch(
        uri, setup.config.tracking.experiment, f"{setup.config.name}-{kind}-from-{setup.from_step}", setup.run.root,
        setup.launch.metrics_file or setup.run.work_dir / "trainer-metrics.jsonl",
        {"overrides": list(setup.overrides), "from_step": setup.from_step, "original": setup.original.uri},
        {"asyncrl.kind": kind, "asyncrl.parent_root": setup.original.uri}, parent, json.dumps(report, indent=1),
        setup.original,
    )  # fmt: skip
    record = {"mlflow_uri": strip_uri_password(uri), "mlflow_run_id": run_id}
    fs.put_atomic_replace(setup.run.root, paths.TRACKING_FILE, json.dumps(record).encode())
    return run_id


def replay_run(request: ReplayRequest) -> dict[str, Any]:
    """The replay (or fork) of ``request``, then the comparison (module docstring):
    :func:`prepare_replay`, :func:`train_replay`, :func:`compare_replay` with the wall time, and
    :func:`record_replay` (the report's ``mlflow_run_id``)."""
    started = time.monotonic()
    setup = prepare_replay(request)
    train_replay(setup)
    report = {**compare_replay(setup, request.work_dir / "compare"), "wall_s": time.monotonic() - started}
    return {**report, "mlflow_run_id": record_replay(setup, report)}
