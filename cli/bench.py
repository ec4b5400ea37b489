"""The ``asyncrl bench`` sub-commands: each benchmark's options and the handler it runs. The
benchmarks' logic stays in ``bench/``; their parsers live here, with the other commands'."""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.bench.ablation import AblationSettings, cmd_bench_ablation
from asyncrl.bench.e2e import cmd_bench_e2e
from asyncrl.bench.e2e_settings import DEFAULT_CONFIG as E2E_CONFIG, E2EBenchSettings, WORKLOADS
from asyncrl.bench.learning_check import cmd_bench_learning
from asyncrl.bench.rollout import RolloutBenchSettings, cmd_bench_rollout
from asyncrl.bench.scale import cmd_bench_scale
from asyncrl.bench.scale_settings import DEFAULT_CONFIG as SCALE_CONFIG, DEFAULT_SIZES, SIZE_SPECS, ScaleBenchSettings
from asyncrl.bench.storage import StorageBenchSettings, cmd_bench_storage
from asyncrl.bench.sweep_checks import parse_int_list
from asyncrl.bench.time_to_accuracy import TimeToAccuracySettings, cmd_bench_time_to_accuracy
from asyncrl.bench.trainer import TrainerBenchSettings, cmd_bench_trainer
from asyncrl.bench.trainer_memory import GLIBC_DEFAULT, MemorySettings, cmd_bench_trainer_memory
from asyncrl.bench.weight_sync import cmd_bench_weight_sync
from asyncrl.bench.weight_sync_settings import SERVER_DTYPES, SIZES, WeightSyncBenchSettings


MOVED_OPTIONS: types.MappingProxyType[str, str] = types.MappingProxyType({
    "--steps": "trainer.max_steps",
    "--batch-groups": "trainer.batch_groups",
    "--n-samples": "rollout.n_samples",
    "--max-new-tokens": "rollout.max_new_tokens",
    "--micro-batch-tokens": "trainer.micro_batch_tokens",
    "--logit-chunk-tokens": "trainer.logit_chunk_tokens",
    "--activation-checkpointing": "trainer.activation_checkpointing",
    "--zero-stage": "trainer.zero_stage",
    "--eta": "rollout.eta",
    "--seed": "seed",
    "--max-groups-in-flight": "rollout.max_groups_in_flight",
    "--rollout-cores": "inference.cpu_cores",
    "--trainer-cores": "trainer.cpu_cores",
})
"""Former options of ``bench e2e`` and ``bench scale`` and the run config key that replaced each."""
FLAG_OPTIONS = frozenset({"--activation-checkpointing"})


def comma_list(text: str) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")`` (empty parts dropped)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def moved_override(key: str, value: str | None) -> str:
    """What to pass instead of ``--option value``: ``key=value``, CPU lists in brackets."""
    if value is None:
        return f"{key}=VALUE"
    if key.endswith("cpu_cores"):
        if value.strip().lower() == "auto":
            return f"nothing ({key} unset: the bench splits the CPUs between the server and the trainer)"
        return f"{key}=null" if value.strip().lower() == "none" else f"{key}=[{value}]"
    return f"{key}={value}"


class MovedToRunConfig(argparse.Action):
    """A former option that a run config key replaced: using it is an error naming the key and
    the override to pass instead (hidden from ``--help``, listed in its epilog)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        flag = option_strings[0] in FLAG_OPTIONS
        super().__init__(option_strings, dest, nargs=0 if flag else "?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        option = self.option_strings[0]
        key = MOVED_OPTIONS[option]
        value = "true" if self.nargs == 0 else values
        parser.error(f"{option} is now the run config key {key}: pass {moved_override(key, value)}")


def add_run_config_arguments(parser: argparse.ArgumentParser, default: Path, moved: Sequence[str]) -> None:
    """``[CONFIG] [KEY=VALUE ...]`` and ``--config``: the run config every run of the bench
    starts from (``default`` when none is given) and its overrides; ``moved``: the former
    options a run config key replaced (:class:`MovedToRunConfig`)."""
    parser.add_argument("overrides", nargs="*", metavar="[CONFIG] KEY=VALUE",
                        help=f"a run config (YAML; default configs/{default.name}), then a.b=value overrides of it")  # fmt: skip
    parser.add_argument("--config", default=None, help="the run config (YAML), as CONFIG")
    for option in moved:
        parser.add_argument(option, action=MovedToRunConfig)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "run config keys in place of former options:\n" + "\n".join(f"  {o:26} {MOVED_OPTIONS[o]}" for o in moved)


def add_ablation_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``ablation`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "ablation", help="held-out accuracy for eta in {0, 4, 8} with the decoupled objective and standard PPO"
    )
    defaults = AblationSettings()
    parser.add_argument("config", help="run config (YAML) whose warm start and RL settings every run shares")
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides of the config")
    parser.add_argument("--etas", type=parse_int_list, default=defaults.etas, help="comma-separated staleness bounds (default 0,4,8)")
    parser.add_argument("--objectives", type=comma_list, default=defaults.objectives,
                        help="comma-separated: decoupled,standard (default both)")  # fmt: skip
    parser.add_argument("--adaptive", type=parse_int_list, default=defaults.adaptive_etas,
                        help="comma-separated bounds to run again with adaptive staleness (default none)")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every, help="evaluate every N versions (0: first and last)")
    parser.add_argument("--smooth", type=int, default=defaults.smooth, help="reward curve moving-mean window (steps)")
    parser.add_argument("--work-dir", default=None, help="run roots, MLflow and logs (default <work_dir>/<name>-ablation)")
    parser.add_argument("--json", default=None, help="result JSON (default <work-dir>/ablation.json)")
    parser.add_argument("--png", default=None, help="curves PNG (default <work-dir>/ablation.png)")
    parser.set_defaults(handler=cmd_bench_ablation)
    return parser


def add_e2e_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``e2e`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "e2e", help="async speed-up end to end: eta = 0 vs eta > 0 in both interrupt modes, and the ideal overlap bound"
    )
    defaults = E2EBenchSettings()
    add_run_config_arguments(parser, E2E_CONFIG, ("--steps", "--batch-groups", "--n-samples", "--max-new-tokens", "--seed",
                                                  "--max-groups-in-flight", "--rollout-cores", "--trainer-cores"))  # fmt: skip
    parser.add_argument("--etas", type=parse_int_list, default=defaults.etas, help="comma-separated, must include 0 (default 0,1,2,4,8)")
    parser.add_argument("--modes", type=comma_list, default=defaults.modes, help="comma-separated interrupt modes (default recompute,keep)")
    parser.add_argument("--workload", choices=list(WORKLOADS), default=defaults.workload,
                        help="balanced (default), generation-bound (4x longer outputs) or mixed (half code, scored in the sandbox): "
                             "overrides applied before yours")  # fmt: skip
    parser.add_argument("--gpus", type=parse_int_list, default=None,
                        help="GPU ids: one, shared by the rollout server and the trainer, or server,trainer "
                             "(default: none, CPUs split between them unless the config places them)")  # fmt: skip
    parser.add_argument("--work-dir", default=None, help="keep the model, prompts, run roots and logs here")
    parser.add_argument("--json", default=None, help="also write the result as JSON here (updated after every run)")
    parser.set_defaults(handler=cmd_bench_e2e)
    return parser


def add_learning_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``learning`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "learning", help="held-out pass@1 gain of the config's RL over N runs from one warm start; fails below --min-gain"
    )
    parser.add_argument("config", help="run config (YAML), e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides of the config")
    parser.add_argument("--repeats", type=int, default=3, help="RL runs, seeds seed..seed+N-1 (default 3)")
    parser.add_argument("--min-gain", type=float, default=None, help="fail (exit 1) when the mean gain in points is below this")
    parser.add_argument("--work-dir", default=None, help="run roots, MLflow and logs (default <work_dir>/<name>-learning)")
    parser.add_argument("--json", default=None, help="result JSON (default <work-dir>/learning.json)")
    parser.set_defaults(handler=cmd_bench_learning)
    return parser


def add_rollout_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register `rollout` on the `bench` sub-command."""
    parser = subparsers.add_parser("rollout", help="vLLM tokens/s by concurrency and weight-update stall by mode")
    defaults = RolloutBenchSettings()
    parser.add_argument("--model", default=None, help="HF model directory (default: a fresh tiny Qwen2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(defaults.concurrencies))
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--updates", type=int, default=defaults.updates_per_mode, help="weight updates per mode")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--worker-in-own-process", action="store_true",
                        help="run vLLM's model worker in a process of its own (vLLM's CPU default)")
    parser.add_argument("--spawn-engine-core", action="store_true",
                        help="spawn vLLM's engine core as vLLM's CPU platform asks, instead of forking it")
    parser.add_argument("--work-dir", default=None,
                        help="keep the model, weight versions and server log here (default: a temporary directory, removed)")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    parser.set_defaults(handler=cmd_bench_rollout)
    return parser


def add_scale_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``scale`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "scale", help="RL step, publish, fetch, load, stall and peak memory from 5M to 0.5B parameters, and their exponents"
    )
    defaults = ScaleBenchSettings()
    add_run_config_arguments(parser, SCALE_CONFIG, ("--steps", "--eta", "--batch-groups", "--n-samples", "--max-new-tokens",
                                                    "--micro-batch-tokens", "--logit-chunk-tokens", "--activation-checkpointing",
                                                    "--zero-stage", "--seed"))  # fmt: skip
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                        help=f"comma-separated sizes of {', '.join(SIZE_SPECS)}, run smallest first "
                             f"(default {','.join(DEFAULT_SIZES)})")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help=f"fresh versions published, fetched and loaded per size (default {defaults.repeats})")
    parser.add_argument("--gpus", type=parse_int_list, default=None,
                        help="GPU ids: one, shared by the rollout server and the trainer, or server,trainer "
                             "(default: none; the CPUs are split between them unless the config places them)")  # fmt: skip
    parser.add_argument("--work-dir", default=None,
                        help="models, prompts, runs and logs, one directory per size (a size's model is reused)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the result as JSON here (after every size)")
    parser.add_argument("--png", default=None, help="also plot each cost against parameters (log-log) to this PNG")
    parser.set_defaults(handler=cmd_bench_scale)
    return parser


def add_storage_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``storage`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "storage", help="storage operations and seconds per training step, early vs late in a synthetic run"
    )
    defaults = StorageBenchSettings()
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps to run")
    parser.add_argument("--sample-at", type=parse_int_list, default=defaults.sample_at,
                        help="comma-separated steps to report (default 10,1000); the ratio is last/first")  # fmt: skip
    parser.add_argument("--window", type=int, default=defaults.window, help="steps averaged at each sample point")
    parser.add_argument("--shards-per-step", type=int, default=defaults.shards_per_step)
    parser.add_argument("--groups-per-shard", type=int, default=defaults.groups_per_shard)
    parser.add_argument("--max-ops-ratio", type=float, default=defaults.max_ops_ratio,
                        help="exit 1 if ops/step at the last sample exceed this multiple of the first")  # fmt: skip
    parser.add_argument("--s3-endpoint", default=None,
                        help="also run on this S3 endpoint (credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")  # fmt: skip
    parser.add_argument("--s3-bucket", default="asyncrl-bench", help="bucket on --s3-endpoint (created if missing)")
    parser.add_argument("--work-dir", default=None, help="keep the local run root here (default: a temporary dir)")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    parser.set_defaults(handler=cmd_bench_storage)
    return parser


def add_time_to_accuracy_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``time-to-accuracy`` on the ``bench`` sub-command."""
    defaults = TimeToAccuracySettings()
    parser = subparsers.add_parser(
        "time-to-accuracy",
        help="held-out pass@1 against wall time: synchronous run vs asynchronous arms, from one warm start",
    )
    parser.add_argument("config", help="run config (YAML), e.g. configs/reasoning.yaml")
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides of the config")
    parser.add_argument("--etas", type=parse_int_list, default=defaults.etas, help="comma-separated, with 0 (default 0,2)")
    parser.add_argument("--modes", type=comma_list, default=defaults.modes, help="interrupt modes of eta > 0 (default keep)")
    parser.add_argument("--seeds", type=parse_int_list, default=defaults.seeds, help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--objective-etas", type=parse_int_list, default=defaults.objective_etas,
                        help="also run standard PPO beside decoupled at these etas, e.g. 4,8 (default none)")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every,
                        help="evaluate every N versions (default trainer.max_steps // 6)")
    parser.add_argument("--smooth", type=int, default=defaults.smooth, help="centred moving mean over N evaluated versions (odd)")
    parser.add_argument("--work-dir", default=None, help="run roots, MLflow and logs (default <work_dir>/<name>-time-to-accuracy)")
    parser.add_argument("--json", default=None, help="result JSON (default <work-dir>/time-to-accuracy.json)")
    parser.add_argument("--png", default=None, help="curves PNG (default <work-dir>/time-to-accuracy.png)")
    parser.set_defaults(handler=cmd_bench_time_to_accuracy)
    return parser


def add_trainer_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``trainer`` on a ``bench`` sub-command's subparsers (handler in ``handler``)."""
    parser = subparsers.add_parser(
        "trainer", help="trained tokens/s and packing efficiency: dynamic vs fixed-count micro-batches"
    )
    defaults = TrainerBenchSettings()
    parser.add_argument("--model", default=None, help="HF model directory (default: a fresh tiny Qwen2)")
    parser.add_argument("--sequences", type=int, default=defaults.sequences)
    parser.add_argument("--min-len", type=int, default=defaults.min_len)
    parser.add_argument("--max-len", type=int, default=defaults.max_len)
    parser.add_argument("--budget", type=int, default=defaults.budget, help="micro-batch token budget")
    parser.add_argument("--fixed-count", type=int, default=defaults.fixed_count, help="sequences per fixed micro-batch")
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3), help="trainer.zero_stage (default 1)")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    parser.set_defaults(handler=cmd_bench_trainer)
    return parser


def add_trainer_memory_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``trainer-memory`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "trainer-memory", help="the trainer's resident memory per phase (steps and a publish) and step seconds, by malloc heap and ZeRO stage"
    )
    defaults = MemorySettings(model_dir=Path())
    parser.add_argument("--model", default=None, help="HF model directory to train (or --size)")
    parser.add_argument("--size", default=None, help=f"write and train a random Qwen2 of this size: {', '.join(SIZE_SPECS)}")
    parser.add_argument("--work-dir", default=None, help="where --size writes its model (reused when it holds one)")
    parser.add_argument("--heaps", default=f"{GLIBC_DEFAULT},1",
                        help="comma-separated heaps, each measured in its own process: glibc (its own settings) "
                             "or an mmap threshold in MiB (the trainer's: 1); default glibc,1")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help=f"positions of the micro-batch (default {defaults.tokens})")
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"steps per heap (default {defaults.steps})")
    parser.add_argument("--logit-chunk-tokens", type=int, default=defaults.logit_chunk_tokens,
                        help=f"trainer.logit_chunk_tokens (default {defaults.logit_chunk_tokens}; 0: whole)")  # fmt: skip
    parser.add_argument("--no-activation-checkpointing", action="store_true", help="keep every layer's activations")
    parser.add_argument("--zero-stage", type=int, default=defaults.zero_stage, help=f"trainer.zero_stage (default {defaults.zero_stage})")
    parser.add_argument("--world-size", type=int, default=defaults.world_size,
                        help=f"ranks of the engine, under torchrun above 1 (default {defaults.world_size}); "
                             "with --zero-stage 3 the publish gathers one parameter at a time")  # fmt: skip
    parser.add_argument("--zero3-live-elements", type=int, default=defaults.zero3_live_elements,
                        help=f"trainer.zero3_live_elements (default {defaults.zero3_live_elements:,}; 0: DeepSpeed's defaults)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    parser.set_defaults(handler=cmd_bench_trainer_memory)
    return parser


def add_weight_sync_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``weight-sync`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "weight-sync", help="publish, fetch and in-place vLLM load of a 0.5B checkpoint, against disk and memory"
    )
    defaults = WeightSyncBenchSettings()
    parser.add_argument("--size", choices=SIZES, default=defaults.size,
                        help="model preset: 0.5b (Qwen2.5-0.5B shape, bf16) or tiny (3 M parameters)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="fresh versions per backend")
    parser.add_argument("--probe-mib", type=int, default=defaults.probe_mib,
                        help="MiB of the disk and memory link probes (a multiple of 8)")  # fmt: skip
    parser.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib)
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--server-dtype", choices=SERVER_DTYPES, default=defaults.server_dtype,
                        help="the rollout server's dtype (the checkpoint is bfloat16)")  # fmt: skip
    parser.add_argument("--s3-endpoint", default=None,
                        help="also run on this S3 endpoint (credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")  # fmt: skip
    parser.add_argument("--s3-bucket", default="asyncrl-bench", help="bucket on --s3-endpoint (created if missing)")
    parser.add_argument("--work-dir", default=None, help="keep model, stores and caches here (default: a temporary dir)")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="instead: publish and load rank-RANK LoRA adapters of the model into a LoRA server")  # fmt: skip
    parser.set_defaults(handler=cmd_bench_weight_sync)
    return parser
