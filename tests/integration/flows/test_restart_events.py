"""The events a run emits, read back from the session's Prefect test server and the run's
MLflow store: a component that dies and is restarted by the one supervisor gives an
``asyncrl.component.restarting`` event per restart (its name and restart count in it) and a
``restarts/<component>`` metric in the MLflow run; a component past its restart budget an
``asyncrl.component.failed`` event and the metric all the same; a step whose mismatch
figures cross their thresholds the canary's ``asyncrl.mismatch.canary`` event.

The `train` flow runs for real (its task runs, the scheduler child flow, the MLflow run,
the supervisor, the reporting hooks and the canary of the production code); only what its
components are is small: the placement factory that makes components on other machines
(``asyncrl.flows.train.remote_components``) is replaced by one making small Python programs
that stand for a rollout server, a trainer and a scheduler, with every component placed
"elsewhere" so that no vLLM server, trainer or reward service starts. The stand-in trainer
writes the step metrics a real trainer writes (``trainer-metrics.jsonl``), which the run's
lineage recorder logs to MLflow and the canary reads.
"""

from __future__ import annotations

import json
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from prefect_runs import read_events, result_error
from process_scan import processes_with_env, wait_gone

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.data.synthetic import write_synthetic_splits
from asyncrl.tasks.launch.canary import EVENT as CANARY_EVENT
from asyncrl.tasks.launch.components import ProcessComponent
from asyncrl.tasks.launch.kinds import ComponentKind, component_name
from asyncrl.tasks.launch.rl import RemoteFactory, RunStop
from asyncrl.tasks.system.process_group import spawn_session
from asyncrl.tasks.system.run_paths import RunPaths

MARKER = "ASYNCRL_RUN_TEST_MARKER"  # tests/conftest.py: process_marker
ELSEWHERE = {"deployment": "component/stand-in"}  # never run: the factory below makes the components

HEALTHY = {"mismatch/current_version_tokens": 500.0, "mismatch/abs_logp_diff_mean": 0.004,
           "mismatch/k3_kl": 2e-4, "mismatch/ratio_outside_frac": 0.001}  # fmt: skip
BROKEN = {"mismatch/current_version_tokens": 500.0, "mismatch/abs_logp_diff_mean": 0.4,
          "mismatch/k3_kl": 0.16, "mismatch/ratio_outside_frac": 0.004}  # fmt: skip
"""A server that holds other weights than it reports: abs_logp_diff_mean and k3_kl over the
default thresholds (0.1 and 0.02), ratio_outside_frac under its 0.05."""

# A server: up until the run stops it.
SERVER = "import time; time.sleep(600)"
# Exits 1 on its first ``crashes`` starts (each start leaves a file ``<name>-start-<n>``), then runs.
CRASHES_THEN_RUNS = """
import os, sys, time
d, name, crashes = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = len([f for f in os.listdir(d) if f.startswith(name + '-start-')]) + 1
open(os.path.join(d, f'{name}-start-{n}'), 'w').close()
if n <= crashes:
    print(f'{name}: start {n} crashes', flush=True)
    sys.exit(1)
time.sleep(600)
"""
# The trainer: exits 3 on its first ``crashes`` starts; then waits for the file ``wait_for``
# (another component's restart), writes its step metrics (JSON lines) and ends normally.
TRAINER = """
import json, os, sys, time
d, crashes, wait_for, metrics_file, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
n = len([f for f in os.listdir(d) if f.startswith('trainer-start-')]) + 1
open(os.path.join(d, f'trainer-start-{n}'), 'w').close()
if n <= crashes:
    print(f'trainer: start {n} crashes (CUDA out of memory)', flush=True)
    sys.exit(3)
deadline = time.monotonic() + 120
while wait_for and not os.path.exists(os.path.join(d, wait_for)) and time.monotonic() < deadline:
    time.sleep(0.05)
with open(metrics_file, 'a') as out:
    for record in json.loads(steps):
        out.write(json.dumps(record) + '\\n')
"""


def program(name: str, log: Path, code: str, *args: str, finishes: bool) -> ProcessComponent:
    return ProcessComponent(
        name, lambda: spawn_session([sys.executable, "-c", code, *args], log), log,
        (lambda code: code == 0) if finishes else (lambda code: False),
    )  # fmt: skip


def stand_ins(
    marks: Path, trainer_crashes: int, scheduler_crashes: int, steps: list[dict[str, float]]
) -> RemoteFactory:
    """Makes the run's components as small programs (see the module docstring): the rollout
    server never crashes; the scheduler crashes ``scheduler_crashes`` times; the trainer
    crashes ``trainer_crashes`` times, then, once the scheduler's last restart is up, writes
    ``steps`` (its metric lines) and ends normally."""
    marks.mkdir(parents=True, exist_ok=True)

    def make(
        config: RunConfig, paths: RunPaths, kind: ComponentKind, index: int, drain: bool, stop: RunStop | None
    ) -> ProcessComponent:
        name = component_name(kind, index)
        log = paths.log(f"{name}.log")
        if kind == "trainer":
            metrics_file = str(paths.work_dir / "trainer-metrics.jsonl")
            return program(name, log, TRAINER, str(marks), str(trainer_crashes), f"scheduler-start-{scheduler_crashes + 1}",
                           metrics_file, json.dumps(steps), finishes=True)  # fmt: skip
        if kind == "scheduler":
            return program(name, log, CRASHES_THEN_RUNS, str(marks), name, str(scheduler_crashes), finishes=False)
        return program(name, log, SERVER, finishes=False)

    return make


def run_config(tmp_path: Path, name: str, steps: int, max_restarts: int) -> RunConfig:
    splits = write_synthetic_splits(tmp_path / "data", n_train=8, n_heldout=2, seed=0)
    return RunConfig.model_validate({
        "name": name,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "no-model-needed")},
        "data": {"train_path": str(splits["train"])},
        "trainer": {"max_steps": steps},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name, "system_metrics": False},
        "run": {"max_restarts": max_restarts, "restart_backoff_s": 0.05},
        "placement": {"rollout_server": ELSEWHERE, "trainer": ELSEWHERE, "scheduler": ELSEWHERE},
    })  # fmt: skip


def scheduler_events(since: datetime) -> list[Any]:
    return read_events("asyncrl.component.restarting", "asyncrl.component.scheduler", since, 2)


def related_flow_runs(event: Any) -> set[str]:  # noqa: ANN401 - a prefect Event
    return {r.id for r in event.related if r.id.startswith("prefect.flow-run.")}


def metric_history(config: RunConfig, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(config.tracking.mlflow_uri).get_metric_history(run_id, key)]


def mlflow_run_id(config: RunConfig) -> str:
    from asyncrl.storage import fs
    from asyncrl.storage.fs import open_root
    from asyncrl.storage.paths import TRACKING_FILE

    recorded = fs.read_json_object(open_root(config.storage.root), TRACKING_FILE)
    assert recorded is not None, "the run recorded no MLflow run"
    return str(recorded["mlflow_run_id"])


def no_process_left(process_marker: str) -> None:
    left = wait_gone(processes_with_env(MARKER, process_marker), timeout_s=30.0)
    assert not left, f"processes left behind: {[p.cmdline[:120] for p in left]}"


@pytest.fixture
def since() -> datetime:
    return datetime.now(timezone.utc)


def test_restarts_reach_prefect_as_events_and_mlflow_as_metrics_and_the_canary_trips(
    prefect_server: None, tmp_path: Path, process_marker: str, since: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncrl.flows.train as train_module

    name = f"events-{uuid.uuid4().hex[:8]}"
    config = run_config(tmp_path, name, steps=2, max_restarts=3)
    steps = [{"step": 1, "reward_mean": 0.25, **HEALTHY}, {"step": 2, "reward_mean": 0.5, **BROKEN}]
    monkeypatch.setattr(train_module, "remote_components",
                        lambda paths: stand_ins(tmp_path / "marks", trainer_crashes=1, scheduler_crashes=2, steps=steps))

    state = train_module.train(config, return_state=True)

    assert state.is_completed(), state.message
    result = state.result()
    assert result["restarts"] == {"rollout-server-0": 0, "trainer": 1, "scheduler": 2}
    train_run = f"prefect.flow-run.{state.state_details.flow_run_id}"

    # Prefect: one `restarting` event per restart, the component in its resource, the count in its payload.
    trainer = read_events("asyncrl.component.restarting", "asyncrl.component.trainer", since, 1)
    assert [e.payload["restarts"] for e in trainer] == [1], trainer
    assert "restart 1 of 3 after: exited with status 3" in trainer[0].payload["detail"]
    assert train_run in related_flow_runs(trainer[0])  # emitted from the trainer's task run in this flow run
    # The run is named on every restart event: a label and the run's resource, role "run".
    for event in trainer + scheduler_events(since):
        assert event.resource.get("asyncrl.run") == name
        assert [r.id for r in event.related if r.role == "run"] == [f"asyncrl.run.{name}"]
    scheduler = read_events("asyncrl.component.restarting", "asyncrl.component.scheduler", since, 2)
    assert [e.payload["restarts"] for e in scheduler] == [1, 2], scheduler
    assert all("exited with status 1" in e.payload["detail"] for e in scheduler)
    assert related_flow_runs(scheduler[0]) - {train_run}, "emitted from the scheduler's child flow run"
    assert read_events("asyncrl.component.restarting", "asyncrl.component.rollout-server-0", since, 0) == []
    assert read_events("asyncrl.component.failed", "asyncrl.component.trainer", since, 0) == []

    # MLflow: restarts/<component> at the run's last step.
    run_id = mlflow_run_id(config)
    assert result["mlflow_run_id"] == run_id
    assert metric_history(config, run_id, "restarts/trainer") == [(2, 1.0)]
    assert metric_history(config, run_id, "restarts/scheduler") == [(2, 2.0)]
    assert metric_history(config, run_id, "restarts/rollout-server-0") == [(2, 0.0)]
    assert metric_history(config, run_id, "mismatch/k3_kl") == [(1, 2e-4), (2, 0.16)]  # what the canary read

    # The canary: one event, at the step whose figures crossed, on the run's resource.
    canary = read_events(CANARY_EVENT, f"asyncrl.run.{name}", since, 1)
    assert len(canary) == 1, canary
    assert canary[0].resource.get("prefect.resource.name") == name
    assert canary[0].payload == {
        "step": 2,
        "tokens": 500,
        "crossed": {"mismatch/abs_logp_diff_mean": {"value": 0.4, "threshold": 0.1},
                    "mismatch/k3_kl": {"value": 0.16, "threshold": 0.02}},
    }  # fmt: skip
    assert train_run in related_flow_runs(canary[0])
    no_process_left(process_marker)


def test_a_component_past_its_budget_emits_failed_and_its_restarts_still_reach_mlflow(
    prefect_server: None, tmp_path: Path, process_marker: str, since: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncrl.flows.train as train_module

    name = f"failing-{uuid.uuid4().hex[:8]}"
    config = run_config(tmp_path, name, steps=2, max_restarts=1)
    monkeypatch.setattr(train_module, "remote_components",
                        lambda paths: stand_ins(tmp_path / "marks", trainer_crashes=99, scheduler_crashes=0, steps=[]))

    state = train_module.train(config, return_state=True)

    assert state.is_failed()
    assert "trainer failed after 1 restart(s): exited with status 3" in str(result_error(state))
    restarting = read_events("asyncrl.component.restarting", "asyncrl.component.trainer", since, 1)
    assert [e.payload["restarts"] for e in restarting] == [1], restarting
    failed = read_events("asyncrl.component.failed", "asyncrl.component.trainer", since, 1)
    assert len(failed) == 1, failed
    assert failed[0].payload == {"detail": "exited with status 3", "restarts": 1}
    from mlflow.tracking import MlflowClient

    run_id = mlflow_run_id(config)
    assert MlflowClient(config.tracking.mlflow_uri).get_run(run_id).info.status == "FAILED"
    assert metric_history(config, run_id, "restarts/trainer") == [(2, 1.0)]
    assert metric_history(config, run_id, "restarts/scheduler") == [(2, 0.0)]
    no_process_left(process_marker)
