"""A remote component against a real Prefect server (the session's test server), with no
worker serving its deployment, so the test sets the flow runs' states itself as a worker,
a crash or a vanished machine would:

- start: one Scheduled flow run per replica, recorded for the cancel hooks, parameters
  without secrets (a valid config where they arrive);
- poll: Running is None; Failed is 1 with its message in the component's log; a Running
  replica without a heartbeat past the timeout is lost (137); Completed on every replica is 0;
- ready: only a fresh heartbeat of this start that says ready;
- stop: cancels what is not final; a replica nobody answers for is set Cancelled by force.

And the far side, :func:`run_hosted`, on real process groups.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.heartbeats import Heartbeat, read_heartbeat, stop_requested, write_heartbeat
from asyncrl.tasks.system.process_group import spawn_session
from asyncrl.tasks.launch.component_host import HostedComponentExited, run_hosted
from asyncrl.tasks.launch.components import ProcessComponent
from asyncrl.flows.prefect_api.remote_component import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_LOST,
    REMOTE_FLOW_RUNS_FILE,
    RemoteComponent,
    RemoteFlowRunFile,
    component_parameters,
    read_remote_flow_runs,
)

DEPLOYMENT = "component/remote-test"


def config_for(tmp_path: Path, **placement: object) -> RunConfig:
    return RunConfig.model_validate({
        "name": "remote", "work_dir": str(tmp_path / "work"), "model": {"path": "m"}, "data": {"train_path": "t"},
        "storage": {"root": str(tmp_path / "store")},
        "inference": {"api_key": "rollout-secret"},
        "tracking": {"mlflow_uri": "postgresql://user:db-secret@db/mlflow"},
        "trainer": {"nodes": 2, "rendezvous": "trainer-0:29400"},
        "placement": {"trainer": {"deployment": DEPLOYMENT, "job_variables": {"memory": "8Gi"}},
                      "heartbeat_s": 0.5, "heartbeat_timeout_s": 2.0, **placement},
    })  # fmt: skip


@pytest.fixture(scope="module")
def deployment(prefect_server: None) -> str:
    """A deployment of the `component` flow on a pool no worker serves."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from asyncrl.flows.component import component

    async def create() -> None:
        async with get_client() as client:
            await client.create_work_pool(WorkPoolCreate(name="remote-test-pool", type="process"), overwrite=True)
            flow_id = await client.create_flow(component)
            await client.create_deployment(flow_id=flow_id, name="remote-test", work_pool_name="remote-test-pool",
                                           entrypoint="flows/component.py:component")  # fmt: skip

    asyncio.run(create())
    return DEPLOYMENT


def remote_trainer(config: RunConfig, tmp_path: Path, run_finished: bool = False, graceful_stop_s: float = 3.0
                   ) -> RemoteComponent:  # fmt: skip
    work_dir = tmp_path / "work" / "remote"
    work_dir.mkdir(parents=True, exist_ok=True)
    return RemoteComponent("trainer", 0, config.trainer.nodes, config.placement.trainer, config,  # type: ignore[arg-type]
                           open_root(config.storage.root), RemoteFlowRunFile(work_dir / REMOTE_FLOW_RUNS_FILE),
                           work_dir / "logs" / "trainer.remote.log",
                           run_cancelled=lambda: not run_finished, state_poll_s=0.0, graceful_stop_s=graceful_stop_s,
                           stop_timeout_s=2.0)  # fmt: skip


def set_state(flow_run_id: str, state: object) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(flow_run_id), state, force=True)  # type: ignore[arg-type]


def read(flow_run_id: str):  # noqa: ANN201 - a FlowRun
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id))


def test_a_shared_run_file_keeps_every_component_s_runs(tmp_path: Path) -> None:
    """The remote components of a run update one file from their supervisors' threads."""
    runs = RemoteFlowRunFile(tmp_path / REMOTE_FLOW_RUNS_FILE)
    names = [f"rollout-server-{i}" for i in range(16)]
    threads = [threading.Thread(target=runs.set, args=(name, [f"id-{name}"])) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert read_remote_flow_runs(tmp_path) == {name: [f"id-{name}"] for name in names}
    runs.clear("rollout-server-3")
    assert "rollout-server-3" not in read_remote_flow_runs(tmp_path)


def test_parameters_carry_no_secret_and_validate(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    parameters = component_parameters(config, "trainer", 0, 1, "start-1", drain=False)
    text = repr(parameters)
    assert "rollout-secret" not in text and "db-secret" not in text
    received = RunConfig.model_validate(parameters["config"])
    assert received.inference.api_key is None and received.tracking.mlflow_uri == "postgresql://user@db/mlflow"
    assert (parameters["kind"], parameters["replica"], parameters["start_id"]) == ("trainer", 1, "start-1")


def test_start_poll_ready_stop(deployment: str, tmp_path: Path) -> None:
    from prefect.states import Completed, Failed, Running

    config = config_for(tmp_path)
    trainer = remote_trainer(config, tmp_path)
    trainer.start()
    ids = list(trainer.flow_run_ids)
    assert len(ids) == 2  # one flow run per trainer node
    runs = [read(i) for i in ids]
    assert all(run.state.is_scheduled() for run in runs)
    assert [run.parameters["replica"] for run in runs] == [0, 1]
    assert runs[1].job_variables == {"memory": "8Gi", "labels": {"asyncrl/run": "remote", "asyncrl/component": "trainer",
                                                                 "asyncrl/replica": "1"}}  # fmt: skip
    assert "asyncrl-run:remote" in runs[0].tags
    assert read_remote_flow_runs(tmp_path / "work" / "remote") == {"trainer": ids}
    assert trainer.poll() is None and not trainer.ready()

    root = open_root(config.storage.root)
    for replica, run_id in enumerate(ids):
        set_state(run_id, Running())
        write_heartbeat(root, Heartbeat("trainer", replica, trainer.start_id, run_id, "host", 1, ready=True))
    assert trainer.poll() is None and trainer.ready()
    write_heartbeat(root, Heartbeat("trainer", 1, "an-older-start", ids[1], "host", 1, ready=True))
    assert not trainer.ready()  # a predecessor's heartbeat never counts

    set_state(ids[0], Completed())
    set_state(ids[1], Failed(message="trainer exited with status 1"))
    assert trainer.poll() == EXIT_FAILED and not trainer.finished(EXIT_FAILED)
    assert "Failed: trainer exited with status 1" in trainer.log_path.read_text()
    trainer.stop()
    assert read_remote_flow_runs(tmp_path / "work" / "remote") == {}
    assert read_heartbeat(root, "trainer", 0) is None

    trainer.start()
    for run_id in trainer.flow_run_ids:
        set_state(run_id, Completed())
    assert trainer.poll() == EXIT_COMPLETED and trainer.finished(EXIT_COMPLETED)


def test_running_replica_without_heartbeat_is_lost_and_forced_cancelled(deployment: str, tmp_path: Path) -> None:
    from prefect.states import Running

    config = config_for(tmp_path)
    trainer = remote_trainer(config, tmp_path)
    trainer.start()
    ids = list(trainer.flow_run_ids)
    root = open_root(config.storage.root)
    for replica, run_id in enumerate(ids):
        set_state(run_id, Running())
        write_heartbeat(root, Heartbeat("trainer", replica, trainer.start_id, run_id, "host", 1, ready=True))
    assert trainer.poll() is None
    time.sleep(config.placement.heartbeat_timeout_s + 0.5)  # the machines went quiet
    assert trainer.poll() == EXIT_LOST
    assert "sent no heartbeat" in trainer.log_path.read_text()
    started = time.monotonic()
    trainer.stop()  # Cancelling; no worker answers: Cancelled by force after stop_timeout_s
    assert time.monotonic() - started < 15.0
    assert all(read(i).state.is_cancelled() for i in ids), [read(i).state for i in ids]


def test_a_finished_run_asks_its_replicas_to_stop_and_they_complete(deployment: str, tmp_path: Path) -> None:
    """The hosted side is played by a thread that answers the stop request as the `component`
    flow does (:func:`stop_requested` at its heartbeat, then Completed)."""
    from prefect.states import Completed, Running

    config = config_for(tmp_path)
    trainer = remote_trainer(config, tmp_path, run_finished=True, graceful_stop_s=30.0)  # ends when answered
    trainer.start()
    ids, start_id = list(trainer.flow_run_ids), trainer.start_id
    root = open_root(config.storage.root)
    for run_id in ids:
        set_state(run_id, Running())

    def hosted_side() -> None:
        answered: set[int] = set()
        deadline = time.monotonic() + 30.0
        while len(answered) < len(ids) and time.monotonic() < deadline:
            for replica, run_id in enumerate(ids):
                if replica not in answered and stop_requested(root, "trainer", replica, start_id):
                    set_state(run_id, Completed(message="stopped: its run finished"))
                    answered.add(replica)
            time.sleep(0.1)

    answering = threading.Thread(target=hosted_side)
    answering.start()
    trainer.stop()
    answering.join()
    assert all(read(i).state.is_completed() for i in ids), [read(i).state for i in ids]
    assert not stop_requested(root, "trainer", 0, start_id)  # cleared


def test_a_finished_run_cancels_replicas_that_do_not_answer(deployment: str, tmp_path: Path) -> None:
    from prefect.states import Running

    trainer = remote_trainer(config_for(tmp_path), tmp_path, run_finished=True)
    trainer.start()
    for run_id in trainer.flow_run_ids:
        set_state(run_id, Running())
    ids = list(trainer.flow_run_ids)
    started = time.monotonic()
    trainer.stop()
    assert time.monotonic() - started >= trainer.graceful_stop_s
    assert all(read(i).state.is_cancelled() for i in ids)


def test_stop_cancels_scheduled_runs_at_once(deployment: str, tmp_path: Path) -> None:
    trainer = remote_trainer(config_for(tmp_path), tmp_path)
    trainer.start()
    ids = list(trainer.flow_run_ids)
    trainer.stop()
    assert all(read(i).state.is_cancelled() for i in ids)


def sleeper(name: str, tmp_path: Path, seconds: float, code: int, finished_code: int | None = None) -> ProcessComponent:
    log = tmp_path / f"{name}.log"
    command = [sys.executable, "-c", f"import time, sys; print('{name} up', flush=True); time.sleep({seconds}); sys.exit({code})"]
    return ProcessComponent(name, lambda: spawn_session(command, log), log, lambda c: c == finished_code)


def test_run_hosted_returns_when_the_primary_finishes(tmp_path: Path) -> None:
    beats: list[bool] = []
    helper = sleeper("helper", tmp_path, 60, 0)
    primary = sleeper("primary", tmp_path, 1.5, 0, finished_code=0)
    code = run_hosted([helper, primary], threading.Event(), beats.append, heartbeat_s=0.2, poll_s=0.1)
    assert code == 0
    assert beats[0] is False and True in beats and len(beats) >= 3
    assert helper.poll() is not None  # stopped on the way out


def test_run_hosted_raises_on_another_exit_and_stops_everything(tmp_path: Path) -> None:
    helper = sleeper("helper", tmp_path, 0.5, 3)
    primary = sleeper("primary", tmp_path, 60, 0, finished_code=0)
    with pytest.raises(HostedComponentExited, match="helper exited with status 3") as raised:
        run_hosted([helper, primary], threading.Event(), lambda ready: None, heartbeat_s=1.0, poll_s=0.1)
    assert "helper up" in str(raised.value)
    assert primary.poll() is not None


def test_run_hosted_stops_when_its_run_asks(tmp_path: Path) -> None:
    primary = sleeper("primary", tmp_path, 60, 0, finished_code=0)
    asked_at = time.monotonic() + 1.0
    code = run_hosted([primary], threading.Event(), lambda ready: None, heartbeat_s=0.2,
                      stop_requested=lambda: time.monotonic() > asked_at, poll_s=0.1)  # fmt: skip
    assert code is None and primary.poll() is not None


def test_run_hosted_stops_on_request(tmp_path: Path) -> None:
    primary = sleeper("primary", tmp_path, 60, 0, finished_code=0)
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    assert run_hosted([primary], stop, lambda ready: None, heartbeat_s=1.0, poll_s=0.1) is None
    assert primary.poll() is not None
