"""The evaluator as an OS process: its module and command line. The run's launcher builds the
command from here, so it never imports the entry point (:mod:`asyncrl.tasks.evaluator.main`)."""

from __future__ import annotations

import sys
from pathlib import Path

MODULE = "asyncrl.tasks.evaluator.main"


def evaluator_command(process_config: Path, *, python: str = sys.executable) -> list[str]:
    """``python -m asyncrl.tasks.evaluator.main --config PROCESS_CONFIG``."""
    return [python, "-m", MODULE, "--config", str(process_config)]
