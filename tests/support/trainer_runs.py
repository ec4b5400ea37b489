"""Run a trainer process to its end the way the pipeline does: under the one supervisor,
without restarts."""

from __future__ import annotations

import threading

from asyncrl.tasks.launch.components import trainer_component
from asyncrl.tasks.launch.supervisor import RestartPolicy, supervise
from asyncrl.tasks.trainer.process import TrainerLaunch


def run_trainer(launch: TrainerLaunch, stop: threading.Event | None = None, poll_s: float = 0.1) -> int | None:
    """The trainer's exit status (0: it finished); a failure raises ComponentFailed with its log tail."""
    outcome = supervise(trainer_component(launch), stop or threading.Event(), RestartPolicy(max_restarts=0, poll_s=poll_s))
    return outcome.exit_code
