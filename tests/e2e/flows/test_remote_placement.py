"""Components on other machines through Prefect work pools (issue #17's proof on one
machine): the session's Prefect server with two process workers standing for two nodes
(tests/e2e/flows/conftest.py: node-a takes the `train` flow and rollout servers, node-b the
trainer), SeaweedFS as the run's store, a `train` run placed with
``placement.rollout_server: component/rollout-server`` and ``placement.trainer:
component/trainer`` and a world-size-2 trainer; the scheduler and its reward service on the `scheduler` queue (node-a).

- The run completes every step with a clean audit; its rollout server ran as a flow run
  under node-a's worker, its trainer (two ranks) under node-b's; SIGKILL of the remote
  server's process group ends that flow run Failed and the `train` flow's supervisor starts
  the server again as a new flow run, which registers and serves the rest of the run;
  nothing of any flow run is left afterwards.
- Cancelling the `train` run cancels the remote components' flow runs and leaves no process
  on either worker.
- A `train` run with its components in its own flow run (no placement), cancelled through the
  API as the UI does, ends Cancelled and leaves no process: no vLLM server or engine, no
  trainer, no reward worker; its MLflow run ends KILLED.

The tests share the session's worker stack, so they live in one module: `make test`'s
pytest-xdist workers take a module at a time (``--dist loadfile``), and one stack serves them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import process_scan
import pytest
import s3_servers
from prefect_runs import read_state, start_train_run, train_config, wait_final_state, wait_until
from prefect_stack import WorkerStack

from asyncrl.storage.fs import open_root
from asyncrl.storage.heartbeats import read_heartbeat
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.server_registry import list_servers, read_server
from asyncrl.tasks.system.process_group import read_log_tail
from asyncrl.chaos.audit import audit_run

pytestmark = pytest.mark.slow

STEPS = 8
"""Enough that the run needs its restarted server: with eta 1 and B = 2 the groups admitted
before the kill carry the trainer at most a few steps further."""
RUN_TIMEOUT_S = 900.0
"""Flow start, two vLLM starts (30-250 s each here), two DeepSpeed ranks' start."""
UP_TIMEOUT_S = 600.0
CANCEL_TIMEOUT_S = 150.0
"""Cancelling the train run -> Cancelled, its remote flow runs cancelled in turn (the worker's
30 s SIGTERM grace, the SIGKILL, the state change)."""


def placed_config(tmp_path: Path, model_dir: Path, bucket: str, endpoint_url: str, name: str,
                  max_steps: int) -> dict[str, Any]:  # fmt: skip
    """The deployment tests' short run (:func:`train_config`) on SeaweedFS, with its rollout
    server, its trainer (2 processes) and its scheduler on the component deployments."""
    config = train_config(tmp_path, model_dir, name, max_steps)
    config["trainer"].update({"processes": 2, "zero_stage": 1, "checkpoint_every": 2})
    config["storage"] = {"root": f"s3://{bucket}/{name}", "options": {"endpoint_url": endpoint_url}}
    config["placement"] = {
        "rollout_server": {"deployment": "component/rollout-server"},
        "trainer": {"deployment": "component/trainer"},
        "scheduler": {"deployment": "component/scheduler-service"},
        "heartbeat_s": 2.0, "heartbeat_timeout_s": 60.0,
    }  # fmt: skip
    return config


def mlflow_run_statuses(config: dict[str, Any]) -> list[str]:
    """The status of each MLflow run of the run config's experiment."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=config["tracking"]["mlflow_uri"])
    experiment = client.get_experiment_by_name(config["tracking"]["experiment"])
    return [run.info.status for run in client.search_runs([experiment.experiment_id])]


def components_up(root_uri: str, run_dir: Path) -> bool:
    """The rollout server is healthy (registered) and the trainer has built its engine."""
    trainer_log = read_log_tail(run_dir / "logs" / "trainer.log", 200)
    return bool(list_servers(open_root(root_uri))) and '"event": "start"' in trainer_log


def component_runs(run_name: str) -> list[Any]:  # noqa: ANN401 - prefect FlowRuns
    """The `component` flow runs of run ``run_name``, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"asyncrl-run:{run_name}"])),
            sort=FlowRunSort.START_TIME_ASC,
        )
    return sorted(runs, key=lambda run: run.created)


def runs_of(run_name: str, kind: str) -> list[Any]:  # noqa: ANN401
    return [run for run in component_runs(run_name) if f"asyncrl-component:{kind}" in run.tags]


def leftovers(flow_run_ids: list[UUID]) -> list[process_scan.ProcessRecord]:
    return [p for run_id in flow_run_ids for p in process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(run_id))]


def under_worker(stack: WorkerStack, worker: str, processes: list[process_scan.ProcessRecord]) -> bool:
    return bool(processes) and all(stack.worker_pids[worker] in process_scan.ancestors(p.pid) for p in processes)


def test_run_with_remote_server_and_two_rank_trainer(
    worker_stack: WorkerStack, seaweedfs_endpoint: s3_servers.S3Endpoint, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bucket = s3_servers.create_bucket(seaweedfs_endpoint)
    config = placed_config(tmp_path, tiny_model_dir, bucket, seaweedfs_endpoint.url, "placed", STEPS)
    run_dir = Path(config["work_dir"]) / config["name"]
    root = open_root(config["storage"]["root"], config["storage"]["options"])
    diagnostics = lambda: worker_stack.diagnostics(run_dir)  # noqa: E731
    flow_run_id = start_train_run(config)

    def trained_one_step() -> bool:
        state = read_state(flow_run_id)
        assert state is None or not state.is_final(), f"{state.type}: {state.message}\n{diagnostics()}"
        return bool(list_servers(root)) and len(Ledger(root).entries()) >= 1

    wait_until(trained_one_step, UP_TIMEOUT_S, lambda: f"a registered server and one step\n{diagnostics()}")
    (server_run,) = runs_of("placed", "rollout-server")
    (trainer_run,) = runs_of("placed", "trainer")
    assert server_run.work_queue_name == "rollout-server" and trainer_run.work_queue_name == "trainer"
    server_processes = process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(server_run.id))
    trainer_processes = process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(trainer_run.id))
    assert under_worker(worker_stack, "node-a", server_processes), server_processes
    assert under_worker(worker_stack, "node-b", trainer_processes), trainer_processes
    trainer_commands = " | ".join(p.cmdline for p in trainer_processes)
    assert "torch.distributed.run" in trainer_commands and "--nproc-per-node=2" in trainer_commands
    assert sum("asyncrl.tasks.trainer.main" in p.cmdline for p in trainer_processes) >= 3  # torchrun's and 2 ranks
    assert read_heartbeat(root, "trainer", 0) is not None
    (scheduler_run,) = runs_of("placed", "scheduler")
    scheduler_processes = process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(scheduler_run.id))
    assert under_worker(worker_stack, "node-a", scheduler_processes), scheduler_processes
    scheduler_commands = " | ".join(p.cmdline for p in scheduler_processes)
    assert "asyncrl.tasks.scheduler.main" in scheduler_commands and "asyncrl.tasks.reward.server" in scheduler_commands

    # A crash of the remote server: its flow run fails, the supervisor starts a new one.
    killed = read_server(root, "server-0")
    os.killpg(os.getpgid(killed.pid), signal.SIGKILL)

    def restarted() -> bool:
        servers = runs_of("placed", "rollout-server")
        registered = [s for s in list_servers(root) if s.pid != killed.pid]
        return len(servers) == 2 and bool(registered)

    wait_until(restarted, UP_TIMEOUT_S, lambda: f"a second server flow run, registered\n{diagnostics()}")
    state = wait_final_state(flow_run_id, RUN_TIMEOUT_S, diagnostics)
    assert state.is_completed(), f"{state.type}: {state.message}\n{diagnostics()}"

    first, second = runs_of("placed", "rollout-server")
    assert read_state(first.id).is_failed(), read_state(first.id)
    assert "exited with status" in (read_state(first.id).message or "")
    assert read_state(second.id).is_completed(), read_state(second.id)  # asked to stop: the run finished
    assert read_state(trainer_run.id).is_completed(), read_state(trainer_run.id)
    assert read_state(scheduler_run.id).is_completed(), read_state(scheduler_run.id)
    assert [entry.step for entry in Ledger(root).entries()] == list(range(1, STEPS + 1))
    assert WeightStore(root).latest() == STEPS
    assert mlflow_run_statuses(config) == ["FINISHED"]
    report = audit_run(root, "placed", max_staleness=1, in_flight_ok=True)
    assert report.ok, report.violations
    remote = [run.id for run in component_runs("placed")]
    assert not process_scan.wait_gone(leftovers(remote + [flow_run_id]), 30.0)


def test_cancel_reaches_components_on_both_workers(
    worker_stack: WorkerStack, seaweedfs_endpoint: s3_servers.S3Endpoint, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    bucket = s3_servers.create_bucket(seaweedfs_endpoint)
    config = placed_config(tmp_path, tiny_model_dir, bucket, seaweedfs_endpoint.url, "placed-cancel", 1000)
    run_dir = Path(config["work_dir"]) / config["name"]
    root = open_root(config["storage"]["root"], config["storage"]["options"])
    diagnostics = lambda: worker_stack.diagnostics(run_dir)  # noqa: E731
    flow_run_id = start_train_run(config)

    def up() -> bool:
        state = read_state(flow_run_id)
        assert state is None or not state.is_final(), f"{state.type}: {state.message}\n{diagnostics()}"
        beat = read_heartbeat(root, "trainer", 0)
        return bool(list_servers(root)) and beat is not None and beat.ready

    wait_until(up, UP_TIMEOUT_S, lambda: f"server registered, trainer ready\n{diagnostics()}")
    remote = [run.id for run in component_runs("placed-cancel")]
    running = leftovers(remote)
    assert under_worker(worker_stack, "node-a", [p for p in running if "vllm" in p.cmdline.lower()])
    assert under_worker(worker_stack, "node-b", [p for p in running if "trainer.main" in p.cmdline])
    assert under_worker(worker_stack, "node-a", [p for p in running if "reward.worker" in p.cmdline])

    cancelled_at = time.monotonic()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling())
    state = wait_final_state(flow_run_id, CANCEL_TIMEOUT_S, diagnostics)
    took_s = time.monotonic() - cancelled_at
    assert state.is_cancelled(), f"{state.type}: {state.message}\n{diagnostics()}"
    wait_until(lambda: all(read_state(i).is_final() for i in remote), CANCEL_TIMEOUT_S,
               lambda: f"remote flow runs final: {[read_state(i) for i in remote]}")  # fmt: skip
    assert all(read_state(i).is_cancelled() for i in remote), [read_state(i) for i in remote]
    left = process_scan.wait_gone(running + leftovers(remote + [flow_run_id]), 30.0)
    assert not left, f"left after cancel ({took_s:.0f} s): {left}\n{diagnostics()}"
    assert list_servers(root) == []


def test_cancelled_train_run_leaves_no_process(worker_stack: WorkerStack, tiny_model_dir: Path, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    config = train_config(tmp_path, tiny_model_dir, "cancelled", max_steps=1000)
    run_dir = Path(config["work_dir"]) / config["name"]
    flow_run_id = start_train_run(config)

    def up() -> bool:
        state = read_state(flow_run_id)
        assert state is None or not state.is_final(), f"{state.type}: {state.message}\n{worker_stack.diagnostics(run_dir)}"
        return components_up(config["storage"]["root"], run_dir)

    wait_until(up, UP_TIMEOUT_S, lambda: f"rollout server healthy and trainer started\n{worker_stack.diagnostics(run_dir)}")
    running = process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(flow_run_id))
    commands = " | ".join(p.cmdline for p in running)
    for component in ("prefect.engine", "vllm.entrypoints.openai.api_server", "VLLM::EngineCore",
                      "asyncrl.tasks.trainer.main", "asyncrl.tasks.reward.server", "asyncrl.tasks.reward.worker",
                      "asyncrl.tasks.scheduler.main"):  # fmt: skip
        assert component in commands, f"no {component} among the run's processes: {running}"

    cancelled_at = time.monotonic()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling())
    state = wait_final_state(flow_run_id, CANCEL_TIMEOUT_S, lambda: worker_stack.diagnostics(run_dir))
    took_s = time.monotonic() - cancelled_at

    assert state.is_cancelled(), f"{state.type}: {state.message}\n{worker_stack.diagnostics(run_dir)}"
    left = process_scan.wait_gone(running, timeout_s=10.0)
    late = process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(flow_run_id))
    assert not left and not late, f"left after cancel ({took_s:.0f} s): {left + late}\n{worker_stack.diagnostics(run_dir)}"
    # The flow shut down by itself within the worker's grace period (a SIGKILLed flow
    # process ends nothing): its server left the registry, its MLflow run is KILLED.
    assert list_servers(open_root(config["storage"]["root"])) == []
    assert mlflow_run_statuses(config) == ["KILLED"]
