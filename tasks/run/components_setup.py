"""The parts of an RL run that its components share: the tokenizer codec, the weights the
rollout servers start from and their launch configs, the rollout controller on its own
event loop (run by the scheduler process), and the trainer's launch.

Imports stay light (no Prefect or MLflow), so a restarted scheduler process is back quickly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.run.context import RunPaths
from asyncrl.tasks.scheduler.controller import ControllerSettings, ControllerStats, PromptSchedule, RolloutController
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.agent.config import EpisodeConfig
from asyncrl.tasks.agent.episode import load_episode
from asyncrl.tasks.agent.runner import EpisodeRunner
from asyncrl.tasks.data.loader import PromptRecord
from asyncrl.tasks.data.prompting import render_prompt
from asyncrl.tasks.model.checks import require_model_dir
from asyncrl.tasks.reward.remote import RemoteRewardScorer
from asyncrl.tasks.rollout.client import RolloutClient
from asyncrl.tasks.rollout.proxy import RecordingProxy
from asyncrl.tasks.rollout.server import RolloutServerConfig, RolloutServerHandle
from asyncrl.tasks.rollout.weight_sync import ServerWeightLoader, fetch_weight_version
from asyncrl.tasks.run.devices import (
    DevicePlacement,
    Machine,
    detect_machine,
    evaluator_gpu_memory_fraction,
    evaluator_placement,
    rollout_placement,
    shared_gpu_memory_fraction,
    trainer_placement,
)
from asyncrl.tasks.trainer.process import TrainerLaunch



class HFCodec:
    """Prompt text <-> token ids with the model's own tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_codec(model_dir: str, key: str = "model.path") -> tuple[HFCodec, tuple[int, ...]]:
    """The tokenizer and the stop token ids (eos of the tokenizer and generation config).

    A local ``model_dir`` that is missing (or holds no ``config.json``) raises
    :class:`~asyncrl.tasks.model.checks.ModelPathError` naming ``key`` and the path."""
    from transformers import AutoTokenizer, GenerationConfig

    require_model_dir(model_dir, key)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    stop.update([eos] if isinstance(eos, int) else list(eos or []))
    return HFCodec(tokenizer), tuple(sorted(stop))


def serving_weights(config: RunConfig, paths: RunPaths) -> tuple[Path, int]:
    """The weights the rollout servers start with: the newest published version (a resumed
    run, or the SFT warm start of the pipeline), else `model.path` as version 0."""
    latest = WeightStore(paths.root).latest()
    if latest is None:
        return Path(config.model.path), 0
    model_dir, _ = fetch_weight_version(
        config.storage.root, dict(config.storage.options), latest, paths.work_dir / "weights-cache"
    )
    return model_dir, latest


def server_config(
    config: RunConfig, paths: RunPaths, model_dir: Path, index: int, machine: Machine | None = None
) -> RolloutServerConfig:
    """Rollout server ``index``'s launch on ``machine`` (default: this one, detected now): its
    port, seed and log, ``rollout.tensor_parallel_size``, and its device set mapped by
    :func:`~asyncrl.tasks.run.devices.place` (``CUDA_VISIBLE_DEVICES`` on a GPU machine, CPU
    pinning on one without; a device the machine lacks raises naming ``rollout.devices[index]``).
    On a GPU machine a server whose GPUs other components share gets a share of their memory
    (:func:`~asyncrl.tasks.run.devices.shared_gpu_memory_fraction`). Call it where the server
    starts: device ids mean that machine's devices."""
    rollout = config.rollout
    machine = machine or detect_machine()
    return _vllm_launch(
        config, model_dir, machine, rollout_placement(config, index, machine),
        port=0 if rollout.base_port == 0 else rollout.base_port + index,
        seed=config.seed + index,
        log_path=paths.log(f"rollout-{index}.log"),
        gpu_memory_utilization=shared_gpu_memory_fraction(config, index) if machine.has_gpus else None,
    )  # fmt: skip


def evaluator_server_config(
    config: RunConfig, paths: RunPaths, model_dir: Path, machine: Machine | None = None
) -> RolloutServerConfig:
    """The evaluator's own vLLM server (evaluation during training), launched as a rollout
    server is (dtype, parallelism, KV cache, longest sequence) on a free port, with its log
    ``evaluator-server.log``, its device set ``pipeline.training_eval.devices``
    (:func:`~asyncrl.tasks.run.devices.evaluator_placement`) and its whole session at nice
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
    config: RunConfig,
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
    """A vLLM server of the run on ``placement``: the rollout section's host, key, KV cache,
    worker process, parallelism and longest sequence, the model's dtype; no CUDA graphs without GPUs."""
    rollout = config.rollout
    return RolloutServerConfig(
        model_dir=model_dir,
        host=rollout.host,
        port=port,
        api_key=rollout.api_key_value(),
        kv_cache_gib=rollout.kv_cache_gib,
        worker_in_engine_process=rollout.worker_in_engine_process,
        fork_engine_core=rollout.fork_engine_core,
        max_model_len=config.longest_sequence,
        seed=seed,
        log_path=log_path,
        cpu_cores=placement.cpu_cores,
        tensor_parallel_size=rollout.tensor_parallel_size,
        cuda_visible_devices=placement.cuda_visible_devices,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=config.model.dtype,
        enforce_eager=not machine.has_gpus,
        session_nice=session_nice,
    )


def controller_settings(config: RunConfig, stop_token_ids: tuple[int, ...], max_groups: int | None) -> ControllerSettings:
    rollout = config.rollout
    return ControllerSettings(
        run_id=config.name,
        batch_groups=config.trainer.batch_groups,
        eta=rollout.eta,
        n_samples=rollout.n_samples,
        max_new_tokens=rollout.max_new_tokens,
        max_prompt_tokens=config.data.max_prompt_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=stop_token_ids,
        ignore_eos=rollout.ignore_eos,
        dynamic_filter=rollout.dynamic_filter,
        adaptive_staleness=rollout.adaptive_staleness,
        shard_groups=rollout.shard_groups,
        shard_seconds=rollout.shard_seconds,
        weight_poll_seconds=rollout.weight_poll_seconds,
        max_groups_in_flight=rollout.max_groups_in_flight,
        seed=config.seed,
        max_groups=max_groups,
    )


def run_scheduler(
    config: RunConfig,
    paths: RunPaths,
    handles: list[RolloutServerHandle],
    prompts: list[PromptRecord],
    stop: threading.Event,
    initial_version: int,
    max_groups: int | None = None,
    codec: tuple[HFCodec, tuple[int, ...]] | None = None,
) -> ControllerStats:
    """The rollout controller on its own event loop, scoring through the run's reward
    service, until `stop` is set (or, with `max_groups`, until that many groups are admitted
    and produced). ``codec``: the model's (:func:`load_codec`), loaded here if not given."""
    codec, stop_ids = codec or load_codec(config.model.path)
    weight_loader = ServerWeightLoader(
        config.storage.root, config.storage.options, cache_dir=str(paths.work_dir / "weights-cache")
    )

    async def main() -> ControllerStats:
        stop_async = asyncio.Event()

        async def relay_stop() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.2)
            stop_async.set()

        relay = asyncio.create_task(relay_stop())
        try:
            async with RolloutClient(
                handles, interrupt_mode=config.rollout.interrupt_mode, initial_version=initial_version
            ) as client, RemoteRewardScorer(paths.root) as scorer, episode_runner(config, client, codec) as episodes:
                controller = RolloutController(
                    controller_settings(config, stop_ids, max_groups=max_groups),
                    paths.root,
                    PromptSchedule(prompts, seed=config.seed),
                    render=lambda record: render_prompt(record.prompt, config.data.prompt_format, codec.tokenizer),
                    codec=codec,
                    generator=client,
                    scorer=scorer,
                    weight_loader=weight_loader.for_version,
                    episodes=episodes,
                    weight_prefetch=lambda version: weight_loader.prefetch(version, handles),
                )
                return await controller.run(stop_async)
        finally:
            relay.cancel()
            weight_loader.close()

    return asyncio.run(main())


@asynccontextmanager
async def episode_runner(config: RunConfig, client: RolloutClient, codec: HFCodec) -> AsyncIterator[EpisodeRunner | None]:
    """The runner of the run's ``rollout.episode`` (:func:`episode_runner_on`), or None for a
    single-turn run."""
    if config.rollout.episode is None:
        yield None
        return
    async with episode_runner_on(
        client, codec, config.rollout.episode, config.rollout.max_new_tokens, config.rollout.temperature,
        config.rollout.top_p, model=config.model.path,
    ) as runner:  # fmt: skip
        yield runner


@asynccontextmanager
async def episode_runner_on(
    client: RolloutClient,
    codec: HFCodec,
    episode: EpisodeConfig,
    max_episode_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    model: str = "asyncrl-policy",
) -> AsyncIterator[EpisodeRunner]:
    """An :class:`EpisodeRunner` of ``episode`` behind a recording endpoint on 127.0.0.1 in
    front of ``client``'s servers (stopped on exit). The user's function is imported first:
    a bad import path fails here, naming the field, before any model call."""
    function = load_episode(episode.function)
    proxy = RecordingProxy(
        client,
        codec.tokenizer,
        default_temperature=temperature,
        default_top_p=top_p,
        max_episode_tokens=max_episode_tokens,
        max_context_tokens=episode.max_context_tokens,
    )
    await proxy.start(host="127.0.0.1", port=0)
    try:
        yield EpisodeRunner(function, proxy, episode, model=model)
    finally:
        await proxy.stop()


def rl_trainer_threads(config: RunConfig, machine: Machine | None = None) -> int:
    """CPU threads of each RL trainer process: ``trainer.threads`` when set, else

        threads = max(1, floor(C / (P + S)))

    with C the trainer's CPUs, P = ``trainer.processes`` (its processes compute on them at
    once) and S the rollout servers on the trainer's placement whose CPUs meet the trainer's.
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
    rollout = config.rollout
    trainer_cpus = cpus_of(trainer.cpu_cores, trainer.devices)
    sharing = 0
    if config.placement.rollout_server == config.placement.trainer:
        for index in range(rollout.num_servers):
            devices = rollout.devices[index] if rollout.devices is not None else None
            sharing += bool(cpus_of(rollout.cpu_cores, devices) & trainer_cpus)
    return max(1, len(trainer_cpus) // (trainer.processes + sharing))


def rl_trainer_launch(config: RunConfig, paths: RunPaths, machine: Machine | None = None) -> TrainerLaunch:
    """The RL trainer of the run on ``machine`` (default: this one, detected now): the private
    config, `logs/trainer.log`, metrics in `trainer-metrics.jsonl` of the work directory,
    ``trainer.processes`` processes per node on ``trainer.nodes`` nodes meeting at
    ``trainer.rendezvous``, its device set mapped by :func:`~asyncrl.tasks.run.devices.place`
    (``CUDA_VISIBLE_DEVICES`` on a GPU machine, CPU pinning on one without; else pinned to
    ``trainer.cpu_cores``), with :func:`rl_trainer_threads` CPU threads per process. Call it
    where the trainer starts: device ids mean that machine's devices."""
    machine = machine or detect_machine()
    trainer = config.trainer
    placement = trainer_placement(config, machine)
    return TrainerLaunch(
        config_path=paths.private_config,
        log_path=paths.log("trainer.log"),
        mode="rl",
        work_dir=paths.work_dir / "trainer",
        metrics_file=paths.work_dir / "trainer-metrics.jsonl",
        nproc=trainer.processes,
        nnodes=trainer.nodes,
        rendezvous=trainer.rendezvous,
        cpu_cores=placement.cpu_cores,
        env={"OMP_NUM_THREADS": str(rl_trainer_threads(config, machine)), **placement.env},
    )
