"""An elastic fleet on the real stack: the `train` flow runs with one rollout server; while it
trains, `asyncrl fleet add` (its own process, as a user runs it) starts a second one, which
joins and generates; `asyncrl fleet drain` takes it out again, and its flow run ends
Completed. The run completes every step with a clean audit (nothing lost, nothing trained
twice, nothing over the staleness bound), and MLflow and Prefect show the fleet's size
over time: 1, 2, 1."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ports import restartable_base_port
from prefect_runs import read_events

from asyncrl.chaos.audit import audit_run
from asyncrl.configs.loading import config_from_dict
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.synthetic import write_synthetic_splits
from asyncrl.tasks.inference.server_registry import list_servers

pytestmark = pytest.mark.slow

STEPS = 40
CLI = [sys.executable, "-m", "asyncrl.cli.main", "fleet"]


def fleet_config(tmp_path: Path, model_dir: Path) -> dict[str, Any]:
    splits = write_synthetic_splits(tmp_path / "data", n_train=64, n_heldout=4, seed=0)
    return {
        "name": "elastic",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(splits["train"]), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "shard_groups": 1, "shard_seconds": 1.0},
        "inference": {"base_port": restartable_base_port(count=2)},
        "trainer": {"batch_groups": 2, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": STEPS,
                    "optimizer": {"lr": 1.0e-4}},
        "reward": {"pool": {"workers": 1}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "elastic"},
    }  # fmt: skip


class FleetOperator(threading.Thread):
    """Once the run has published version 1: `fleet add` server 1; once it is registered and
    the run has published two more versions, reads how many tokens it generated, then `fleet
    drain`s it and waits for the `add` process to end."""

    def __init__(self, config_file: Path, root_uri: str, log_dir: Path) -> None:
        super().__init__(daemon=True)
        self.config_file = config_file
        self.root = open_root(root_uri)
        self.log_dir = log_dir
        self.generated_on_server_1 = 0.0
        self.add_code: int | None = None
        self.drain: subprocess.CompletedProcess[str] | None = None
        self.error: str | None = None

    def wait_for(self, what: str, holds: Any, timeout_s: float = 300.0) -> None:  # noqa: ANN401 - a predicate
        deadline = time.monotonic() + timeout_s
        while not holds():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
            time.sleep(0.5)

    def latest(self) -> int:
        return WeightStore(self.root).latest() or 0

    def run(self) -> None:
        try:
            self.wait_for("version 1", lambda: self.latest() >= 1)
            with open(self.log_dir / "fleet-add.log", "w") as log:
                adding = subprocess.Popen([*CLI, "add", str(self.config_file), "--index", "1"], stdout=log,
                                          stderr=subprocess.STDOUT, env=os.environ.copy())  # fmt: skip
            self.wait_for("server-1 registered", lambda: "server-1" in {r.name for r in list_servers(self.root)})
            joined_at = self.latest()
            self.wait_for("two more versions", lambda: self.latest() >= joined_at + 2)
            (url,) = [r.url for r in list_servers(self.root) if r.name == "server-1"]
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            self.generated_on_server_1 = sum(
                float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.split("{", 1)[0] == "vllm:generation_tokens_total"
            )  # fmt: skip
            self.drain = subprocess.run([*CLI, "drain", str(self.config_file), "--index", "1", "--timeout", "60"],
                                        capture_output=True, text=True, timeout=180, env=os.environ.copy())  # fmt: skip
            self.add_code = adding.wait(timeout=180)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = f"{type(exc).__name__}: {exc}"


def test_a_running_job_grows_to_two_servers_and_back_with_a_clean_audit(
    prefect_server: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from asyncrl.flows.train import train

    raw = fleet_config(tmp_path, tiny_model_dir)
    config_file = tmp_path / "elastic.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    config = config_from_dict(raw, source=str(config_file))
    operator = FleetOperator(config_file, config.storage.root, tmp_path)
    since = datetime.now(timezone.utc)
    operator.start()

    state = train(config, return_state=True)
    operator.join(timeout=300)

    assert operator.error is None, (operator.error, (tmp_path / "fleet-add.log").read_text()[-3000:])
    assert state.is_completed(), state.message
    result = state.result()
    assert result["steps"] == STEPS
    assert operator.drain is not None and operator.drain.returncode == 0, operator.drain
    assert "server-1" in operator.drain.stdout and "left run elastic" in operator.drain.stdout
    assert operator.add_code == 0, (tmp_path / "fleet-add.log").read_text()[-3000:]
    assert operator.generated_on_server_1 > 0  # the scheduler generated on the added server
    assert [r.name for r in list_servers(open_root(config.storage.root))] == []  # the run's own unregistered at its end

    audit = audit_run(open_root(config.storage.root), config.name, config.max_staleness, in_flight_ok=True)
    assert audit.ok, audit.violations
    assert audit.dropped_stale == 0

    mlflow = MlflowClient(config.tracking.mlflow_uri)
    history = mlflow.get_metric_history(result["mlflow_run_id"], "fleet/rollout_servers")
    assert [m.value for m in sorted(history, key=lambda m: m.timestamp)] == [1.0, 2.0, 1.0]
    events = read_events("asyncrl.fleet.changed", f"asyncrl.run.{config.name}", since, 3)
    assert [e.payload["rollout_servers"] for e in events] == [1, 2, 1]
    assert events[1].payload["joined"] == ["server-1"] and events[2].payload["left"] == ["server-1"]
