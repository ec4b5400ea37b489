"""How each process of a run is launched, from the run config: the rollout servers' and the
evaluator's vLLM launch settings, the trainer's launch and its CPU threads, and the weights
the servers start from. Device ids are mapped on the machine where the process starts
(:mod:`asyncrl.tasks.placement.devices`), so call these there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from asyncrl.configs.processes import ServerLaunchConfig
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.model.weight_fetch import VersionLease, model_weights
from asyncrl.tasks.placement.devices import (
    DevicePlacement,
    Machine,
    detect_machine,
    evaluator_gpu_memory_fraction,
    evaluator_placement,
    rollout_placement,
    shared_gpu_memory_fraction,
    trainer_placement,
)
from asyncrl.tasks.trainer.process import DETERMINISTIC_ENV, TrainerLaunch


def serving_weights(config: RunConfig, paths: RunPaths) -> tuple[Path, int, VersionLease | None]:
    """The weights the rollout servers start with (:func:`model_weights`): the newest published
    version (a resumed run, or the SFT warm start of the pipeline), else `model.path` as version 0.
    A cached version comes with its lease, taken before the fetch: the caller releases it once
    the server has loaded the weights, so no other server's prune deletes them under it. A LoRA
    run's servers start from `model.path` whatever is published (:func:`server_start_dir`):
    the version, an adapter, is loaded once the server is up."""
    latest = WeightStore(paths.root).latest()
    cache_dir = paths.work_dir / "weights-cache"
    if config.trainer.lora is not None:  # the base model: nothing cached to lease
        version = 0 if latest is None else latest
        return server_start_dir(config, paths, version, cache_dir), version, None
    lease = None if latest is None else VersionLease.take(cache_dir, paths.root.uri, latest)
    try:
        model_dir = model_weights(paths.root, config.model.path, latest, cache_dir)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    return model_dir, 0 if latest is None else latest, lease


def server_start_dir(config: ServerLaunchConfig, paths: RunPaths, version: int, cache_dir: Path) -> Path:
    """The directory a vLLM server of the run starts from to serve ``version``: its weights
    (:func:`model_weights`, cached under ``cache_dir``), or in a LoRA run (``trainer.lora``)
    the base model, ``model.path``: every version there is an adapter, loaded into the running
    server (``ServerWeightLoader(adapters=True)``)."""
    if config.trainer.lora is not None:
        return Path(config.model.path)
    return model_weights(paths.root, config.model.path, version, cache_dir)


def server_config(
    config: RunConfig, paths: RunPaths, model_dir: Path, index: int, machine: Machine | None = None
) -> RolloutServerConfig:
    """Rollout server ``index``'s launch on ``machine`` (default: this one, detected now): its
    port, seed and log, ``inference.tensor_parallel_size``, and its device set mapped by
    :func:`~asyncrl.tasks.placement.devices.place` (``CUDA_VISIBLE_DEVICES`` on a GPU machine, CPU
    pinning on one without; a device the machine lacks raises naming ``inference.devices[index]``).
    On a GPU machine a server whose GPUs other components share gets a share of their memory
    (:func:`~asyncrl.tasks.placement.devices.shared_gpu_memory_fraction`). Call it where the server
    starts: device ids mean that machine's devices."""
    inference = config.inference
    machine = machine or detect_machine()
    return _vllm_launch(
        config, model_dir, machine, rollout_placement(inference, index, machine),
        port=0 if inference.base_port == 0 else inference.base_port + index,
        seed=config.seed + index,
        log_path=paths.log(f"rollout-{index}.log"),
        gpu_memory_utilization=shared_gpu_memory_fraction(config, index) if machine.has_gpus else None,
    )  # fmt: skip


def evaluator_server_config(
    config: ServerLaunchConfig, paths: RunPaths, model_dir: Path, machine: Machine | None = None
) -> RolloutServerConfig:
    """The evaluator's own vLLM server (evaluation during training), launched as a rollout
    server is (dtype, parallelism, KV cache, longest sequence) on a free port, with its log
    ``evaluator-server.log``, its device set ``pipeline.training_eval.devices``
    (:func:`~asyncrl.tasks.placement.devices.evaluator_placement`) and its whole session at nice
    ``pipeline.training_eval.nice``."""
    machine = machine or detect_machine()
    return _vllm_launch(
        config, model_dir, machine, evaluator_placement(config, machine),
        port=0,
        seed=config.seed,
        log_path=paths.log("evaluator-server.log"),
        gpu_memory_utilization=evaluator_gpu_memory_fraction(config) if machine.has_gpus else None,
        session_nice=config.pipeline.training_eval.nice,
    )  # fmt: skip


def _vllm_launch(
    config: ServerLaunchConfig,
    model_dir: Path,
    machine: Machine,
    placement: DevicePlacement,
    *,
    port: int,
    seed: int,
    log_path: Path,
    gpu_memory_utilization: float | None,
    session_nice: int | None = None,
) -> RolloutServerConfig:
    """A vLLM server of the run on ``placement``: the inference section's host, key, KV cache,
    worker process, parallelism and longest sequence, the model's dtype; no CUDA graphs without GPUs."""
    inference = config.inference
    return RolloutServerConfig(
        model_dir=model_dir,
        host=inference.host,
        port=port,
        api_key=inference.api_key_value(),
        kv_cache_gib=inference.kv_cache_gib,
        worker_in_engine_process=inference.worker_in_engine_process,
        fork_engine_core=inference.fork_engine_core,
        max_model_len=config.longest_sequence,
        max_num_seqs=inference.max_num_seqs,
        seed=seed,
        log_path=log_path,
        cpu_cores=placement.cpu_cores,
        tensor_parallel_size=inference.tensor_parallel_size,
        cuda_visible_devices=placement.cuda_visible_devices,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=config.model.dtype,
        enforce_eager=not machine.has_gpus,
        session_nice=session_nice,
        max_lora_rank=None if config.trainer.lora is None else config.trainer.lora.rank,
    )


def trainer_threads(config: RunConfig, machine: Machine | None = None, *, beside_servers: bool = True) -> int:
    """CPU threads of each trainer process: ``trainer.threads`` when set, else

        threads = max(1, floor(C / (P + S)))

    with C the trainer's CPUs, P = ``trainer.processes`` (its processes compute on them at
    once) and S the rollout servers on the trainer's placement whose CPUs meet the trainer's
    (0 when not ``beside_servers``: the SFT stage runs before any server starts).
    A component's CPUs: its ``cpu_cores``, else (on a machine without GPUs) its device set,
    else every CPU of the machine. On a GPU machine the formula is the same: the processes
    still share the CPUs for data handling, and a vLLM server keeps CPUs busy beside its GPU.
    ``machine``: the trainer's (default: this one, detected now)."""
    if config.trainer.threads is not None:
        return config.trainer.threads
    machine = machine or detect_machine()
    every = set(machine.cpus)

    def cpus_of(cores: tuple[int, ...] | None, devices: tuple[int, ...] | None) -> set[int]:
        if cores is not None:
            return set(cores)
        if devices is not None and not machine.has_gpus:
            return set(devices)
        return every

    trainer = config.trainer
    inference = config.inference
    trainer_cpus = cpus_of(trainer.cpu_cores, trainer.devices)
    sharing = 0
    if beside_servers and config.placement.rollout_server == config.placement.trainer:
        for index in range(inference.num_servers):
            devices = inference.devices[index] if inference.devices is not None else None
            sharing += bool(cpus_of(inference.cpu_cores, devices) & trainer_cpus)
    return max(1, len(trainer_cpus) // (trainer.processes + sharing))


def trainer_launch(
    config: RunConfig, paths: RunPaths, machine: Machine | None = None, *, mode: Literal["rl", "sft"] = "rl"
) -> TrainerLaunch:
    """The trainer process of the run on ``machine`` (default: this one, detected now), for RL
    or for the SFT stage: the trainer's process config, ``logs/trainer.log`` (``logs/sft.log``), metrics
    in ``trainer-metrics.jsonl`` (``sft-metrics.jsonl``) of the work directory,
    ``trainer.processes`` processes per node, its device set mapped by
    :func:`~asyncrl.tasks.placement.devices.place` (``CUDA_VISIBLE_DEVICES`` on a GPU machine,
    CPU pinning on one without; else pinned to ``trainer.cpu_cores``), with
    :func:`trainer_threads` CPU threads per process. RL runs on ``trainer.nodes`` nodes meeting
    at ``trainer.rendezvous``; SFT, a stage of the head node, on this node alone, with no
    rollout server beside it. Call it where the trainer starts: device ids mean that
    machine's devices."""
    if mode not in ("rl", "sft"):
        raise ValueError(f"trainer launch mode must be 'rl' or 'sft', got {mode!r}")
    machine = machine or detect_machine()
    trainer = config.trainer
    placement = trainer_placement(config, machine)
    rl = mode == "rl"
    name = "trainer" if rl else "sft"
    threads = trainer_threads(config, machine, beside_servers=rl)
    return TrainerLaunch(
        config_path=paths.process_config("trainer"),
        log_path=paths.log(f"{name}.log"),
        mode=mode,
        work_dir=paths.work_dir / name,
        metrics_file=paths.work_dir / f"{name}-metrics.jsonl",
        nproc=trainer.processes,
        nnodes=trainer.nodes if rl else 1,
        rendezvous=trainer.rendezvous if rl else None,
        cpu_cores=placement.cpu_cores,
        env={"OMP_NUM_THREADS": str(threads), **placement.env, **(DETERMINISTIC_ENV if trainer.deterministic else {})},
    )
