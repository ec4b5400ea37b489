"""The long-lived components of an RL run, each one process group of its own
(``start_new_session``) with a parent-death signal, behind one interface that the
supervisor (:mod:`asyncrl.tasks.launch.supervisor`) drives for the `train` flow, the
scheduler flow and `asyncrl chaos` alike: ``start()``, ``ready()``, ``poll()``,
``finished(code)`` and ``stop()`` (SIGTERM, then SIGKILL, of the whole group).

The components are the trainer, rollout server k, the reward service, the scheduler and
(with ``pipeline.eval_every``) the evaluator. Each resumes from the run root after a
restart (checkpoint and ledger, newest published weights, registration,
``scheduler/state.json``, ``evaluations/``), so the supervisor can kill and restart any of
them at any moment. How each starts and resumes: ``docs/internals/launch.md``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.evaluator.process import evaluator_command
from asyncrl.tasks.system.process_group import group_alive, kill_group, read_log_tail, spawn_session
from asyncrl.tasks.reward.service_registry import TOKEN_ENV, read_reward_service
from asyncrl.tasks.reward.process import reward_service_command
from asyncrl.tasks.inference.server_registry import register_server, server_name, unregister_server
from asyncrl.tasks.inference.server import RolloutServer, RolloutServerHandle
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
from asyncrl.tasks.inference.weight_sync import set_server_weight_version
from asyncrl.tasks.model.weight_fetch import VersionLease
from asyncrl.tasks.placement.launch_settings import server_config, serving_weights
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.tasks.scheduler.process import scheduler_command
from asyncrl.storage.weights import WeightStore, final_step_published
from asyncrl.tasks.trainer.process import TrainerLaunch, start_trainer

LOG_TAIL_LINES = 40
STOP_GRACE_S = 10.0


class Component(Protocol):
    """What the supervisor needs of a component (see the module docstring)."""

    name: str

    @property
    def log_path(self) -> Path: ...

    def start(self) -> None: ...

    def ready(self) -> bool: ...

    def poll(self) -> int | None: ...

    def finished(self, code: int) -> bool: ...

    def pgid(self) -> int: ...

    def stop(self) -> None: ...


def sigkill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (no clean-up: what a crash looks like). The
    supervisor notices the exit, reaps the leader and restarts the component."""
    if pgid <= 0:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ProcessComponent:
    """A component that is one process group started by ``spawn`` (the trainer, the
    scheduler, the reward service); ``is_ready`` and ``is_finished`` say what up and done mean."""

    def __init__(
        self,
        name: str,
        spawn: Callable[[], subprocess.Popen[bytes]],
        log_path: Path,
        is_finished: Callable[[int], bool],
        is_ready: Callable[[int], bool] | None = None,
    ) -> None:
        self.name = name
        self._spawn = spawn
        self._log_path = log_path
        self._is_finished = is_finished
        self._is_ready = is_ready
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self._log_path

    def start(self) -> None:
        self.process = self._spawn()

    def poll(self) -> int | None:
        """Exit status, or None while it runs (or before it starts)."""
        return None if self.process is None else self.process.poll()

    def ready(self) -> bool:
        running = self.process is not None and self.process.poll() is None
        return running and (self._is_ready is None or self._is_ready(self.pgid()))

    def finished(self, code: int) -> bool:
        return self._is_finished(code)

    def pgid(self) -> int:
        return -1 if self.process is None else self.process.pid

    def stop(self) -> None:
        if self.process is not None and (self.process.poll() is None or group_alive(self.process.pid)):
            kill_group(self.process, STOP_GRACE_S)
        elif self.process is not None:
            self.process.wait()


def trainer_component(launch: TrainerLaunch) -> ProcessComponent:
    return ProcessComponent("trainer", lambda: start_trainer(launch), launch.log_path, lambda code: code == 0)


def reward_token_env(token: str) -> dict[str, str]:
    """This process's environment with the run's reward-service token (the service demands
    it; the scheduler sends it)."""
    return {**os.environ, TOKEN_ENV: token}


def scheduler_component(config: RunConfig, paths: RunPaths, drain: bool, reward_token: str) -> ProcessComponent:
    """The scheduler process. With ``drain`` it finishes on its own once the last step is out
    (every admitted group written, :mod:`asyncrl.tasks.scheduler.main`); otherwise the run
    stops it when the trainer is done."""
    log_path = paths.log("scheduler.log")
    command = scheduler_command(paths.process_config("scheduler"), drain=drain)
    env = reward_token_env(reward_token)
    return ProcessComponent(
        "scheduler", lambda: spawn_session(command, log_path, env=env), log_path, ends_after_last_step(config, paths)
    )


def ends_after_last_step(config: RunConfig, paths: RunPaths) -> Callable[[int], bool]:
    """``finished(code)`` of a component whose normal end is exit 0 once the weights of the
    run's last step are published."""
    return lambda code: code == 0 and final_step_published(paths.root, config.trainer.max_steps)


def evaluator_component(config: RunConfig, paths: RunPaths) -> ProcessComponent:
    """The evaluator process (evaluation during training, :mod:`asyncrl.tasks.evaluator`): it
    finishes on its own once the last step is out and its last multiple of
    ``pipeline.eval_every`` is evaluated; until then the run may stop it."""
    log_path = paths.log("evaluator.log")
    command = evaluator_command(paths.process_config("evaluator"))
    return ProcessComponent(
        "evaluator", lambda: spawn_session(command, log_path), log_path, ends_after_last_step(config, paths)
    )


def reward_component(paths: RunPaths, reward_token: str) -> ProcessComponent:
    """The reward service process; ready once it has registered itself (its pid in the
    registration, so a stale entry of a killed predecessor does not count)."""
    log_path = paths.log("reward-service.log")
    command = reward_service_command(paths.process_config("reward"))
    root: RunRoot = paths.root

    def registered(pgid: int) -> bool:
        info = read_reward_service(root)
        return info is not None and info.pid == pgid

    env = reward_token_env(reward_token)
    return ProcessComponent(
        "reward-service", lambda: spawn_session(command, log_path, env=env), log_path, lambda code: False, registered
    )


class RolloutComponent:
    """One vLLM rollout server, registered in the run root as ``registry_name`` once healthy
    and labelled with its weight version. ``launch`` gives, at each start, the server's
    config, the version of the weights it serves (None: no label) and the lease on their cached
    directory (None: not cached), held until the server is up (its weights loaded), so a
    restarted server comes up on the newest published weights and no prune deletes them first.
    ``load_version`` (a LoRA run's servers, which start on the base model) loads the version
    into the server once it is up, in place of only labelling it."""

    def __init__(
        self,
        name: str,
        registry_name: str,
        root: RunRoot,
        launch: Callable[[], tuple[RolloutServerConfig, int | None, VersionLease | None]],
        log_path: Path,
        load_version: Callable[[RolloutServerHandle, int], object] | None = None,
    ) -> None:
        self._load_version = load_version
        self.name = name
        self.registry_name = registry_name
        self.root = root
        self._launch = launch
        self._log_path = log_path
        self.server: RolloutServer | None = None
        self.version: int | None = None
        """Weight version the server was started with (its label once healthy)."""
        self.registered = False
        self._lease: VersionLease | None = None

    @property
    def log_path(self) -> Path:
        return self._log_path

    def start(self) -> None:
        self._release_lease()
        server_config, self.version, self._lease = self._launch()
        self.server = RolloutServer(server_config)
        self.registered = False
        try:
            self.server.start()
        except BaseException:
            self._release_lease()
            raise

    def _release_lease(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def poll(self) -> int | None:
        return None if self.server is None else self.server.returncode()

    def ready(self) -> bool:
        """Registered; once up (healthy and serving this start's model name: a foreign
        process on the port raises :class:`~asyncrl.tasks.inference.server_errors.ForeignServerError`),
        labels the server with its version and registers it."""
        if self.registered or self.server is None or not self.server.is_ready():
            return self.registered
        self._release_lease()  # up: its weights are in memory
        if self.version is not None:
            if self._load_version is not None:
                self._load_version(self.server.handle, self.version)
            else:
                set_server_weight_version(self.server.handle, self.version)
        register_server(self.root, self.registry_name, self.server.handle)
        self.registered = True
        return True

    @property
    def handle(self) -> RolloutServerHandle:
        if self.server is None:
            raise RuntimeError(f"{self.name} is not started")
        return self.server.handle

    def finished(self, code: int) -> bool:
        return False  # a server runs until the run stops it

    def pgid(self) -> int:
        try:
            return -1 if self.server is None else self.server.handle.pgid
        except RuntimeError:  # its start failed before spawning
            return -1

    def stop(self) -> None:
        self._release_lease()
        if self.server is None:
            return
        try:
            if self.registered:  # first, so that no scheduler picks a dying server
                unregister_server(self.root, self.registry_name)
        finally:
            self.server.stop()
            self.registered = False


def run_rollout_component(index: int, config: RunConfig, paths: RunPaths) -> RolloutComponent:
    """Rollout server ``index`` of the run (``rollout-server-{index}``, registered as
    ``server-{index}``), started on the newest published weights (``model.path`` before any)."""

    def launch() -> tuple[RolloutServerConfig, int | None, VersionLease | None]:
        model_dir, version, lease = serving_weights(config, paths)
        try:
            return server_config(config, paths, model_dir, index), version, lease
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    return RolloutComponent(
        f"rollout-server-{index}", server_name(index), paths.root, launch, paths.log(f"rollout-{index}.log"),
        load_version=None if config.trainer.lora is None else adapter_loader(config, paths),
    )  # fmt: skip


def adapter_loader(config: RunConfig, paths: RunPaths) -> Callable[[RolloutServerHandle, int], object]:
    """How a LoRA run's rollout server, up on the base model, gets the version it serves: the
    published adapter loaded (:class:`ServerWeightLoader`, the scheduler's cache), or before
    anything is published the label only (the base model is version 0: its adapter has B = 0)."""

    def load(handle: RolloutServerHandle, version: int) -> object:
        if WeightStore(paths.root).latest() is None:
            return set_server_weight_version(handle, version)
        cache = str(paths.work_dir / "weights-cache")
        with ServerWeightLoader(config.storage.root, config.storage.options, cache, adapters=True) as loader:
            return loader.load(handle, version)

    return load


def log_tail(component: Component) -> str:
    return read_log_tail(component.log_path, LOG_TAIL_LINES)
