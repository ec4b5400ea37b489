"""The scheduler as an OS process: its module and command line. The run's launcher builds the
command from here, so it never imports the entry point (:mod:`asyncrl.tasks.scheduler.main`)."""

from __future__ import annotations

import sys
from pathlib import Path

MODULE = "asyncrl.tasks.scheduler.main"


def scheduler_command(process_config: Path, *, drain: bool = True, python: str = sys.executable) -> list[str]:
    """``python -m asyncrl.tasks.scheduler.main --config PROCESS_CONFIG [--no-drain]``."""
    command = [python, "-m", MODULE, "--config", str(process_config)]
    if not drain:
        command.append("--no-drain")
    return command
