"""The rollout server's device settings: tensor parallelism, CUDA_VISIBLE_DEVICES and the GPU
memory share reach vLLM's command line and environment, are checked by name, and leave the
launch exactly as before when unset."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.tasks.inference import server
from asyncrl.tasks.inference.server import server_env
from asyncrl.tasks.inference.vllm_command import server_command
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.vllm_platform import FORK_ENGINE_CORE_ENV


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tensor_parallel_size", 0, "tensor_parallel_size must be an int >= 1"),
        ("tensor_parallel_size", True, "tensor_parallel_size must be an int >= 1"),
        ("cuda_visible_devices", "", "cuda_visible_devices must be comma-separated GPU indices or UUIDs"),
        ("cuda_visible_devices", "0, 1", "cuda_visible_devices must be comma-separated"),
        ("cuda_visible_devices", "0,,1", "cuda_visible_devices must be comma-separated"),
        ("gpu_memory_utilization", 0.0, r"gpu_memory_utilization must be in \(0, 1\]"),
        ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\]"),
        ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
    ],
)
def test_device_settings_are_bounded(field: str, value: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"RolloutServerConfig.{message}"):
        RolloutServerConfig(model_dir=tmp_path, **{field: value})  # type: ignore[arg-type]


def test_tensor_parallel_size_needs_as_many_gpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs, cuda_visible_devices '3' names 1"):
        RolloutServerConfig(model_dir=tmp_path, tensor_parallel_size=2, cuda_visible_devices="3")


def test_device_settings_reach_command_and_environment(tmp_path: Path) -> None:
    config = RolloutServerConfig(
        model_dir=tmp_path, tensor_parallel_size=2, cuda_visible_devices="GPU-a1,3", gpu_memory_utilization=0.45,
        extra_args=("--max-num-seqs", "64"),
    )  # fmt: skip
    command = server_command(config, tmp_path, 8000)
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.45"
    assert command[-2:] == ["--max-num-seqs", "64"]  # extra_args stay last
    assert server_env(config)["CUDA_VISIBLE_DEVICES"] == "GPU-a1,3"


def test_max_num_seqs_reaches_the_command(tmp_path: Path) -> None:
    command = server_command(RolloutServerConfig(model_dir=tmp_path, max_num_seqs=512), tmp_path, 8000)
    assert command[command.index("--max-num-seqs") + 1] == "512"


def test_unset_device_settings_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    config = RolloutServerConfig(model_dir=tmp_path)
    command = server_command(config, tmp_path, 8000)
    assert not {"--tensor-parallel-size", "--gpu-memory-utilization", "--max-num-seqs"} & set(command)
    assert server_env(config)["CUDA_VISIBLE_DEVICES"] == "1"  # inherited
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in server_env(config)


def test_on_cpu_the_worker_runs_in_the_engine_process_with_cores_less_one_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "vllm_is_cpu_build", lambda: True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(server, "usable_cpus", lambda: frozenset(range(4)))
    env = server_env(RolloutServerConfig(model_dir=tmp_path))
    assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["OMP_NUM_THREADS"]) == ("0", "3")
    assert env[FORK_ENGINE_CORE_ENV] == "1"  # the engine core is forked (tasks/inference/vllm_platform.py)
    monkeypatch.setenv(FORK_ENGINE_CORE_ENV, "1")  # inherited: a server that asks for vLLM's spawn has none
    spawned = server_env(RolloutServerConfig(model_dir=tmp_path, fork_engine_core=False))
    assert FORK_ENGINE_CORE_ENV not in spawned and spawned["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server_env(RolloutServerConfig(model_dir=tmp_path, cpu_cores=(0,)))["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's setting wins
    assert server_env(RolloutServerConfig(model_dir=tmp_path))["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize(
    ("cpu_build", "settings"),
    [(True, {"worker_in_engine_process": False}), (True, {"tensor_parallel_size": 2}), (False, {})],
)
def test_the_worker_keeps_its_own_process_when_not_asked_sharded_or_on_a_gpu_build(
    cpu_build: bool, settings: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "vllm_is_cpu_build", lambda: cpu_build)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv(FORK_ENGINE_CORE_ENV, "1")  # inherited from a server's own process tree
    env = server_env(RolloutServerConfig(model_dir=tmp_path, **settings))  # type: ignore[arg-type]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env
    assert FORK_ENGINE_CORE_ENV not in env  # vLLM's own start method


def test_an_eager_server_compiles_nothing_unless_the_environment_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert server_env(RolloutServerConfig(model_dir=tmp_path))["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in server_env(RolloutServerConfig(model_dir=tmp_path, enforce_eager=False))
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")  # the user's setting wins
    assert server_env(RolloutServerConfig(model_dir=tmp_path))["TORCH_COMPILE_DISABLE"] == "0"


def test_what_a_server_compiles_is_cached_where_inductor_caches_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # Not in the server's own TMPDIR, which is removed with it: the directory this process's
    # inductor would use, which outlives every server.
    assert server_env(RolloutServerConfig(model_dir=tmp_path))["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's setting wins
    assert server_env(RolloutServerConfig(model_dir=tmp_path))["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
