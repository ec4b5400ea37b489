"""Live progress for `asyncrl run`: one line per pipeline stage (data, model, SFT step and
loss, RL step and reward, evaluation prompts), read from the run's ``progress.json``
(:mod:`asyncrl.tasks.launch.progress`), which the stages write as they go."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.launch.progress import clear_progress, read_progress

MARKS = {"done": "[green]done", "cached": "[cyan]cached", "failed": "[red]failed", "running": ""}


@contextmanager
def live_progress(config: RunConfig, poll_s: float = 1.0) -> Iterator[None]:
    work_dir = config.run_work_dir
    clear_progress(work_dir)  # an earlier run's stages are not this run's
    stop = threading.Event()
    columns = (
        TextColumn("[bold]{task.description:<13}"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.fields[unit]}"),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
    )  # fmt: skip
    with Progress(*columns, transient=False) as progress:
        rows: dict[str, TaskID] = {}

        def refresh() -> None:
            for name, entry in read_progress(work_dir).items():
                fields: dict[str, Any] = {"unit": entry.unit, "detail": f"{MARKS.get(entry.state, '')} {entry.detail}".strip()}
                if name not in rows:
                    rows[name] = progress.add_task(name, total=entry.total, **fields)
                progress.update(rows[name], completed=entry.done, total=entry.total, **fields)

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
