"""A component that runs as flow runs of a Prefect deployment on a work pool, behind the
same :class:`~asyncrl.tasks.launch.components.Component` interface as a local process group,
so the one supervisor (:func:`~asyncrl.tasks.launch.supervisor.supervise`) starts, watches,
restarts and stops it exactly as it does a local one.

``start()`` launches one flow run per replica (secrets left out of the parameters),
``poll()`` maps their states to an exit status (Completed 0, Failed or Crashed 1,
Cancelled 143, a stale heartbeat of this start 137), ``ready()`` reads the replicas'
heartbeats, and ``stop()`` asks a finished run's replicas to stop through the run root
before cancelling what is left. Flow run ids are recorded so that a cancelled or crashed
`train` flow's hook can cancel them. Details: ``docs/internals/flows.md``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.configs.loading import parameter_dict
from asyncrl.configs.placement import RemotePlacement
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.heartbeats import clear_stop_request, delete_heartbeat, read_heartbeat, request_stop
from asyncrl.tasks.inference.server_registry import server_name, unregister_server
from asyncrl.tasks.launch.kinds import ComponentKind, component_name
from asyncrl.tasks.launch.rl import RemoteFactory, RunStop
from asyncrl.tasks.system.run_paths import RunPaths

REMOTE_FLOW_RUNS_FILE = "remote-flow-runs.json"
EXIT_COMPLETED, EXIT_FAILED, EXIT_CANCELLED, EXIT_LOST = 0, 1, 143, 137


class RemoteFlowRunFile:
    """The live remote flow runs of a run (component name -> flow run ids), in
    ``remote-flow-runs.json`` of its work directory, for the cancel and crash hooks. One
    instance per run, shared by its remote components: its lock orders their updates."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def _update(self, change: Callable[[dict[str, list[str]]], None]) -> None:
        with self._lock:
            runs = read_remote_flow_runs(self.path.parent)
            change(runs)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({name: ids for name, ids in runs.items() if ids}))
            tmp.replace(self.path)

    def set(self, name: str, flow_run_ids: list[str]) -> None:
        self._update(lambda runs: runs.__setitem__(name, list(flow_run_ids)))

    def clear(self, name: str) -> None:
        self._update(lambda runs: runs.pop(name, None))


def read_remote_flow_runs(work_dir: Path) -> dict[str, list[str]]:
    """Component name -> flow run ids recorded in ``work_dir`` (empty if none)."""
    try:
        content = json.loads((work_dir / REMOTE_FLOW_RUNS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {str(k): [str(i) for i in v] for k, v in content.items() if isinstance(v, list)}


def component_parameters(
    config: RunConfig, kind: ComponentKind, index: int, replica: int, start_id: str, drain: bool
) -> dict[str, Any]:
    """Parameters of the `component` flow run of one replica (see :mod:`asyncrl.flows.component`)."""
    return {
        "config": parameter_dict(config),
        "kind": kind,
        "index": index,
        "replica": replica,
        "start_id": start_id,
        "drain": drain,
    }


def replica_job_variables(placement: RemotePlacement, run_name: str, kind: ComponentKind, replica: int) -> dict[str, Any]:
    """The placement's job variables plus labels naming the run, component and replica
    (``asyncrl/run``, ``asyncrl/component``, ``asyncrl/replica``): on Kubernetes they label the
    pod, so that a headless Service can select trainer node 0 as the rendezvous host
    (``infra/k8s/trainer-rendezvous.yaml``)."""
    variables = dict(placement.job_variables)
    labels = {"asyncrl/run": run_name, "asyncrl/component": kind, "asyncrl/replica": str(replica)}
    variables["labels"] = {**dict(variables.get("labels") or {}), **labels}
    return variables


def exit_code_of(state: Any) -> int | None:  # noqa: ANN401 - a prefect State
    """A flow run state as an exit status: None while not final (see the module docstring)."""
    if state is None or not state.is_final():
        return None
    if state.is_completed():
        return EXIT_COMPLETED
    if state.is_cancelled():
        return EXIT_CANCELLED
    return EXIT_FAILED


class RemoteComponent:
    """One component as ``replicas`` flow runs of ``placement.deployment`` (module docstring)."""

    def __init__(
        self,
        kind: ComponentKind,
        index: int,
        replicas: int,
        placement: RemotePlacement,
        config: RunConfig,
        root: RunRoot,
        runs_file: RemoteFlowRunFile,
        log_path: Path,
        drain: bool = False,
        run_cancelled: Callable[[], bool] = lambda: True,
        state_poll_s: float = 1.0,
        graceful_stop_s: float = 30.0,
        stop_timeout_s: float = 90.0,
    ) -> None:
        self.kind = kind
        self.index = index
        self.name = component_name(kind, index)
        self.replicas = replicas
        self.placement = placement
        self.config = config
        self.root = root
        self._log_path = log_path
        self.drain = drain
        self.run_cancelled = run_cancelled
        """Whether the run is being cancelled or failed (then stop() cancels at once)."""
        self.graceful_stop_s = graceful_stop_s
        self.heartbeat_timeout_s = config.placement.heartbeat_timeout_s
        self.state_poll_s = state_poll_s
        self.stop_timeout_s = stop_timeout_s
        self._runs_file = runs_file
        self.start_id = ""
        self.flow_run_ids: list[str] = []
        self._started_at = 0.0
        self._polled_at = 0.0
        self._code: int | None = None

    @property
    def log_path(self) -> Path:
        return self._log_path

    def _log(self, line: str) -> None:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "a") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def start(self) -> None:
        from prefect.deployments import run_deployment

        self.start_id, self._code, self.flow_run_ids = uuid.uuid4().hex, None, []
        self._started_at = time.time()
        for replica in range(self.replicas):
            suffix = f"-node-{replica}" if self.replicas > 1 else ""
            flow_run = run_deployment(
                self.placement.deployment,
                parameters=component_parameters(self.config, self.kind, self.index, replica, self.start_id, self.drain),
                job_variables=replica_job_variables(self.placement, self.config.name, self.kind, replica),
                timeout=0,
                flow_run_name=f"{self.config.name}-{self.name}{suffix}",
                tags=["asyncrl", f"asyncrl-run:{self.config.name}", f"asyncrl-component:{self.kind}"],
            )
            self.flow_run_ids.append(str(flow_run.id))
            self._runs_file.set(self.name, self.flow_run_ids)
            self._log(f"started flow run {flow_run.name} ({flow_run.id}) of {self.placement.deployment}, start {self.start_id}")

    def _states(self) -> list[Any]:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return [client.read_flow_run(uuid.UUID(i)).state for i in self.flow_run_ids]

    def poll(self) -> int | None:
        """Exit status of the replicas taken together (module docstring), None while they run."""
        if self._code is not None or not self.flow_run_ids:
            return self._code
        now = time.monotonic()
        if now - self._polled_at < self.state_poll_s:
            return None
        self._polled_at = now
        states = self._states()
        codes = [exit_code_of(state) for state in states]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, EXIT_COMPLETED)]
        if failed:
            replica, code = failed[0]
            state = states[replica]
            self._log(f"flow run {self.flow_run_ids[replica]} (replica {replica}) ended {state.name}: {state.message}")
            self._code = code
        elif all(c == EXIT_COMPLETED for c in codes):
            self._code = EXIT_COMPLETED
        else:
            lost = self._lost_replica(states)
            if lost is not None:
                self._log(lost)
                self._code = EXIT_LOST
        return self._code

    def _lost_replica(self, states: list[Any]) -> str | None:
        """Why a running replica counts as gone (no heartbeat of this start for longer than
        the timeout), or None."""
        for replica, state in enumerate(states):
            if state is None or not state.is_running():
                continue  # scheduled or pending: the supervisor's start timeout covers it
            beat = read_heartbeat(self.root, self.name, replica)
            if beat is not None and beat.start_id == self.start_id:
                age = beat.age_s()
            else:
                age = time.time() - max(self._started_at, state.timestamp.timestamp())
            if age > self.heartbeat_timeout_s:
                return (f"flow run {self.flow_run_ids[replica]} (replica {replica}) is Running but sent no heartbeat "
                        f"for {age:.0f} s (placement.heartbeat_timeout_s={self.heartbeat_timeout_s:g}): counted as lost")  # fmt: skip
        return None

    def ready(self) -> bool:
        """Every replica's heartbeat of this start says ready and is fresh."""
        if not self.flow_run_ids:
            return False
        for replica in range(self.replicas):
            beat = read_heartbeat(self.root, self.name, replica)
            if beat is None or beat.start_id != self.start_id or not beat.ready or beat.age_s() > self.heartbeat_timeout_s:
                return False
        return True

    def finished(self, code: int) -> bool:
        return code == EXIT_COMPLETED

    def pgid(self) -> int:
        return -1  # its processes run under the flow runs, on the workers' machines

    def stop(self) -> None:
        """Stop every replica that is not final (module docstring) and wait (bounded) until they are."""
        if not self.flow_run_ids:
            return
        if not self.run_cancelled() and self._code is None:
            for replica in range(self.replicas):
                request_stop(self.root, self.name, replica, self.start_id)
            deadline = time.monotonic() + self.graceful_stop_s
            while time.monotonic() < deadline and not all(exit_code_of(s) is not None for s in self._states()):
                time.sleep(1.0)
        cancel_flow_runs(self.flow_run_ids, self.stop_timeout_s, f"{self.config.name}: {self.name} stopped by its run")
        for replica in range(self.replicas):
            delete_heartbeat(self.root, self.name, replica)
            clear_stop_request(self.root, self.name, replica)
        if self.kind == "rollout-server":  # a flow run killed without its clean-up leaves its entry
            unregister_server(self.root, server_name(self.index))
        self._runs_file.clear(self.name)
        self.flow_run_ids = []


def cancel_flow_runs(flow_run_ids: list[str], timeout_s: float, message: str) -> list[str]:
    """Cancel the flow runs that are not final (a scheduled or pending one at once, a running
    one through Cancelling, which its worker turns into a SIGTERM of the flow process), wait
    up to ``timeout_s`` for them to be final. One that is still not final then (its worker or
    machine is gone) is set Cancelled by force; its id is returned."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    with get_client(sync_client=True) as client:
        pending = []
        for run_id in flow_run_ids:
            state = client.read_flow_run(uuid.UUID(run_id)).state
            if state is None or state.is_final():
                continue
            cancel = Cancelling(message=message) if state.is_running() else Cancelled(message=message)
            client.set_flow_run_state(uuid.UUID(run_id), cancel, force=True)
            pending.append(run_id)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            time.sleep(1.0)
            pending = [i for i in pending if not (client.read_flow_run(uuid.UUID(i)).state or Cancelled()).is_final()]
        for run_id in pending:
            client.set_flow_run_state(uuid.UUID(run_id), Cancelled(message=f"{message}; no answer within {timeout_s:.0f} s"),
                                      force=True)  # fmt: skip
    return pending


def remote_components(paths: RunPaths) -> RemoteFactory:
    """The run's factory of remote components (``RLRunSettings.remote``): each component
    ``kind`` (rollout server ``index``) as flow runs of its placement's deployment, one per
    trainer node for the trainer and one otherwise, their ids recorded in the run's one
    ``remote-flow-runs.json``."""
    runs_file = RemoteFlowRunFile(paths.work_dir / REMOTE_FLOW_RUNS_FILE)

    def make(
        config: RunConfig, paths: RunPaths, kind: ComponentKind, index: int, drain: bool, stop: RunStop | None
    ) -> RemoteComponent:
        placement = getattr(config.placement, kind.replace("-", "_"))
        replicas = config.trainer.nodes if kind == "trainer" else 1
        name = component_name(kind, index)
        return RemoteComponent(kind, index, replicas, placement, config, paths.root, runs_file,
                               paths.log(f"{name}.remote.log"), drain=drain,
                               run_cancelled=(lambda: stop is None or stop.cancelled))  # fmt: skip

    return make
