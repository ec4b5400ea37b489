"""Device placement: device sets map to CUDA_VISIBLE_DEVICES on a GPU machine (here a faked
one: the machine is a parameter) and to real CPU pinning on this machine without GPUs;
missing devices and double pinning are refused by name.

The started children are trivial Python processes launched through the real start paths
(`RolloutServer.start`, `start_trainer`) with their command swapped: what is tested is the
environment and affinity the components get, not vLLM or DeepSpeed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import asyncrl.tasks.inference.server as server_module
import asyncrl.tasks.trainer.process as trainer_module
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.system.process_group import kill_group, usable_cpus
from asyncrl.configs.cpus import machine_cpus
from asyncrl.tasks.inference.server import RolloutServer, server_env
from asyncrl.tasks.inference.vllm_command import server_command
from asyncrl.tasks.placement.launch_settings import evaluator_server_config, trainer_launch, server_config
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.placement.devices import (
    CUDA_ENV,
    DeviceError,
    Machine,
    count_gpus_files,
    detect_machine,
    id_ranges,
    place,
    shared_gpu_memory_fraction,
    visible_gpus,
)
from asyncrl.tasks.trainer.process import start_trainer, trainer_command

LINUX_AFFINITY = hasattr(os, "sched_getaffinity")
TARGET = max(usable_cpus()) if LINUX_AFFINITY else 0
"""The CPU a device set names here: the last one this process may use (on 2 CPUs the other
is left out, so the pinning is visible)."""
NOT_A_CPU = max(machine_cpus()) + 1
GPUS_4 = Machine(gpus=("0", "1", "2", "3"), gpu_source="fake: 4 GPUs")
NO_GPU = Machine(gpus=(), gpu_source="fake: no GPU")

# A child that reports what it was started with, then sleeps until killed.
REPORTER = (
    "import json, os, time\n"
    "print('REPORT', json.dumps({'cpus': sorted(os.sched_getaffinity(0)), 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'),"
    " 'omp': os.environ.get('OMP_NUM_THREADS')}), flush=True)\n"
    "time.sleep(120)\n"
)


def every_server_config(config, paths, model, machine=None):  # noqa: ANN001, ANN201
    """Every server's launch on one machine."""
    return [server_config(config, paths, model, index, machine) for index in range(config.inference.num_servers)]


def run_config(tmp_path: Path, **sections: dict[str, Any]) -> RunConfig:
    return RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tmp_path / "model")},
            "data": {"train_path": str(tmp_path / "train.parquet")},
            "storage": {"root": str(tmp_path / "store")},
            **sections,
        }
    )


def child_report(log: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("REPORT "):
                return dict(json.loads(line.removeprefix("REPORT ")))
        time.sleep(0.05)
    raise AssertionError(f"the child reported nothing; log: {log.read_text() if log.exists() else ''}")


def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return model


# --- detection -----------------------------------------------------------------------------


def test_visible_gpus_follow_cuda_rules() -> None:
    assert visible_gpus(2, {}) == ("0", "1")
    assert visible_gpus(8, {CUDA_ENV: "4,5"}) == ("4", "5")
    assert visible_gpus(2, {CUDA_ENV: "1,9,0"}) == ("1",)  # CUDA stops at the first invalid entry
    assert visible_gpus(2, {CUDA_ENV: ""}) == ()  # GPUs hidden: a machine without GPUs to this process
    assert visible_gpus(2, {CUDA_ENV: "-1"}) == ()
    assert visible_gpus(1, {CUDA_ENV: "GPU-8a1b,MIG-77"}) == ("GPU-8a1b", "MIG-77")
    assert visible_gpus(0, {CUDA_ENV: "0"}) == ()  # no hardware: the variable means nothing


def test_detect_machine_takes_the_hardware_probe_and_the_environment() -> None:
    machine = detect_machine({CUDA_ENV: "2,3"}, hardware=lambda: (4, "fake probe"))
    assert machine.gpus == ("2", "3") and machine.has_gpus
    assert "fake probe" in machine.gpu_source and "CUDA_VISIBLE_DEVICES='2,3'" in machine.gpu_source
    assert detect_machine({}, hardware=lambda: (0, "none")).gpus == ()
    assert detect_machine({}, hardware=lambda: (0, "none")).cpus == machine_cpus()


def test_device_files_are_counted(tmp_path: Path) -> None:
    dev, proc = tmp_path / "dev", tmp_path / "gpus"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).touch()
    assert count_gpus_files(dev, proc)[0] == 2
    (dev / "nvidia0").unlink()
    (dev / "nvidia1").unlink()
    proc.mkdir()
    (proc / "0000:3b:00.0").mkdir()
    assert count_gpus_files(dev, proc)[0] == 1
    (proc / "0000:3b:00.0").rmdir()
    count, source = count_gpus_files(dev, proc)
    assert count == 0 and "no nvidia-smi GPU" in source


def test_this_machine_is_detected_without_gpus() -> None:
    if Path("/proc/driver/nvidia/gpus").exists() or any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has NVIDIA GPUs")
    assert not detect_machine().has_gpus


def test_id_ranges() -> None:
    assert id_ranges([5, 0, 1, 2]) == "0-2,5" and id_ranges([3]) == "3" and id_ranges([]) == "none"


# --- mapping -------------------------------------------------------------------------------


def test_gpu_machine_maps_ids_into_what_the_parent_sees() -> None:
    parent = detect_machine({CUDA_ENV: "4,5,6,7"}, hardware=lambda: (8, "fake"))
    placed = place((1, 0), "inference.devices[0]", parent, cpu_cores=(0,), cpu_cores_field="inference.cpu_cores")
    assert placed.env == {CUDA_ENV: "5,4"}  # id i = the i-th GPU this process sees, order kept
    assert placed.cpu_cores == (0,)  # on a GPU machine cpu_cores stays CPU affinity beside the GPUs
    assert place(None, "trainer.devices", parent).env == {}  # no device set: inherited


def test_missing_gpu_is_refused_by_name() -> None:
    with pytest.raises(DeviceError, match=r"^inference\.devices\[1\]: device 4 is not on this machine: it has 4 GPU\(s\), "
                                          r"device ids 0-3 \(fake: 4 GPUs\)"):
        place((4,), "inference.devices[1]", GPUS_4)


@pytest.mark.skipif(not LINUX_AFFINITY, reason="Linux affinity calls")
def test_cpu_machine_maps_ids_to_cpus_and_refuses_missing_ones() -> None:
    assert place((TARGET,), "trainer.devices", NO_GPU) == place((TARGET,), "x", NO_GPU)
    assert place((TARGET,), "trainer.devices", NO_GPU).cpu_cores == (TARGET,)
    assert place((TARGET,), "trainer.devices", NO_GPU).env == {}
    with pytest.raises(DeviceError, match=rf"^trainer\.devices: device {NOT_A_CPU} is not on this machine: it has no GPU "
                                          r"\(fake: no GPU\), so device ids are CPU ids: CPUs 0-"):
        place((0, NOT_A_CPU), "trainer.devices", NO_GPU)


def test_cpu_machine_refuses_devices_and_cpu_cores_together(tmp_path: Path) -> None:
    with pytest.raises(DeviceError, match=r"^inference\.cpu_cores: set together with inference\.devices\[0\] on a machine "
                                          "without GPUs"):
        place((0,), "inference.devices[0]", NO_GPU, cpu_cores=(0,), cpu_cores_field="inference.cpu_cores")
    both = run_config(tmp_path, trainer={"devices": [0], "cpu_cores": [0]})
    with pytest.raises(DeviceError, match=r"^trainer\.cpu_cores: set together with trainer\.devices"):
        trainer_launch(both, run_paths(both), NO_GPU)
    assert trainer_launch(both, run_paths(both), GPUS_4).cpu_cores == (0,)  # fine beside GPUs


def test_server_configs_on_a_gpu_machine(tmp_path: Path) -> None:
    config = run_config(tmp_path, inference={"num_servers": 2, "tensor_parallel_size": 2, "devices": [[0, 1], [3, 2]]})
    first, second = every_server_config(config, run_paths(config), model_dir(tmp_path), GPUS_4)
    assert (first.cuda_visible_devices, second.cuda_visible_devices) == ("0,1", "3,2")
    assert first.tensor_parallel_size == 2 and first.cpu_cores is None and first.gpu_memory_utilization is None
    command = server_command(second, tmp_path, 8000)
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert "--gpu-memory-utilization" not in command
    assert server_env(second)[CUDA_ENV] == "3,2"
    with pytest.raises(DeviceError, match=r"^inference\.devices\[1\]: device 2, 3 is not on this machine: it has 2 GPU"):
        server_config(config, run_paths(config), model_dir(tmp_path), 1, Machine(gpus=("0", "1"), gpu_source="fake"))


def test_servers_without_devices_keep_their_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_ENV, "7")  # inherited as it is
    config = run_config(tmp_path)
    (placed,) = every_server_config(config, run_paths(config), model_dir(tmp_path), GPUS_4)
    assert placed.cuda_visible_devices is None and placed.tensor_parallel_size == 1
    command = server_command(placed, tmp_path, 8000)
    assert "--tensor-parallel-size" not in command and "--gpu-memory-utilization" not in command
    assert server_env(placed)[CUDA_ENV] == "7"


def test_shared_gpus_split_the_memory(tmp_path: Path) -> None:
    alone = run_config(tmp_path, inference={"devices": [[0]]}, trainer={"devices": [1]})
    assert shared_gpu_memory_fraction(alone, 0) is None
    shared = run_config(tmp_path, inference={"devices": [[0]]}, trainer={"devices": [0]}, placement={"share_devices": True})
    assert shared_gpu_memory_fraction(shared, 0) == 0.45
    (on_gpu,) = every_server_config(shared, run_paths(shared), model_dir(tmp_path), GPUS_4)
    command = server_command(on_gpu, tmp_path, 8000)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.45"
    (on_cpu,) = every_server_config(shared, run_paths(shared), model_dir(tmp_path), Machine(gpus=(), cpus=frozenset({0})))
    assert on_cpu.gpu_memory_utilization is None and on_cpu.cpu_cores == (0,)
    three = run_config(tmp_path, inference={"num_servers": 2, "devices": [[0], [0]]}, trainer={"devices": [0]},
                       placement={"share_devices": True})
    assert shared_gpu_memory_fraction(three, 1) == 0.3


def test_trainer_launch_on_a_gpu_machine(tmp_path: Path) -> None:
    config = run_config(tmp_path, trainer={"processes": 2, "devices": [2, 3]})
    launch = trainer_launch(config, run_paths(config), GPUS_4)
    assert launch.nproc == 2 and launch.nnodes == 1 and launch.rendezvous is None
    assert launch.env[CUDA_ENV] == "2,3" and launch.cpu_cores is None
    assert "--nproc-per-node=2" in trainer_command(launch)
    with pytest.raises(DeviceError, match=r"^trainer\.devices: device 2, 3 is not on this machine"):
        trainer_launch(config, run_paths(config), Machine(gpus=("0", "1"), gpu_source="fake"))


def test_trainer_launch_takes_nodes_and_rendezvous(tmp_path: Path) -> None:
    config = run_config(
        tmp_path, trainer={"nodes": 2, "rendezvous": "trainer-0:29400"},
        placement={"trainer": {"deployment": "component/trainer"}},
    )  # fmt: skip
    launch = trainer_launch(config, run_paths(config), NO_GPU)
    assert (launch.nproc, launch.nnodes, launch.rendezvous) == (1, 2, "trainer-0:29400")
    assert "--rdzv-endpoint=trainer-0:29400" in trainer_command(launch)


# --- the mapping really applied on this machine --------------------------------------------


@pytest.mark.skipif(not LINUX_AFFINITY, reason="Linux affinity calls")
def test_rollout_devices_pin_the_started_server_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if detect_machine().has_gpus:
        pytest.skip("this machine has GPUs: device ids are GPU ids here")
    config = run_config(tmp_path, inference={"devices": [[TARGET]]})
    (launch,) = every_server_config(config, run_paths(config), model_dir(tmp_path))  # this machine, detected
    assert launch.cpu_cores == (TARGET,) and launch.cuda_visible_devices is None
    monkeypatch.setattr(server_module, "server_command", lambda config, model_dir, port: [sys.executable, "-c", REPORTER])
    monkeypatch.delenv(CUDA_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server = RolloutServer(launch)
    server.start()
    try:
        report = child_report(launch.log_path)  # type: ignore[arg-type] - server_config sets it
    finally:
        server.stop()
    assert report["cpus"] == [TARGET] and report["cuda"] is None
    # The CPU build runs the model worker in the engine core, on the one pinned CPU: max(1, 1 - 1) threads.
    assert report["omp"] == ("1" if server_module.vllm_is_cpu_build() else None)


def test_the_worker_process_choice_reaches_every_vllm_server_of_the_run(tmp_path: Path) -> None:
    own = run_config(tmp_path, inference={"num_servers": 2, "worker_in_engine_process": False, "fork_engine_core": False})
    configs = [*every_server_config(own, run_paths(own), model_dir(tmp_path), NO_GPU),
               evaluator_server_config(own, run_paths(own), model_dir(tmp_path), NO_GPU)]  # fmt: skip
    assert [(c.worker_in_engine_process, c.fork_engine_core) for c in configs] == [(False, False)] * 3
    (default,) = every_server_config(run_config(tmp_path), run_paths(own), model_dir(tmp_path), NO_GPU)
    assert default.worker_in_engine_process and default.fork_engine_core


def test_gpu_devices_reach_the_started_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = run_config(tmp_path, inference={"devices": [[2]]})
    (launch,) = every_server_config(config, run_paths(config), model_dir(tmp_path), GPUS_4)
    monkeypatch.setattr(server_module, "server_command", lambda config, model_dir, port: [sys.executable, "-c", REPORTER])
    monkeypatch.setenv(CUDA_ENV, "0,1,2,3")
    server = RolloutServer(launch)
    server.start()
    try:
        report = child_report(launch.log_path)  # type: ignore[arg-type]
    finally:
        server.stop()
    assert report["cuda"] == "2"


@pytest.mark.skipif(not LINUX_AFFINITY, reason="Linux affinity calls")
def test_trainer_devices_pin_the_started_trainer_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if detect_machine().has_gpus:
        pytest.skip("this machine has GPUs: device ids are GPU ids here")
    config = run_config(tmp_path, trainer={"devices": [TARGET]}, inference={"cpu_cores": [TARGET]})
    launch = trainer_launch(config, run_paths(config))  # this machine, detected
    monkeypatch.setattr(trainer_module, "trainer_command", lambda launch: [sys.executable, "-c", REPORTER])
    process = start_trainer(launch)
    try:
        report = child_report(launch.log_path)
    finally:
        kill_group(process, 1.0)
    assert report["cpus"] == [TARGET]
    assert report["omp"] == "1"  # one CPU shared by the trainer and the server on it: 1 // (1 + 1) -> 1
