"""Where the output is not a terminal, `asyncrl run` prints each stage as plain lines: when it
starts, when its state changes, and at least every ``line_every_s`` while it runs."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from asyncrl.cli.progress import PlainLines, live_progress, stage_line
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.pipeline.progress import StageProgress, StageState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_running_stage_says_something_every_interval_and_each_change_at_once(tmp_path: Path) -> None:
    lines: list[str] = []
    clock = Clock()
    view = PlainLines(tmp_path, 30.0, lines.append, clock)
    sft = StageProgress(tmp_path, "sft", 500, "steps")
    view.refresh()
    assert len(lines) == 1 and lines[0].startswith("sft") and "0/500 steps (0%)" in lines[0]
    sft.update(100, "loss 0.31")
    clock.now = 29.0
    view.refresh()
    assert len(lines) == 1  # progress alone waits for the interval
    clock.now = 30.0
    view.refresh()
    assert len(lines) == 2 and "100/500 steps (20%)  loss 0.31  running  0m 30s" in lines[1]
    sft.finish("loss 0.05")
    clock.now = 31.0
    view.refresh()
    assert len(lines) == 3 and "500/500 steps (100%)  loss 0.05  done" in lines[2]
    clock.now = 200.0
    view.refresh()
    assert len(lines) == 3  # a finished stage is silent


def test_the_line_of_a_stage() -> None:
    entry = StageState("rl", 12, 30, "steps", "reward 0.41", "running", 0.0)
    assert stage_line(entry, 125.0) == "rl            12/30 steps (40%)  reward 0.41  running  2m 05s"


def test_live_progress_prints_plain_lines_when_not_on_a_terminal(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"name": "p", "work_dir": str(tmp_path), "model": {"path": "m"},
                                       "data": {"train_path": "t.parquet"}, "storage": {"root": str(tmp_path / "s")}})  # fmt: skip
    out = io.StringIO()
    with live_progress(config, poll_s=3600, console=Console(file=out, force_terminal=False)):
        StageProgress(config.run_work_dir, "prepare-data", 3, "files").finish("[3 files]")
    assert "prepare-data  3/3 files (100%)  [3 files]  done" in out.getvalue()
