"""The RL phase's result says what asynchrony bought: generation busy time (the scheduler
cycles of this phase), training busy time (this phase's steps), the phase's wall time and
the overlap factor, in TrainResult and in the run's MLflow run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.launch.rl import METRICS_FILE, _result
from asyncrl.tasks.scheduler.cycle_stats import CYCLE_STATS_FILE, append_cycle_stats
from asyncrl.tasks.system.run_paths import RunPaths, run_paths

READY_AT = 1_000.0
KEYS = {"generation_busy_s", "training_busy_s", "rl_wall_s", "overlap_factor"}


def run_config(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate({
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.parquet")},
        "storage": {"root": str(tmp_path / "store")},
        "trainer": {"max_steps": 3},
    })  # fmt: skip


def phase_files(paths: RunPaths) -> dict[int, dict[str, float]]:
    """An earlier phase's cycle and step (a resumed run), then this phase's two cycles and two steps."""
    paths.work_dir.mkdir(parents=True, exist_ok=True)
    for busy in (99.0, 30.0, 10.0):  # the first is the earlier phase's
        append_cycle_stats(paths.work_dir / CYCLE_STATS_FILE, {"elapsed_s": 50.0, "generation_busy_s": busy})
    steps = {
        1: {"time": 900.0, "step_time_s": 8.0},
        2: {"time": 1_020.0, "step_time_s": 12.0, "proximal_time_s": 2.0, "update_time_s": 6.0},
        3: {"time": 1_050.0, "step_time_s": 18.0},
    }
    with open(paths.work_dir / METRICS_FILE, "w", encoding="utf-8") as handle:
        for step, metrics in steps.items():
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
    return steps


def test_the_result_carries_the_phase_s_overlap_figures(tmp_path: Path) -> None:
    config = run_config(tmp_path)
    paths = run_paths(config)
    phase_files(paths)
    result = _result(config, paths, None, {}, time.monotonic(), READY_AT, cycles_before=1)
    assert set(result.overlap) == KEYS
    assert result.overlap["generation_busy_s"] == pytest.approx(40.0)  # this phase's cycles, summed
    assert result.overlap["training_busy_s"] == pytest.approx(30.0)  # steps 2 and 3
    assert result.overlap["rl_wall_s"] == pytest.approx(50.0)  # ready at 1000, last step at 1050
    assert result.overlap["overlap_factor"] == pytest.approx((40.0 + 30.0) / 50.0)
    assert result.scheduler["generation_busy_s"] == pytest.approx(139.0)  # the scheduler's figures: every cycle


def test_the_overlap_figures_go_to_the_run_s_mlflow_run(tmp_path: Path) -> None:
    config = run_config(tmp_path)
    paths = run_paths(config)
    steps = phase_files(paths)
    logged: list[tuple[int, dict[str, float]]] = []
    lineage = SimpleNamespace(run_id="run-1", log_metrics=lambda step, values: logged.append((step, dict(values))))
    recorder: Any = SimpleNamespace(lineage=lineage, logged_versions={3: "m-3"}, metrics_by_step=steps, evaluations={})
    result = _result(config, paths, recorder, {}, time.monotonic(), READY_AT, cycles_before=1)
    overlap = next(values for step, values in logged if "overlap_factor" in values)
    assert overlap == result.overlap and set(overlap) == KEYS
    assert any(step == 3 and "rollout_generation_busy_s" in values for step, values in logged)


def test_a_phase_that_never_began_reports_zeros_and_logs_none(tmp_path: Path) -> None:
    config = run_config(tmp_path)
    paths = run_paths(config)
    phase_files(paths)
    logged: list[dict[str, float]] = []
    lineage = SimpleNamespace(run_id="run-1", log_metrics=lambda step, values: logged.append(dict(values)))
    recorder: Any = SimpleNamespace(lineage=lineage, logged_versions={}, metrics_by_step={}, evaluations={})
    result = _result(config, paths, recorder, {}, time.monotonic(), 0.0)
    assert result.overlap == {"generation_busy_s": 0.0, "training_busy_s": 0.0, "rl_wall_s": 0.0, "overlap_factor": 0.0}
    assert not any("overlap_factor" in values for values in logged)
