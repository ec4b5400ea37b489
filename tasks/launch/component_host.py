"""The far side of a remote component: what the `component` flow run does on the machine
its work pool gave it (:mod:`asyncrl.flows.component`).

It builds the same local components the `train` flow would start on its own machine
(:func:`hosted_components`), starts them, writes the heartbeat of this start into the run
root every ``placement.heartbeat_s`` (ready once every hosted component is up), and runs
until the primary component ends normally (the trainer's or scheduler's exit 0 after the
last step; a rollout server never ends on its own) or one of them exits otherwise, which
raises :class:`HostedComponentExited` with its exit status and log tail, so that the flow
run ends Failed and the `train` flow's supervisor restarts the component with a new flow
run. It never restarts anything itself: one supervisor per component, on the `train` side.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.heartbeats import Heartbeat, write_heartbeat
from asyncrl.tasks.reward.service_registry import TOKEN_ENV
from asyncrl.tasks.launch.components import (
    Component,
    log_tail,
    reward_component,
    run_rollout_component,
    scheduler_component,
    trainer_component,
)
from asyncrl.tasks.placement.launch_settings import trainer_launch
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.tasks.launch.kinds import ComponentKind, component_name


class HostedComponentExited(RuntimeError):
    """A hosted component exited other than by its normal end; names it, its status, its log tail."""

    def __init__(self, component: str, code: int, tail: str) -> None:
        super().__init__(f"{component} exited with status {code}\n--- {component} log (last lines) ---\n{tail}")
        self.component = component
        self.code = code


def hosted_groups_file(kind: ComponentKind, index: int, replica: int) -> str:
    """The work-directory file in which one replica's flow run records its process groups
    (a :class:`~asyncrl.tasks.launch.rl.ProcessGroupFile`, read by its cancel and crash hooks)."""
    return f"process-groups-{component_name(kind, index)}-{replica}.json"


def hosted_components(config: RunConfig, paths: RunPaths, kind: ComponentKind, index: int, drain: bool) -> list[Component]:
    """The local components one remote flow run hosts, the primary one last: rollout server
    ``index``; the trainer (this node's ``torchrun`` with ``trainer.nodes`` > 1); or the
    reward service and the scheduler, which share a fresh token (``ASYNCRL_REWARD_TOKEN`` if
    set) and talk over loopback, so they always run together."""
    if kind == "rollout-server":
        return [run_rollout_component(index, config, paths)]
    if kind == "trainer":
        return [trainer_component(trainer_launch(config, paths))]
    if kind == "scheduler":
        token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        return [reward_component(paths, token), scheduler_component(config, paths, drain=drain, reward_token=token)]
    raise ValueError(f"no remote placement for component kind {kind!r}")


def run_hosted(
    components: Sequence[Component],
    stop: threading.Event,
    heartbeat: Callable[[bool], None],
    heartbeat_s: float,
    on_started: Callable[[Component], None] | None = None,
    stop_requested: Callable[[], bool] | None = None,
    poll_s: float = 0.5,
) -> int | None:
    """Start ``components`` and watch them until the last (primary) one finishes normally
    (its exit status is returned), ``stop`` is set or ``stop_requested()`` (asked at each
    heartbeat) is true (None). ``heartbeat(ready)`` is called at the start, every
    ``heartbeat_s`` seconds and whenever readiness changes. Any other exit raises
    :class:`HostedComponentExited`. Every component is stopped on the way out, whatever ends
    this call."""
    primary = components[-1]
    ready: set[str] = set()
    try:
        for component in components:
            component.start()
            if on_started is not None:
                on_started(component)
        heartbeat(False)
        last_beat, was_ready = time.monotonic(), False
        while not stop.wait(poll_s):
            for component in components:
                code = component.poll()
                if code is None:
                    if component.name not in ready and component.ready():
                        ready.add(component.name)
                    continue
                if component is primary and component.finished(code):
                    return code
                raise HostedComponentExited(component.name, code, log_tail(component))
            now_ready = len(ready) == len(components)
            if now_ready != was_ready or time.monotonic() - last_beat >= heartbeat_s:
                if stop_requested is not None and stop_requested():
                    return None
                heartbeat(now_ready)
                last_beat, was_ready = time.monotonic(), now_ready
        return None
    finally:
        for component in reversed(components):
            component.stop()


def heartbeat_writer(paths: RunPaths, kind: ComponentKind, index: int, replica: int, start_id: str,
                     flow_run_id: str) -> Callable[[bool], None]:
    """``heartbeat(ready)`` for :func:`run_hosted`: this replica's heartbeat in the run root."""
    name = component_name(kind, index)
    host, pid = socket.gethostname(), os.getpid()

    def beat(ready: bool) -> None:
        write_heartbeat(paths.root, Heartbeat(name, replica, start_id, flow_run_id, host, pid, ready))

    return beat
