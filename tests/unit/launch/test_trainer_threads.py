"""The RL trainer's CPU threads: the trainer's CPUs shared out among the processes that
compute on them at once (its own trainer.processes and the rollout servers on them),
threads = max(1, floor(C / (P + S))), unless trainer.threads says otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.placement.launch_settings import trainer_launch, trainer_threads
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
    assert trainer_threads(config(tmp_path)) == max(1, CPUS // 2)
    assert trainer_threads(config(tmp_path, inference={"num_servers": 3})) == max(1, CPUS // 4)


@pytest.mark.skipif(CPUS < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs and CPU pinning")
def test_pinning_decides_who_shares(tmp_path: Path) -> None:
    separate = config(tmp_path, trainer={"cpu_cores": [1]}, inference={"cpu_cores": [0]})
    assert trainer_threads(separate) == 1
    together = config(tmp_path, trainer={"cpu_cores": [0, 1]}, inference={"cpu_cores": [1]})
    assert trainer_threads(together) == 1
    alone = config(tmp_path, trainer={"cpu_cores": [0, 1]}, inference={"cpu_cores": [0], "num_servers": 1})
    assert trainer_threads(alone) == 1  # 2 CPUs, one server on one of them: 2 // 2


def test_an_explicit_setting_wins_and_reaches_the_trainer_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a user's shell setting does not override the run's
    chosen = config(tmp_path, trainer={"threads": 3})
    assert trainer_threads(chosen) == 3
    launch = trainer_launch(chosen, run_paths(chosen))
    assert trainer_env(launch)["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="trainer.threads"):
        config(tmp_path, trainer={"threads": 0})


def test_trainer_processes_share_its_cpus() -> None:
    eight = Machine(gpus=(), cpus=frozenset(range(8)))
    eight_gpu = Machine(gpus=("0", "1"), cpus=frozenset(range(8)))
    base = Path("/tmp/asyncrl-threads")  # nothing is written
    assert trainer_threads(config(base, trainer={"processes": 2}), eight) == 8 // (2 + 1)
    assert trainer_threads(config(base, trainer={"processes": 3}, inference={"num_servers": 3}), eight) == 8 // (3 + 3)
    # CPU machine: device sets are CPU sets; one CPU per trainer process means one thread each
    per_cpu = config(base, trainer={"processes": 4, "devices": [0, 1, 2, 3]}, inference={"devices": [[6]]})
    assert trainer_threads(per_cpu, eight) == 1
    # an unpinned trainer meets every server, whatever CPUs their device sets name
    assert trainer_threads(config(base, inference={"num_servers": 2, "devices": [[1], [5]]}), eight) == 8 // (1 + 2)
    # GPU machine: device ids are GPUs, so every CPU is the trainer's and the servers'
    gpus = config(base, trainer={"processes": 2, "devices": [0, 1]}, inference={"devices": [[0]]},
                  placement={"share_devices": True})
    assert trainer_threads(gpus, eight_gpu) == 8 // (2 + 1)


def test_servers_on_another_placement_do_not_count() -> None:
    eight = Machine(gpus=(), cpus=frozenset(range(8)))
    remote = config(Path("/tmp/asyncrl-threads"), inference={"num_servers": 3},
                    placement={"rollout_server": {"deployment": "component/rollout-server"}})
    assert trainer_threads(remote, eight) == 8


def test_the_sft_stage_launch_runs_on_this_node_alone_with_no_server_sharing_its_cpus(tmp_path: Path) -> None:
    eight = Machine(gpus=(), cpus=frozenset(range(8)))
    cfg = config(tmp_path, trainer={"processes": 2, "nodes": 2, "rendezvous": "head:29400"}, inference={"num_servers": 2},
                 placement={"trainer": {"deployment": "component/trainer"}})
    paths = run_paths(cfg)
    rl = trainer_launch(cfg, paths, eight, mode="rl")
    sft = trainer_launch(cfg, paths, eight, mode="sft")
    assert (rl.mode, rl.nnodes, rl.rendezvous) == ("rl", 2, "head:29400")
    assert (sft.mode, sft.nnodes, sft.rendezvous) == ("sft", 1, None)
    assert sft.nproc == rl.nproc == 2 and sft.cpu_cores == rl.cpu_cores
    assert (sft.log_path.name, sft.metrics_file.name, sft.work_dir.name) == ("sft.log", "sft-metrics.jsonl", "sft")
    assert (rl.log_path.name, rl.metrics_file.name, rl.work_dir.name) == ("trainer.log", "trainer-metrics.jsonl", "trainer")
    beside = config(tmp_path, trainer={"processes": 2}, inference={"num_servers": 2})
    assert trainer_launch(beside, paths, eight, mode="rl").env["OMP_NUM_THREADS"] == str(8 // (2 + 2))
    assert trainer_launch(beside, paths, eight, mode="sft").env["OMP_NUM_THREADS"] == str(8 // 2)
    with pytest.raises(ValueError, match="trainer launch mode must be 'rl' or 'sft'"):
        trainer_launch(beside, paths, eight, mode="eval")  # type: ignore[arg-type]


def test_a_deterministic_trainer_gets_the_cublas_workspace_cuda_needs_for_it(tmp_path: Path) -> None:
    """``trainer.deterministic`` (on by default) reaches the trainer's environment before CUDA
    starts; turned off, the trainer gets none of it."""
    eight = Machine(gpus=(), cpus=frozenset(range(8)))
    on, off = config(tmp_path), config(tmp_path, trainer={"deterministic": False})
    assert trainer_launch(on, run_paths(on), eight).env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in trainer_launch(off, run_paths(off), eight).env
