"""Live progress for `asyncrl run`: one line per pipeline stage (data, model, SFT step and
loss, RL step and reward, evaluation prompts), read from the run's ``progress.json``
(:mod:`asyncrl.tasks.pipeline.progress`), which the stages write as they go.

On a terminal the lines are live bars. Elsewhere (CI, a log file, ``make demo | tee``) a bar
would print nothing until the end, so each stage prints a plain line when it starts, when its
state changes, and at least every ``line_every_s`` while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.pipeline.progress import StageState, clear_progress, read_progress

MARKS = {"done": "[green]done", "cached": "[cyan]cached", "failed": "[red]failed", "running": ""}
LINE_EVERY_S = 30.0
"""Longest silence of a running stage when the output is not a terminal."""


@contextmanager
def live_progress(
    config: RunConfig, poll_s: float = 1.0, line_every_s: float = LINE_EVERY_S, console: Console | None = None
) -> Iterator[None]:
    """Show the stages of ``config``'s run while the block runs: bars on a terminal, plain
    lines elsewhere (module docstring)."""
    work_dir = config.run_work_dir
    clear_progress(work_dir)  # an earlier run's stages are not this run's
    console = console or Console()
    if console.is_terminal:
        with _bars(work_dir, poll_s, console):
            yield
    else:
        say = partial(console.print, markup=False, highlight=False)  # a detail may hold brackets
        with _following(PlainLines(work_dir, line_every_s, say).refresh, poll_s):
            yield


class PlainLines:
    """The plain-line view: ``refresh`` prints, through ``say``, a line for each stage that is
    new, whose state changed, or that runs and has said nothing for ``line_every_s``."""

    def __init__(
        self, work_dir: Path, line_every_s: float, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.work_dir = work_dir
        self.clock = clock
        self.line_every_s = line_every_s
        self.say = say
        self._said: dict[str, tuple[str, float]] = {}  # stage -> (state, monotonic time of its last line)
        self._started: dict[str, float] = {}

    def refresh(self) -> None:
        now = self.clock()
        for name, entry in read_progress(self.work_dir).items():
            self._started.setdefault(name, now)
            last = self._said.get(name)
            if last is None or last[0] != entry.state or (entry.state == "running" and now - last[1] >= self.line_every_s):
                self.say(stage_line(entry, now - self._started[name]))
                self._said[name] = (entry.state, now)


def stage_line(entry: StageState, elapsed_s: float) -> str:
    """``sft  120/500 steps (24%)  loss 0.31  running  1m 05s``: a stage's state in one line."""
    minutes, seconds = divmod(int(elapsed_s), 60)
    detail = f"  {entry.detail}" if entry.detail else ""
    return (f"{entry.stage:<13} {entry.done}/{entry.total} {entry.unit} ({entry.percent:.0f}%){detail}  "
            f"{entry.state}  {minutes}m {seconds:02d}s")  # fmt: skip


@contextmanager
def _bars(work_dir: Path, poll_s: float, console: Console) -> Iterator[None]:
    columns = (
        TextColumn("[bold]{task.description:<13}"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.fields[unit]}"),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
    )  # fmt: skip
    with Progress(*columns, transient=False, console=console) as progress:
        rows: dict[str, TaskID] = {}

        def refresh() -> None:
            for name, entry in read_progress(work_dir).items():
                fields: dict[str, Any] = {"unit": entry.unit, "detail": f"{MARKS.get(entry.state, '')} {entry.detail}".strip()}
                if name not in rows:
                    rows[name] = progress.add_task(name, total=entry.total, **fields)
                progress.update(rows[name], completed=entry.done, total=entry.total, **fields)

        with _following(refresh, poll_s):
            yield


@contextmanager
def _following(refresh: Callable[[], None], poll_s: float) -> Iterator[None]:
    """Call ``refresh`` every ``poll_s`` from a thread while the block runs, and once after."""
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(poll_s):
            refresh()

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        refresh()
