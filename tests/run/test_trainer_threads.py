"""The RL trainer's CPU threads: the trainer's CPUs shared out among the processes that
compute on them at once, unless trainer.threads says otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.run.components_setup import rl_trainer_launch, rl_trainer_threads
from asyncrl.tasks.run.context import run_paths
from asyncrl.tasks.trainer.process import trainer_env

CPUS = os.cpu_count() or 1


def config(tmp_path: Path, trainer: dict[str, Any] | None = None, rollout: dict[str, Any] | None = None) -> RunConfig:
    return RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tmp_path / "model")},
            "data": {"train_path": str(tmp_path / "train.parquet")},
            "rollout": rollout or {},
            "trainer": trainer or {},
            "storage": {"root": str(tmp_path / "store")},
        }
    )


def test_unpinned_trainer_and_servers_share_the_machine(tmp_path: Path) -> None:
    assert rl_trainer_threads(config(tmp_path)) == max(1, CPUS // 2)
    assert rl_trainer_threads(config(tmp_path, rollout={"num_servers": 3})) == max(1, CPUS // 4)


@pytest.mark.skipif(CPUS < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs and CPU pinning")
def test_pinning_decides_who_shares(tmp_path: Path) -> None:
    separate = config(tmp_path, trainer={"cpu_cores": [1]}, rollout={"cpu_cores": [0]})
    assert rl_trainer_threads(separate) == 1
    together = config(tmp_path, trainer={"cpu_cores": [0, 1]}, rollout={"cpu_cores": [1]})
    assert rl_trainer_threads(together) == 1
    alone = config(tmp_path, trainer={"cpu_cores": [0, 1]}, rollout={"cpu_cores": [0], "num_servers": 1})
    assert rl_trainer_threads(alone) == 1  # 2 CPUs, one server on one of them: 2 // 2


def test_an_explicit_setting_wins_and_reaches_the_trainer_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a user's shell setting does not override the run's
    chosen = config(tmp_path, trainer={"threads": 3})
    assert rl_trainer_threads(chosen) == 3
    launch = rl_trainer_launch(chosen, run_paths(chosen))
    assert trainer_env(launch)["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="trainer.threads"):
        config(tmp_path, trainer={"threads": 0})
