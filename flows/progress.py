"""A live progress bar for `asyncrl run`: follows the trainer's metrics file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from asyncrl.configs.run_config import RunConfig


def last_metrics(path: Path) -> dict[str, float] | None:
    """The newest complete JSON line of a metrics file, if any."""
    if not path.exists():
        return None
    for line in reversed(path.read_text(encoding="utf-8").splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


@contextmanager
def live_progress(config: RunConfig, poll_s: float = 1.0) -> Iterator[None]:
    metrics_file = Path(config.work_dir) / config.name / "trainer-metrics.jsonl"
    stop = threading.Event()
    columns = (
        TextColumn("[bold]RL steps"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("rl", total=config.trainer.max_steps, detail="starting")

        def follow() -> None:
            while not stop.wait(poll_s):
                record = last_metrics(metrics_file)
                if record and "step" in record:
                    detail = f"reward {record.get('reward_mean', float('nan')):.3f}"
                    progress.update(task, completed=int(record["step"]), detail=detail)

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
