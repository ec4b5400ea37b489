"""The RL trainer's CPU threads: the trainer's CPUs shared out among the processes that
compute on them at once (its own trainer.processes and the rollout servers on them),
threads = max(1, floor(C / (P + S))), unless trainer.threads says otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.placement.launch_settings import rl_trainer_launch, rl_trainer_threads
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.placement.devices import Machine
from asyncrl.tasks.trainer.process import trainer_env

CPUS = os.cpu_count() or 1


def config(
    tmp_path: Path,
    trainer: dict[str, Any] | None = None,
    inference: dict[str, Any] | None = None,
    placement: dict[str, Any] | None = None,
) -> RunConfig:
    return RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tmp_path / "model")},
            "data": {"train_path": str(tmp_path / "train.parquet")},
            "inference": inference or {},
            "trainer": trainer or {},
            "storage": {"root": str(tmp_path / "store")},
            "placement": placement or {},
        }
    )


def test_unpinned_trainer_and_servers_share_the_machine(tmp_path: Path) -> None:
    assert rl_trainer_threads(config(tmp_path)) == max(1, CPUS // 2)
    assert rl_trainer_threads(config(tmp_path, inference={"num_servers": 3})) == max(1, CPUS // 4)


@pytest.mark.skipif(CPUS < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs and CPU pinning")
def test_pinning_decides_who_shares(tmp_path: Path) -> None:
    separate = config(tmp_path, trainer={"cpu_cores": [1]}, inference={"cpu_cores": [0]})
    assert rl_trainer_threads(separate) == 1
    together = config(tmp_path, trainer={"cpu_cores": [0, 1]}, inference={"cpu_cores": [1]})
    assert rl_trainer_threads(together) == 1
    alone = config(tmp_path, trainer={"cpu_cores": [0, 1]}, inference={"cpu_cores": [0], "num_servers": 1})
    assert rl_trainer_threads(alone) == 1  # 2 CPUs, one server on one of them: 2 // 2


def test_an_explicit_setting_wins_and_reaches_the_trainer_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a user's shell setting does not override the run's
    chosen = config(tmp_path, trainer={"threads": 3})
    assert rl_trainer_threads(chosen) == 3
    launch = rl_trainer_launch(chosen, run_paths(chosen))
    assert trainer_env(launch)["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="trainer.threads"):
        config(tmp_path, trainer={"threads": 0})


def test_trainer_processes_share_its_cpus() -> None:
    eight = Machine(gpus=(), cpus=frozenset(range(8)))
    eight_gpu = Machine(gpus=("0", "1"), cpus=frozenset(range(8)))
    base = Path("/tmp/asyncrl-threads")  # nothing is written
    assert rl_trainer_threads(config(base, trainer={"processes": 2}), eight) == 8 // (2 + 1)
    assert rl_trainer_threads(config(base, trainer={"processes": 3}, inference={"num_servers": 3}), eight) == 8 // (3 + 3)
    # CPU machine: device sets are CPU sets; one CPU per trainer process means one thread each
    per_cpu = config(base, trainer={"processes": 4, "devices": [0, 1, 2, 3]}, inference={"devices": [[6]]})
    assert rl_trainer_threads(per_cpu, eight) == 1
    # an unpinned trainer meets every server, whatever CPUs their device sets name
    assert rl_trainer_threads(config(base, inference={"num_servers": 2, "devices": [[1], [5]]}), eight) == 8 // (1 + 2)
    # GPU machine: device ids are GPUs, so every CPU is the trainer's and the servers'
    gpus = config(base, trainer={"processes": 2, "devices": [0, 1]}, inference={"devices": [[0]]},
                  placement={"share_devices": True})
    assert rl_trainer_threads(gpus, eight_gpu) == 8 // (2 + 1)


def test_servers_on_another_placement_do_not_count() -> None:
    eight = Machine(gpus=(), cpus=frozenset(range(8)))
    remote = config(Path("/tmp/asyncrl-threads"), inference={"num_servers": 3},
                    placement={"rollout_server": {"deployment": "component/rollout-server"}})
    assert rl_trainer_threads(remote, eight) == 8
