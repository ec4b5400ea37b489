"""CPU pinning and priority of the supervised processes: the settings are checked and name
their field, and a started child (and what it spawns) really runs only on the given CPUs, at
the given lower priority.

The children here are trivial Python processes started through the real start paths
(`RolloutServer.start`, `start_trainer`) with their command swapped: what is tested is the
affinity set between fork and exec, not vLLM or DeepSpeed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import asyncrl.tasks.inference.server as server_module
import asyncrl.tasks.trainer.process as trainer_module
from asyncrl.configs.loading import ConfigError, config_from_dict
from asyncrl.tasks.system.process_group import child_setup_hook, kill_group, usable_cpus
from asyncrl.configs.cpus import check_cpu_cores, machine_cpus
from asyncrl.tasks.inference.server import RolloutServer
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.trainer.process import TrainerLaunch, start_trainer

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux affinity calls")

TARGET = max(usable_cpus())
"""The CPU children are pinned to: the last one this process may use (on a 2-CPU machine,
the other one is left out, so the pinning is visible)."""
NOT_A_CPU = max(machine_cpus()) + 1

# A child that starts a grandchild (as vLLM's api_server starts its engine core), prints
# both pids, and sleeps until killed.
SPAWNER = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('PIDS', g.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def grandchild_pid(log: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("PIDS "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(f"the child printed no pid; log: {log.read_text() if log.exists() else ''}")


def assert_pinned(*pids: int) -> None:
    import os

    for pid in pids:
        assert os.sched_getaffinity(pid) == {TARGET}, f"pid {pid}"


def test_check_cpu_cores() -> None:
    assert check_cpu_cores(None, "x") is None
    assert check_cpu_cores([TARGET, TARGET], "x") == (TARGET,)
    assert check_cpu_cores(sorted(machine_cpus(), reverse=True), "x") == tuple(sorted(machine_cpus()))
    for bad, reason in (([], "non-empty"), ([-1], "ints >= 0"), ([True], "ints >= 0"), (["0"], "ints >= 0"),
                        ([NOT_A_CPU], "does not exist on this machine"), ("0", "non-empty list")):
        with pytest.raises(ValueError, match=f"^a.field: .*{reason}"):
            check_cpu_cores(bad, "a.field")  # type: ignore[arg-type]


def run_config(inference: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"path": "m"}, "data": {"train_path": "d.parquet"}, "storage": {"root": "s"},
            "inference": inference, "trainer": trainer}


def test_run_config_fields() -> None:
    config = config_from_dict(run_config({"cpu_cores": [TARGET]}, {"cpu_cores": [TARGET]}))
    assert config.inference.cpu_cores == (TARGET,) and config.trainer.cpu_cores == (TARGET,)
    assert config_from_dict(run_config({}, {})).inference.cpu_cores is None  # default: no pinning
    with pytest.raises(ConfigError, match=f"inference.cpu_cores: CPU {NOT_A_CPU} does not exist on this machine"):
        config_from_dict(run_config({"cpu_cores": [0, NOT_A_CPU]}, {}))
    with pytest.raises(ConfigError, match="trainer.cpu_cores: CPU ids are ints >= 0"):
        config_from_dict(run_config({}, {"cpu_cores": [-2]}))
    with pytest.raises(ConfigError, match="trainer.cpu_cores.0: Input should be a valid integer"):
        config_from_dict(run_config({}, {"cpu_cores": ["first"]}))


def test_launch_settings_name_their_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RolloutServerConfig.cpu_cores: .*does not exist"):
        RolloutServerConfig(model_dir=tmp_path, cpu_cores=(NOT_A_CPU,))
    with pytest.raises(ValueError, match="TrainerLaunch.cpu_cores: .*non-empty"):
        TrainerLaunch(tmp_path / "c.yaml", tmp_path / "l.log", cpu_cores=())
    assert RolloutServerConfig(model_dir=tmp_path, cpu_cores=[TARGET]).cpu_cores == (TARGET,)  # type: ignore[arg-type]


def test_hook_pins_the_child_and_its_children(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    with open(log, "wb") as out:
        child = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=out, start_new_session=True,
                                 preexec_fn=child_setup_hook(None, (TARGET,)))  # noqa: PLW1509
    try:
        assert_pinned(child.pid, grandchild_pid(log))
    finally:
        kill_group(child, grace_s=1.0)
    assert child_setup_hook(None, None) is None  # nothing to do: no preexec_fn at all


def test_started_rollout_server_is_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(server_module, "server_command", lambda config, model_dir, port: [sys.executable, "-c", SPAWNER])
    server = RolloutServer(RolloutServerConfig(model_dir=model, log_path=tmp_path / "server.log", cpu_cores=(TARGET,)))
    handle = server.start()
    try:
        assert_pinned(handle.pid, grandchild_pid(tmp_path / "server.log"))
    finally:
        server.stop()


def test_rollout_server_session_runs_at_lower_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for bad in (-1, 20, True, 2.5):
        with pytest.raises(ValueError, match="RolloutServerConfig.session_nice must be an int in \\[0, 19\\]"):
            RolloutServerConfig(model_dir=model, session_nice=bad)  # type: ignore[arg-type]
    own = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setattr(server_module, "server_command", lambda config, model_dir, port: [sys.executable, "-c", SPAWNER])
    server = RolloutServer(RolloutServerConfig(model_dir=model, log_path=tmp_path / "server.log", session_nice=10))
    handle = server.start()
    try:
        pids = (handle.pid, grandchild_pid(tmp_path / "server.log"))
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [10, 10]
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # this process is untouched
        autogroup = Path(f"/proc/{handle.pid}/autogroup")
        if autogroup.exists():  # Linux autogroup: the server's session is one group, at nice 10
            assert autogroup.read_text().split()[-2:] == ["nice", "10"]
            assert Path("/proc/self/autogroup").read_text() != autogroup.read_text()
    finally:
        server.stop()


def test_started_trainer_is_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_module, "trainer_command", lambda launch: [sys.executable, "-c", SPAWNER])
    launch = TrainerLaunch(tmp_path / "c.yaml", tmp_path / "trainer.log", cpu_cores=(TARGET,))
    process = start_trainer(launch)
    try:
        assert_pinned(process.pid, grandchild_pid(tmp_path / "trainer.log"))
    finally:
        kill_group(process, 1.0)


def test_unpinned_child_keeps_the_parents_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(trainer_module, "trainer_command", lambda launch: [sys.executable, "-c", SPAWNER])
    launch = TrainerLaunch(tmp_path / "c.yaml", tmp_path / "trainer.log")
    process = start_trainer(launch)
    try:
        assert os.sched_getaffinity(process.pid) == os.sched_getaffinity(0)
    finally:
        kill_group(process, 1.0)
