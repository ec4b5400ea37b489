"""The deployments of prefect.yaml through a real Prefect server and process worker, the
way users run them: `prefect work-pool create`, `prefect deploy --all` from the repository
root, `prefect worker start`. The session's stack (tests/e2e/flows/conftest.py) serves them.

- a `train` run (tiny model, synthetic task, 2 steps) completes and publishes its weights;
- a `train` run cancelled through the API (as the UI does) ends CANCELLED and leaves no
  process behind: no vLLM server or engine, no trainer, no reward worker.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import process_scan
import pytest
from prefect_runs import read_state, start_train_run, train_config, wait_final_state, wait_until
from prefect_stack import WorkerStack

from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.system.process_group import read_log_tail
from asyncrl.tasks.inference.server_registry import list_servers

pytestmark = pytest.mark.slow

STEPS = 2
RUN_TIMEOUT_S = 600.0
"""A whole 2-step run: flow start, vLLM start (30-250 s here), DeepSpeed's first op build (~70 s)."""
CANCEL_TIMEOUT_S = 90.0
"""Cancelling -> Cancelled: the worker's 30 s SIGTERM grace, the SIGKILL, the state change."""


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


def test_train_deployment_runs_to_completion(worker_stack: WorkerStack, tiny_model_dir: Path, tmp_path: Path) -> None:
    config = train_config(tmp_path, tiny_model_dir, "deployed", STEPS)
    run_dir = Path(config["work_dir"]) / config["name"]

    flow_run_id = start_train_run(config)
    state = wait_final_state(flow_run_id, RUN_TIMEOUT_S, lambda: worker_stack.diagnostics(run_dir))

    assert state.is_completed(), f"{state.type}: {state.message}\n{worker_stack.diagnostics(run_dir)}"
    root = open_root(config["storage"]["root"])
    assert WeightStore(root).latest() == STEPS
    assert [entry.step for entry in Ledger(root).entries()] == list(range(1, STEPS + 1))
    assert mlflow_run_statuses(config) == ["FINISHED"]
    left = process_scan.wait_gone(process_scan.processes_with_env("PREFECT__FLOW_RUN_ID", str(flow_run_id)), 30.0)
    assert not left, f"processes of the completed run still running: {left}"


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

    wait_until(up, RUN_TIMEOUT_S, lambda: f"rollout server healthy and trainer started\n{worker_stack.diagnostics(run_dir)}")
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
