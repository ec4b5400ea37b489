"""The reward service as an OS process: its module and command line. The run's launcher builds
the command from here, so it never imports the entry point (:mod:`asyncrl.tasks.reward.server`)."""

from __future__ import annotations

import sys
from pathlib import Path

MODULE = "asyncrl.tasks.reward.server"


def reward_service_command(process_config: Path, *, python: str = sys.executable) -> list[str]:
    """``python -m asyncrl.tasks.reward.server --config PROCESS_CONFIG`` (loopback, a free port)."""
    return [python, "-m", MODULE, "--config", str(process_config)]
