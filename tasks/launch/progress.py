"""Progress a person can follow: each pipeline stage reports what it has done to a Prefect
progress artifact (``<run>-<stage>-progress``) and to ``progress.json`` in the run's work
directory, which `asyncrl run` shows live (:mod:`asyncrl.cli.progress`)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROGRESS_FILE = "progress.json"
ARTIFACT_EVERY_S = 2.0


@dataclass(frozen=True)
class StageState:
    stage: str
    done: int
    total: int
    unit: str
    detail: str
    state: str
    """running, done, cached or failed."""
    updated: float


def read_progress(work_dir: Path) -> dict[str, StageState]:
    """The stages reported so far, in the order they started ({} before any)."""
    try:
        raw = json.loads((work_dir / PROGRESS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {name: StageState(**value) for name, value in raw.items()}


def clear_progress(work_dir: Path) -> None:
    """Forget the stages of an earlier run of the same work directory."""
    (work_dir / PROGRESS_FILE).unlink(missing_ok=True)


class StageProgress:
    """One stage's progress (see the module docstring); the Prefect artifact is made only
    inside a flow or task run and updated at most every ``ARTIFACT_EVERY_S`` seconds."""

    def __init__(self, work_dir: Path, run_name: str, stage: str, total: int, unit: str, artifact: bool = True) -> None:
        self.work_dir = work_dir
        self.stage = stage
        self.total = max(total, 1)
        self.unit = unit
        self._artifact = _progress_artifact(run_name, stage, total, unit) if artifact else None
        self._artifact_at = 0.0
        self.update(0, "starting")

    def update(self, done: int, detail: str = "", state: str = "running") -> None:
        self._write(StageState(self.stage, done, self.total, self.unit, detail, state, time.time()))
        now = time.monotonic()
        if self._artifact is not None and (state != "running" or now - self._artifact_at >= ARTIFACT_EVERY_S):
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self._artifact, progress=min(100.0, 100.0 * done / self.total))
            self._artifact_at = now

    def finish(self, detail: str = "", state: str = "done") -> None:
        self.update(self.total, detail, state)

    def _write(self, entry: StageState) -> None:
        stages = {name: asdict(value) for name, value in read_progress(self.work_dir).items()}
        stages[self.stage] = asdict(entry)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.work_dir / (PROGRESS_FILE + ".tmp")
        tmp.write_text(json.dumps(stages))
        tmp.replace(self.work_dir / PROGRESS_FILE)


def _progress_artifact(run_name: str, stage: str, total: int, unit: str) -> object | None:
    from prefect.artifacts import create_progress_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return None
    from asyncrl.flows.prefect_api.artifacts import artifact_key

    return create_progress_artifact(
        progress=0.0, key=artifact_key(run_name, f"{stage}-progress"),
        description=f"{stage} of run {run_name}: {total} {unit}",
    )  # fmt: skip
