"""The `train` flow users start, on a real vLLM server, DeepSpeed and the session's Prefect
test server: every component is its own Prefect run, a SIGKILLed trainer and rollout server
are restarted by the run itself (no chaos harness) and the run trains every step exactly
once; a component that crashes past its restart budget fails the run, naming it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from ports import restartable_base_port
from prefect_runs import result_error, run_tree
from process_scan import processes_with_env, wait_gone

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.synthetic import write_synthetic_splits
from asyncrl.chaos.audit import audit_run
from asyncrl.tasks.launch.components import sigkill_group
from asyncrl.tasks.launch.rl import PROCESS_GROUPS_FILE

pytestmark = pytest.mark.slow

MARKER = "ASYNCRL_RUN_TEST_MARKER"  # tests/conftest.py: process_marker


def train_config(tmp_path: Path, model_dir: Path, name: str, steps: int, max_restarts: int = 3) -> RunConfig:
    splits = write_synthetic_splits(tmp_path / "data", n_train=64, n_heldout=4, seed=0)
    return RunConfig.model_validate({
        "name": name,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(splits["train"]), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "shard_groups": 1, "shard_seconds": 1.0},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": 2, "max_steps": steps, "micro_batch_tokens": 256, "checkpoint_every": 1,
                    "optimizer": {"lr": 1.0e-4}},
        "reward": {"pool": {"workers": 1}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name},
        "run": {"max_restarts": max_restarts, "restart_backoff_s": 0.5},
    })  # fmt: skip


class Killer(threading.Thread):
    """SIGKILLs components of a running run by the process groups it records, each once the
    run has published a given weight version: (version, component name) in order."""

    def __init__(self, config: RunConfig, plan: list[tuple[int, str]]) -> None:
        super().__init__(daemon=True)
        self.work_dir = Path(config.work_dir) / config.name
        self.root = open_root(config.storage.root)
        self.plan = list(plan)
        self.killed: list[tuple[str, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 600
        while self.plan and not self.done.is_set() and time.monotonic() < deadline:
            version, name = self.plan[0]
            groups = self._groups()
            fresh = name in groups and groups[name] not in {pgid for _, pgid in self.killed}
            if (WeightStore(self.root).latest() or -1) >= version and fresh:
                sigkill_group(groups[name])
                self.killed.append((name, groups[name]))
                self.plan.pop(0)
            self.done.wait(0.3)

    def _groups(self) -> dict[str, int]:
        try:
            return dict(json.loads((self.work_dir / PROCESS_GROUPS_FILE).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}


def test_killed_trainer_and_rollout_server_are_restarted_and_the_run_completes(
    prefect_server: None, tiny_model_dir: Path, tmp_path: Path, process_marker: str
) -> None:
    from asyncrl.flows.train import train

    steps = 6
    config = train_config(tmp_path, tiny_model_dir, "heal", steps)
    killer = Killer(config, [(2, "trainer"), (4, "rollout-server-0")])
    killer.start()

    state = train(config, return_state=True)

    killer.done.set()
    assert state.is_completed(), state.message
    result = state.result()
    assert [name for name, _ in killer.killed] == ["trainer", "rollout-server-0"]
    assert result["steps"] == steps and result["restarts"]["trainer"] == 1
    assert result["restarts"]["rollout-server-0"] == 1 and result["restarts"]["scheduler"] == 0
    root = open_root(config.storage.root)
    assert [e.step for e in Ledger(root).entries()] == list(range(1, steps + 1))
    audit = audit_run(root, config.name, config.max_staleness, in_flight_ok=True)
    assert audit.ok, audit.violations
    assert audit.dropped_stale == 0

    tree = run_tree(state.state_details.flow_run_id)
    components = {"rollout-server-0", "reward-service", "trainer", "scheduler"}
    assert components <= set(tree), tree
    assert all(tree[name] == "Completed" for name in components), tree
    assert tree[f"flow:{config.name}-scheduler"] == "Completed", tree
    left = wait_gone(processes_with_env(MARKER, process_marker), timeout_s=30.0)
    assert not left, f"processes left behind: {[p.cmdline[:120] for p in left]}"


def test_a_component_crashing_past_its_budget_fails_the_run_naming_it(
    prefect_server: None, tiny_model_dir: Path, tmp_path: Path, process_marker: str
) -> None:
    from asyncrl.flows.train import train

    config = train_config(tmp_path, tiny_model_dir, "crash", steps=50, max_restarts=1)
    killer = Killer(config, [(1, "trainer"), (1, "trainer")])
    killer.start()

    state = train(config, return_state=True)

    killer.done.set()
    assert state.is_failed()
    assert len(killer.killed) == 2 and killer.killed[0][1] != killer.killed[1][1]  # the restarted trainer
    message = str(state.message) + repr(result_error(state))
    assert "trainer failed after 1 restart(s): exited with status -9" in message, message
    tree = run_tree(state.state_details.flow_run_id)
    assert tree["trainer"] == "Failed", tree
    assert tree["rollout-server-0"] == "Cancelled" and tree["reward-service"] == "Cancelled", tree
    assert tree["scheduler"] == "Cancelled" and tree[f"flow:{config.name}-scheduler"] == "Cancelled", tree
    left = wait_gone(processes_with_env(MARKER, process_marker), timeout_s=30.0)
    assert not left, f"processes left behind: {[p.cmdline[:120] for p in left]}"


def test_the_scheduler_flow_runs_on_its_own_against_a_run_root(
    prefect_server: None, tiny_model_dir: Path, tmp_path: Path, process_marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rollout server, reward service and trainer run elsewhere (here: supervised in threads,
    registered in the run root); the `scheduler` flow alone feeds them until the last step and
    writes every group it admitted."""
    from asyncrl.flows.scheduler import scheduler
    from asyncrl.tasks.reward.service_registry import TOKEN_ENV
    from asyncrl.tasks.launch.context import prepare_run
    from asyncrl.tasks.launch.rl import restart_policy, run_components
    from asyncrl.tasks.launch.supervisor import supervise

    steps = 3
    config = train_config(tmp_path, tiny_model_dir, "standalone", steps)
    monkeypatch.setenv(TOKEN_ENV, "the-reward-service-token")  # what the service elsewhere was given
    paths = prepare_run(config)
    stop = threading.Event()
    others = [c for kind, c in run_components(config, paths, drain=True) if kind != "scheduler"]
    threads = [threading.Thread(target=supervise, args=(c, stop, restart_policy(config)), daemon=True) for c in others]
    for thread in threads:
        thread.start()
    try:
        state = scheduler(config, return_state=True)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert state.is_completed(), state.message
    assert state.result()["end"] == "finished"
    root = open_root(config.storage.root)
    assert [e.step for e in Ledger(root).entries()] == list(range(1, steps + 1))
    audit = audit_run(root, config.name, config.max_staleness, in_flight_ok=False)
    assert audit.ok and audit.unwritten_groups == () and audit.groups_written == audit.admitted, audit.violations
    left = wait_gone(processes_with_env(MARKER, process_marker), timeout_s=30.0)
    assert not left, f"processes left behind: {[p.cmdline[:120] for p in left]}"
