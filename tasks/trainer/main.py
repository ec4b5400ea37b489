"""Trainer process entry point: ``python -m asyncrl.tasks.trainer.main --config PROCESS.yaml``
(:class:`~asyncrl.configs.processes.TrainerProcessConfig`, written by the launcher).

One process on CPU (gloo; missing rendezvous variables filled in) or one per device under
``deepspeed``/``torchrun`` (data parallel, see :mod:`asyncrl.tasks.trainer.step`). The
config is parsed before torch is imported, so a bad config fails at once; rank 0 alone
writes the published weights (every rank takes part in ZeRO 3's gathers), logs metrics and
prints the ``{"event": ...}`` lines. Modes: ``rl`` (default)
resumes or starts the loop of :mod:`asyncrl.tasks.trainer.loop` to ``trainer.max_steps``;
``sft`` fine-tunes on reference answers and publishes the warm start as the next version.
Exit status: 0 done, 2 bad config or arguments, 3 bad trajectory input (nothing consumed),
4 timed out waiting for trajectories, 1 anything else (traceback on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.configs.loading import ConfigError, frozen_yaml, load_process_config
from asyncrl.configs.processes import TrainerProcessConfig
from asyncrl.configs.trainer import OptimizerConfig
from asyncrl.tasks.system.host_memory import return_freed_memory_to_os

if TYPE_CHECKING:
    from asyncrl.storage.fs import RunRoot

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_INPUT, EXIT_TIMEOUT = 0, 1, 2, 3, 4
logger = logging.getLogger("asyncrl.trainer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.tasks.trainer.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the trainer's process config (RunPaths.process_config)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. trainer.max_steps=4")
    parser.add_argument("--mode", choices=("rl", "sft"), default="rl")
    parser.add_argument("--work-dir", type=Path, default=None, help="local scratch directory (default: WORK_DIR/NAME/trainer of the config)")
    parser.add_argument("--metrics-file", type=Path, default=None, help="JSON Lines metrics (default: WORK_DIR/metrics.jsonl)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between looks for new shards")
    parser.add_argument("--wait-timeout", type=float, default=None, help="give up after waiting this long for one batch")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT: optimizer updates (default: pipeline.sft_steps)")
    parser.add_argument("--sft-batch-size", type=int, default=None, help="SFT: examples per update (default: pipeline.sft_batch_size)")
    return parser


class LogSink:
    """Metrics sink that logs one short line per step."""

    KEYS = ("version", "loss", "sft_loss", "reward_mean", "staleness_max", "dropped_stale", "tokens_per_s", "step_time_s")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in self.KEYS if k in metrics)
        logger.info("step %d %s", step, shown)


def initial_model_dir(
    root: RunRoot, model_path: str, work_dir: Path, *, fetch: bool = True, base: bool = False, first: bool = False
) -> tuple[Path, int | None]:
    """The weights the engine starts from: the store's latest version, else ``model.path``
    (:func:`~asyncrl.tasks.model.weight_fetch.model_weights`, cached in ``work_dir/weights-cache``,
    older versions pruned). Returns (local directory, version or None). With ``fetch`` False
    nothing is downloaded: the directory another process of the node fills. With ``base``
    ``model.path`` whatever the store holds (a LoRA run's frozen base), version None. With
    ``first`` the store's lowest version instead of its latest (the run's first weights,
    which retention always keeps: the KL penalty's reference)."""
    from asyncrl.storage.weights import WeightStore
    from asyncrl.tasks.model.weight_fetch import model_weights, prune_weight_cache

    store = WeightStore(root)
    if base:
        version = None
    elif first:
        version = min(store.list_versions(), default=None)
    else:
        version = store.latest()
    cache = work_dir / "weights-cache"
    model_dir = model_weights(root, model_path, version, cache, fetch=fetch)
    if fetch and version is not None and not first:  # the engine's weights: older cached versions go
        prune_weight_cache(cache, root.uri, version)
    return model_dir, version


def node_model_dir(
    root: RunRoot, model_path: str, work_dir: Path, *, base: bool = False, first: bool = False
) -> tuple[Path, int | None]:
    """:func:`initial_model_dir` for every process of the trainer (collective): the node's
    leader fetches into the node's ``work_dir``, the others wait for it (one download per
    node, not per process); every rank checks it holds the version rank 0 chose."""
    from asyncrl.tasks.trainer.data_parallel import broadcast_from_rank0, is_node_leader, run_and_agree
    from asyncrl.tasks.trainer.engine import init_distributed

    init_distributed()
    chosen = broadcast_from_rank0(
        lambda: initial_model_dir(root, model_path, work_dir, fetch=False, base=base, first=first)[1]
    )

    def fetch() -> tuple[Path, int | None]:
        found = initial_model_dir(root, model_path, work_dir, fetch=is_node_leader(), base=base, first=first)
        if found[1] != chosen:
            raise RuntimeError(
                f"the weight store changed while the trainer started: rank 0 chose version {chosen}, this rank {found[1]}"
            )
        return found

    # Collective: returns once every leader's download is done.
    return run_and_agree(fetch, "fetching the initial weights")


def lora_start(
    root: RunRoot, config: TrainerProcessConfig, model_dir: Path, version: int | None, work_dir: Path
) -> tuple[Path, Path | None]:
    """(base directory, initial adapter directory or None) of a LoRA run whose latest weights
    are ``model_dir`` (version ``version``, :func:`node_model_dir`): the base is always
    ``model.path`` (collective, like :func:`node_model_dir`); the adapters start from the
    latest version when it is an adapter, fresh when nothing is published. A published version
    with full weights (a run that started without ``trainer.lora``) is a :class:`ConfigError`."""
    from asyncrl.tasks.model.lora_adapter import is_adapter_dir

    base_dir, _ = node_model_dir(root, config.model.path, work_dir, base=True)
    if is_adapter_dir(model_dir):
        return base_dir, model_dir
    if version is not None and Path(model_dir) != Path(base_dir):
        raise ConfigError(
            f"trainer.lora: the latest weight version {version} holds full weights, not a LoRA adapter "
            "(a run trains adapters from its first version or not at all)"
        )
    return base_dir, None


def _engine(  # noqa: ANN202
    config: TrainerProcessConfig,
    model_dir: Path,
    total_updates: int,
    optimizer: OptimizerConfig,
    initial_adapter: Path | None = None,
):
    """The DeepSpeed engine (a TrainEngine, imported lazily) with ``optimizer``;
    ``total_updates`` sets the length of a decaying learning-rate schedule. With
    ``trainer.lora``, ``model_dir`` is the frozen base and ``initial_adapter`` the adapter
    the run goes on from (:func:`lora_start`)."""
    from asyncrl.tasks.trainer.engine import EngineSettings, build_engine

    settings = EngineSettings(
        optimizer=optimizer,
        zero_stage=config.trainer.zero_stage,
        dtype=config.model.dtype,
        seed=config.seed,
        total_updates=total_updates,
        logit_chunk_tokens=config.trainer.logit_chunk_tokens,
        activation_checkpointing=config.trainer.activation_checkpointing,
        zero3_live_elements=config.trainer.zero3_live_elements,
        lora=config.trainer.lora,
        initial_adapter=initial_adapter,
        base_model_reference=config.model.path,
        deterministic=config.trainer.deterministic,
    )
    return build_engine(model_dir, settings)


def run_rl(config: TrainerProcessConfig, args: argparse.Namespace, work_dir: Path, metrics_file: Path) -> int:
    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.trainer.loop import LoopSettings, RLTrainer
    from asyncrl.tasks.trainer.metrics import FanoutSink, JsonlMetricsSink
    from asyncrl.tasks.trainer.rl_settings import RLSettings

    root = open_root(config.storage.root, config.storage.options)
    model_dir, latest = node_model_dir(root, config.model.path, work_dir)
    adapter = None
    if config.trainer.lora is not None:
        model_dir, adapter = lora_start(root, config, model_dir, latest, work_dir)
    total_updates = config.trainer.max_steps * config.trainer.mini_batches
    engine = _engine(config, model_dir, total_updates, config.trainer.optimizer, adapter)
    reference = None
    if config.trainer.kl_coef > 0:
        from asyncrl.tasks.trainer.reference import load_reference

        first_dir = None if config.trainer.lora is not None else node_model_dir(root, config.model.path, work_dir, first=True)[0]
        reference = load_reference(engine, first_dir)
    loop = LoopSettings.from_config(config.trainer, config.max_staleness, args.poll_interval, args.wait_timeout)
    source = None
    if config.replay_of is not None:
        from asyncrl.tasks.trainer.step_source import LedgerReplay

        original = open_root(config.replay_of.root, config.replay_of.options)
        source = LedgerReplay(original, config.name, engine.vocab_size, config.trainer.micro_batch_tokens)
    trainer = RLTrainer(
        root,
        config.name,
        engine,
        RLSettings.from_config(config.trainer, config.max_staleness, config.pass_k),
        loop,
        work_dir,
        FanoutSink([JsonlMetricsSink(metrics_file), LogSink()]),
        reference,
        source,
    )
    report = trainer.start()
    if engine.rank == 0:
        print(
            json.dumps(
                {
                    "event": "start",
                    "step": report.state.step,
                    "version": report.state.version,
                    "resumed_from": report.resumed_from,
                    "rolled_back": list(report.rolled_back),
                    "published_initial": report.published_initial,
                    "world_size": engine.world_size,
                }
            ),
            flush=True,
        )
    state = trainer.run()
    if engine.rank == 0:
        print(json.dumps({"event": "done", "step": state.step, "version": state.version}), flush=True)
    return EXIT_OK


def run_sft_mode(config: TrainerProcessConfig, args: argparse.Namespace, work_dir: Path, metrics_file: Path) -> int:
    from asyncrl.storage.fs import open_root
    from asyncrl.storage.weights import WeightStore
    from asyncrl.tasks.data.loader import load_prompts
    from asyncrl.tasks.trainer.loop import publish_weights
    from asyncrl.tasks.trainer.metrics import FanoutSink, JsonlMetricsSink
    from asyncrl.tasks.trainer.data_parallel import barrier
    from asyncrl.tasks.trainer.sft import SFTSettings, run_sft, sft_sequences

    steps = config.pipeline.sft_steps if args.sft_steps is None else args.sft_steps
    if steps < 1:
        raise ConfigError(f"pipeline.sft_steps: SFT mode needs at least 1 step, got {steps} (or pass --sft-steps)")
    root = open_root(config.storage.root, config.storage.options)
    model_dir, parent = node_model_dir(root, config.model.path, work_dir)
    adapter = None
    if config.trainer.lora is not None:
        model_dir, adapter = lora_start(root, config, model_dir, parent, work_dir)
    engine = _engine(config, model_dir, steps, config.pipeline.sft_optimizer or config.trainer.optimizer, adapter)
    sft_path = config.data.sft_path or config.data.train_path
    records = load_prompts(sft_path, plugins=config.reward.plugins)
    sequences = sft_sequences(records, engine.tokenizer, config.data.prompt_format, config.reward.code.extract)
    settings = SFTSettings(
        steps=steps,
        batch_size=args.sft_batch_size or config.pipeline.sft_batch_size,
        micro_batch_tokens=config.trainer.micro_batch_tokens,
        packer=config.trainer.packer,
        seed=config.seed,
    )
    writer = engine.rank == 0
    sink = FanoutSink([JsonlMetricsSink(metrics_file), LogSink()]) if writer else None
    losses = run_sft(engine, sequences, settings, sink)
    version = 0 if parent is None else parent + 1
    lineage = {"parent_version": parent, "stage": "sft", "steps": settings.steps, "data": sft_path}
    publish_weights(WeightStore(root), engine, version, lineage, work_dir)
    if writer:
        print(json.dumps({"event": "done", "mode": "sft", "version": version, "final_loss": losses[-1]}), flush=True)
    barrier()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Before the model exists: a backward pass's freed temporaries then leave the process.
    return_freed_memory_to_os()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = load_process_config(args.config, TrainerProcessConfig, args.overrides)
    except ConfigError as exc:
        print(f"trainer: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if os.environ.get("RANK", "0") == "0":
        logger.info("config (secrets redacted):\n%s", frozen_yaml(config))
    work_dir = args.work_dir or config.run_work_dir / "trainer"
    work_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = args.metrics_file or work_dir / "metrics.jsonl"

    from asyncrl.storage.errors import ShardValidationError
    from asyncrl.tasks.model.checks import ModelPathError
    from asyncrl.tasks.trainer.feed import TrainerInputError
    from asyncrl.tasks.trainer.loop import TrainerWaitTimeout

    try:
        if args.mode == "sft":
            return run_sft_mode(config, args, work_dir, metrics_file)
        return run_rl(config, args, work_dir, metrics_file)
    except (ConfigError, ModelPathError) as exc:
        print(f"trainer: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (TrainerInputError, ShardValidationError) as exc:
        print(f"trainer: bad input, nothing consumed: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except TrainerWaitTimeout as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT


if __name__ == "__main__":
    sys.exit(main())
