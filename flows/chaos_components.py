"""The three kinds of process `asyncrl chaos` runs, kills and restarts, each in a process
group of its own (``start_new_session``), started from the calling thread with a
parent-death signal so that none outlives the chaos run:

- the trainer (:func:`trainer_component`): ``python -m asyncrl.tasks.trainer.main``
  (resumes from its newest complete checkpoint on every start);
- :class:`RolloutComponent`: one vLLM server, started on the newest published weights,
  labelled with their version once healthy (before anything can generate on it) and then
  registered in the run root, where the scheduler finds it;
- the scheduler (:func:`scheduler_component`): ``python -m asyncrl.flows.scheduler_main``
  (resumes from ``scheduler/state.json``).

``kill()`` is the chaos: SIGKILL to the whole group, no clean-up (a killed server's
registry entry stays until its restart replaces it). ``stop()`` is the orderly end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.run_setup import RunPaths
from asyncrl.flows.scheduler_main import MODULE as SCHEDULER_MODULE
from asyncrl.flows.run_components import server_configs, serving_weights
from asyncrl.tasks.process_group import kill_group, read_log_tail, spawn_session
from asyncrl.tasks.rollout.registry import register_server, unregister_server
from asyncrl.tasks.rollout.server import RolloutServer
from asyncrl.tasks.rollout.weight_sync import set_server_weight_version
from asyncrl.tasks.trainer.process import TrainerLaunch, start_trainer

LOG_TAIL_LINES = 40
STOP_GRACE_S = 10.0


def sigkill_group(process: subprocess.Popen[bytes]) -> int:
    """SIGKILL every process of the group `process` leads, wait until none is left, and
    return the leader's status."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return kill_group(process, grace_s=0.0)  # only waits and reaps: the group is already dying


def start_scheduler(private_config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Spawn ``python -m asyncrl.flows.scheduler_main --config PRIVATE_CONFIG`` in a new
    session (its pid is the process group id), logging to ``log_path``."""
    return spawn_session([sys.executable, "-m", SCHEDULER_MODULE, "--config", str(private_config)], log_path)


class ProcessComponent:
    """A component that is one process group started by ``spawn`` (the trainer, the scheduler)."""

    def __init__(self, name: str, spawn: Callable[[], subprocess.Popen[bytes]], log_path: Path) -> None:
        self.name = name
        self.spawn = spawn
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = self.spawn()

    def poll(self) -> int | None:
        """Exit status, or None while it runs (or before it starts)."""
        return None if self.process is None else self.process.poll()

    def ready(self) -> bool:
        """Running: both resume from storage on their own."""
        return self.process is not None and self.process.poll() is None

    def pgid(self) -> int:
        return -1 if self.process is None else self.process.pid

    def kill(self) -> None:
        if self.process is not None:
            sigkill_group(self.process)

    def stop(self) -> None:
        if self.process is not None:
            kill_group(self.process, STOP_GRACE_S)


def trainer_component(launch: TrainerLaunch) -> ProcessComponent:
    return ProcessComponent("trainer", lambda: start_trainer(launch), launch.log_path)


def scheduler_component(private_config: Path, log_path: Path) -> ProcessComponent:
    return ProcessComponent("scheduler", lambda: start_scheduler(private_config, log_path), log_path)


class RolloutComponent:
    """Rollout server ``index`` of the run, registered as ``server-{index}``."""

    def __init__(self, index: int, config: RunConfig, paths: RunPaths) -> None:
        self.index = index
        self.name = f"rollout-{index}"
        self.registry_name = f"server-{index}"
        self.config = config
        self.paths = paths
        self.server: RolloutServer | None = None
        self.version = -1
        """Weight version the server was started with (its label once healthy)."""
        self.registered = False

    @property
    def log_path(self) -> Path:
        return self.paths.log(f"rollout-{self.index}.log")

    def start(self) -> None:
        """Spawn the server on the newest published weights (``model.path`` before any)."""
        model_dir, self.version = serving_weights(self.config, self.paths)
        server_config = server_configs(self.config, self.paths, model_dir)[self.index]
        self.server = RolloutServer(server_config)
        self.server.start()
        self.registered = False

    def poll(self) -> int | None:
        return None if self.server is None else self.server.returncode()

    def ready(self) -> bool:
        """Registered; once healthy, labels the server with its version and registers it."""
        if self.registered or self.server is None or not self.server.is_healthy():
            return self.registered
        set_server_weight_version(self.server.handle, self.version)
        register_server(self.paths.root, self.registry_name, self.server.handle)
        self.registered = True
        return True

    def pgid(self) -> int:
        return -1 if self.server is None else self.server.handle.pgid

    def kill(self) -> None:
        if self.server is not None and self.server.returncode() is None:
            try:
                os.killpg(self.server.handle.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.server is not None:
            self.server.stop()  # waits until the group is gone and reaps the leader
        self.registered = False

    def stop(self) -> None:
        if self.server is None:
            return
        try:
            unregister_server(self.paths.root, self.registry_name)
        finally:
            self.server.stop()
            self.registered = False


Component = ProcessComponent | RolloutComponent


def log_tail(component: Component) -> str:
    return read_log_tail(component.log_path, LOG_TAIL_LINES)
