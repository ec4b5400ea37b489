"""Progress a person can follow: each pipeline stage reports what it has done to
``progress.json`` in the run's work directory, which `asyncrl run` shows live
(:mod:`asyncrl.cli.progress`) and the pipeline flow mirrors into a Prefect progress artifact
per stage (:func:`asyncrl.flows.prefect_api.artifacts.stage_progress_artifact`)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROGRESS_FILE = "progress.json"


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

    @property
    def percent(self) -> float:
        """done / total in percent, at most 100."""
        return min(100.0, 100.0 * self.done / max(self.total, 1))


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
    """One stage's progress, written to ``progress.json`` at each update."""

    def __init__(self, work_dir: Path, stage: str, total: int, unit: str) -> None:
        self.work_dir = work_dir
        self.stage = stage
        self.total = max(total, 1)
        self.unit = unit
        self.update(0, "starting")

    def update(self, done: int, detail: str = "", state: str = "running") -> None:
        self._write(StageState(self.stage, done, self.total, self.unit, detail, state, time.time()))

    def finish(self, detail: str = "", state: str = "done") -> None:
        self.update(self.total, detail, state)

    def _write(self, entry: StageState) -> None:
        stages = {name: asdict(value) for name, value in read_progress(self.work_dir).items()}
        stages[self.stage] = asdict(entry)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.work_dir / (PROGRESS_FILE + ".tmp")
        tmp.write_text(json.dumps(stages))
        tmp.replace(self.work_dir / PROGRESS_FILE)

