"""The `asyncrl` command line.

The parser imports nothing heavy: torch, transformers and vLLM are imported inside the
command that needs them, so `asyncrl --help` and `asyncrl config show` are instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncrl.configs.loading import ConfigError, frozen_yaml, load_config
from asyncrl.bench.ablation import add_ablation_bench
from asyncrl.bench.e2e import add_e2e_bench
from asyncrl.cli.chaos import add_chaos_command
from asyncrl.tasks.reward.cli import add_reward_bench, add_reward_commands
from asyncrl.tasks.rollout.bench import add_rollout_bench
from asyncrl.tasks.trainer.bench import add_trainer_bench


class CommandError(Exception):
    """An error the user can fix; printed without a traceback."""


def cmd_init_model(args: argparse.Namespace) -> int:
    from asyncrl.tasks.model.tiny import write_tiny_model

    out = write_tiny_model(Path(args.dir), seed=args.seed, overwrite=args.overwrite)
    print(f"wrote tiny Qwen2 model to {out}")
    return 0


def cmd_make_data(args: argparse.Namespace) -> int:
    from asyncrl.tasks.data.synthetic import write_synthetic_splits

    paths = write_synthetic_splits(Path(args.dir), n_train=args.n_train, n_heldout=args.n_heldout, seed=args.seed)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    sys.stdout.write(frozen_yaml(config))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's temporary local server waits 20 s by default; a busy 2-core machine needs more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    config = load_config(args.config, args.overrides)
    from asyncrl.cli.progress import live_progress
    from asyncrl.flows.pipeline import pipeline
    from asyncrl.tasks.run.supervisor import ComponentFailed

    try:
        with live_progress(config):
            summary = pipeline(config, refresh=args.refresh)
    except ComponentFailed as exc:  # its message names the component and carries its log tail
        print(f"asyncrl run: the run failed: {exc}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


def print_summary(summary: dict[str, object]) -> None:
    def pct(value: object) -> str:
        return "n/a" if value is None else f"{100 * float(value):.1f}%"  # type: ignore[arg-type]

    print(f"held-out pass@1: {pct(summary['pass_at_1_before'])} before RL -> {pct(summary['pass_at_1_after'])} after")
    print(f"steps: {summary['steps']} (final weight version {summary['final_version']})")
    print(f"wall time: {float(summary['wall_s']):.0f} s (RL {float(summary['train_wall_s']):.0f} s)")  # type: ignore[arg-type]
    print(f"MLflow: {summary['mlflow_uri']} run {summary['mlflow_run_id']}")
    if summary.get("registered_model"):
        print(f"registered: models:/{summary['registered_model']}@best (version {summary['registered_model_version']})")
    print(f"storage: {summary['storage_root']} (summary.json there)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Fully asynchronous RL for reasoning language models, orchestrated by Prefect.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    init_model = commands.add_parser("init-model", help="write a tiny HF-format Qwen2 model with a local tokenizer")
    init_model.add_argument("dir", help="output directory (must be empty or absent)")
    init_model.add_argument("--seed", type=int, default=0)
    init_model.add_argument("--overwrite", action="store_true", help="replace an existing model directory")
    init_model.set_defaults(handler=cmd_init_model)

    make_data = commands.add_parser("make-data", help="write the synthetic arithmetic task as Parquet splits")
    make_data.add_argument("dir", help="output directory for train.parquet and heldout.parquet")
    make_data.add_argument("--n-train", type=int, default=4000)
    make_data.add_argument("--n-heldout", type=int, default=200)
    make_data.add_argument("--seed", type=int, default=0)
    make_data.set_defaults(handler=cmd_make_data)

    config = commands.add_parser("config", help="inspect run configs")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="validate a config with overrides and print it (secrets redacted)")
    show.add_argument("config", help="YAML run config")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as trainer.batch_groups=4")
    show.set_defaults(handler=cmd_config_show)

    run = commands.add_parser("run", help="run the pipeline locally: data, SFT warm start, async RL, eval, register")
    run.add_argument("config", help="YAML run config, e.g. configs/demo.yaml")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as trainer.max_steps=4")
    run.add_argument("--refresh", action="store_true", help="redo the cached stages (data, model, SFT, evaluation)")
    run.set_defaults(handler=cmd_run)

    add_reward_commands(commands)
    add_chaos_command(commands)
    bench = commands.add_parser("bench", help="benchmarks that print figures (table and JSON)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    add_reward_bench(bench_commands)
    add_trainer_bench(bench_commands)
    add_rollout_bench(bench_commands)
    add_e2e_bench(bench_commands)
    add_ablation_bench(bench_commands)
    return parser


USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CommandError, FileExistsError, FileNotFoundError, ValueError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except USER_ERRORS as exc:
        print(f"asyncrl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
