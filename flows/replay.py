"""The `replay` flow: a run's training again from its stored shards, or a fork of it with other
trainer settings on exactly the same samples (:mod:`asyncrl.tasks.pipeline.replay`), started
from the UI with a typed form. Task runs: `prepare-replay`, `replay-trainer`, `compare`,
`record` (the branch's MLflow run, linked to its parent; none cached: a replay is a check,
made anew); the comparison is the flow run's table artifact."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from asyncrl.tasks.pipeline.replay import (
    ReplayRequest, ReplaySetup, compare_replay, prepare_replay, record_replay, train_replay,
)  # fmt: skip


@task(name="prepare-replay", task_run_name="prepare-replay", cache_policy=NO_CACHE)
def prepare(request: ReplayRequest) -> ReplaySetup:
    return prepare_replay(request)


@task(name="replay-trainer", task_run_name="replay-trainer", cache_policy=NO_CACHE)
def train(setup: ReplaySetup) -> None:
    train_replay(setup)


@task(name="compare", task_run_name="compare", cache_policy=NO_CACHE)
def compare(setup: ReplaySetup, work_dir: str) -> dict[str, Any]:
    return compare_replay(setup, Path(work_dir) / "compare")


@task(name="record", task_run_name="record", cache_policy=NO_CACHE)
def record(setup: ReplaySetup, report: dict[str, Any]) -> str:
    return record_replay(setup, report)


@flow(name="replay", log_prints=True)
def replay(
    root: str, work_dir: str = "runs/replay", trainer_overrides: list[str] | None = None, from_step: int = 0, to: str | None = None
) -> dict[str, Any]:
    """Train the run at ``root`` again from its shards (``from_step``: from its checkpoint of
    that step) and compare every version; ``trainer_overrides`` (``trainer.KEY=VALUE``) make it a
    fork. The original run root is only read."""
    started = time.monotonic()
    overrides = list(trainer_overrides or [])
    setup = prepare(ReplayRequest(root, Path(work_dir), to=to, overrides=tuple(overrides), from_step=from_step))
    train(setup)
    report = {**compare(setup, work_dir), "wall_s": time.monotonic() - started}
    report["mlflow_run_id"] = record(setup, report)
    rows = [
        {"step": c["step"], "version": c["version"], "replay_version": c["replay_version"], "identical": c["identical"],
         "first_tensor": c["first_tensor"], "max_abs_diff": c["max_abs_diff"]}
        for c in report["comparisons"]
    ]  # fmt: skip
    kind = "fork" if overrides else "replay"
    create_table_artifact(rows, key="asyncrl-replay", description=f"{kind} of {report['original']} into {report['replay']}")
    first = report["first_difference"]
    get_run_logger().info(
        "%s: %d of %d versions identical%s", kind, report["versions_identical"], report["versions_compared"],
        "" if first is None else f"; the weights first differ after step {first['step']}",
    )  # fmt: skip
    return report
