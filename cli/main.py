"""The `asyncrl` command line.

The parser imports nothing heavy: torch, transformers and vLLM are imported inside the
command that needs them, so `asyncrl --help` and `asyncrl config show` are instant.

Errors a user can act on (a bad config or argument, a missing or unreadable file, a file that
is not UTF-8, a full disk, a storage fault its retries did not absorb) end the command with
one line on stderr, ``asyncrl COMMAND: error: ...``, and exit status 2 (fix the input) or 1
(the environment failed); ``--debug`` or ``ASYNCRL_DEBUG=1`` shows their traceback instead.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from asyncrl.configs.loading import ConfigError, frozen_yaml, load_config
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.errors import StorageOperationError
from asyncrl.cli.chaos import add_chaos_command
from asyncrl.cli.fleet import add_fleet_commands
from asyncrl.cli.lineage import add_lineage_commands
from asyncrl.cli.registry import add_registry_commands
from asyncrl.cli.replay import add_replay_command
from asyncrl.cli.bench import (
    add_ablation_bench,
    add_e2e_bench,
    add_learning_bench,
    add_rollout_bench,
    add_scale_bench,
    add_storage_bench,
    add_time_to_accuracy_bench,
    add_trainer_bench,
    add_trainer_memory_bench,
    add_weight_sync_bench,
)
from asyncrl.cli.reward import add_reward_bench, add_reward_commands


class CommandError(Exception):
    """An error the user can fix; printed without a traceback."""


def cmd_init_model(args: argparse.Namespace) -> int:
    from asyncrl.tasks.model.tiny import write_tiny_model

    out = write_tiny_model(Path(args.dir), seed=args.seed, overwrite=args.overwrite)
    print(f"wrote tiny Qwen2 model to {out}")
    return 0


def cmd_make_data(args: argparse.Namespace) -> int:
    from asyncrl.tasks.data.synthetic import SPLIT_FILES, check_output_dir, write_synthetic_splits

    check_output_dir(Path(args.dir))
    existing = [str(Path(args.dir) / name) for name in SPLIT_FILES.values() if (Path(args.dir) / name).exists()]
    if existing and not args.overwrite:
        verb = "already exists" if len(existing) == 1 else "already exist"
        raise CommandError(f"{', '.join(existing)}: {verb}; pass --overwrite to replace")
    paths = write_synthetic_splits(Path(args.dir), n_train=args.n_train, n_heldout=args.n_heldout, seed=args.seed)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """``config show CONFIG [KEY=VALUE...]`` prints the resolved config; ``config show
    [SECTION] [--markdown]`` prints the field reference (of every section, or of one)."""
    if args.config is not None and is_config_file(args.config):
        if args.markdown:
            raise CommandError(f"{args.config}: --markdown prints the field reference; give a SECTION or nothing")
        config = load_config(args.config, args.overrides)
        sys.stdout.write(frozen_yaml(config))
        return 0
    from asyncrl.configs.reference import markdown_reference, text_reference, unknown_section

    if args.overrides:
        raise CommandError(f"{' '.join(args.overrides)}: KEY=VALUE overrides apply to a config file, not to the reference")
    try:
        reference = (markdown_reference if args.markdown else text_reference)(args.config)
    except KeyError:
        raise CommandError(unknown_section(args.config)) from None
    sys.stdout.write(reference)
    return 0


def is_config_file(argument: str) -> bool:
    """``config show``'s argument names a config file (not a section): an existing file, or a
    name ending in ``.yaml`` / ``.yml`` (a missing one is then reported as such)."""
    return Path(argument).is_file() or argument.lower().endswith((".yaml", ".yml"))


def cmd_run(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's temporary local server waits 20 s by default; a busy 2-core machine needs more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    config = load_config(args.config, args.overrides)
    preflight_run(config)
    from asyncrl.cli.progress import live_progress
    from asyncrl.flows.pipeline import pipeline
    from asyncrl.tasks.launch.supervisor import ComponentFailed

    try:
        with live_progress(config), console_without_user_tracebacks(args.debug):
            summary = pipeline(config, refresh=args.refresh)
    except ComponentFailed as exc:  # its message names the component and carries its log tail
        print(f"asyncrl run: the run failed: {exc}", file=sys.stderr)
        return 1
    if summary.get("skipped"):  # data.require_new_files and no new train file: nothing trained
        print(f"asyncrl run: skipped: {summary['skipped']}")
        return 0
    print_summary(summary)
    return 0


def preflight_run(config: RunConfig) -> None:
    """What `asyncrl run` checks before Prefect starts, reading only: the run root was not
    started with other trajectory settings, and the model is there unless the run writes it."""
    from asyncrl.tasks.model.checks import require_model_dir
    from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
    from asyncrl.tasks.launch.context import check_resumable

    if not config.pipeline.init_tiny_model:
        require_model_dir(config.model.path)
    apply_storage_credentials(config.storage)
    check_resumable(config)


def print_summary(summary: dict[str, object]) -> None:
    def pct(value: object) -> str:
        return "n/a" if value is None else f"{100 * float(value):.1f}%"  # type: ignore[arg-type]

    print(f"held-out pass@1: {pct(summary['pass_at_1_before'])} before RL -> {pct(summary['pass_at_1_after'])} after")
    print(f"steps: {summary['steps']} (final weight version {summary['final_version']})")
    print(f"wall time: {float(summary['wall_s']):.0f} s (RL {float(summary['train_wall_s']):.0f} s)")  # type: ignore[arg-type]
    overlap = summary.get("overlap")
    if isinstance(overlap, dict) and overlap.get("rl_wall_s"):
        print(f"overlap factor: {overlap['overlap_factor']:.2f} = (generation busy {overlap['generation_busy_s']:.0f} s"
              f" + training busy {overlap['training_busy_s']:.0f} s) / RL wall {overlap['rl_wall_s']:.0f} s"
              " (1.0: run in turn, 2.0: two equal halves fully overlapped)")  # fmt: skip
    print(f"MLflow: {summary['mlflow_uri']} run {summary['mlflow_run_id']}")
    if summary.get("registered_model"):
        print(f"registered: models:/{summary['registered_model']}/{summary['registered_model_version']}")
    if summary.get("promotion"):
        print(f"promotion: {summary['promotion']}")
    print(f"storage: {summary['storage_root']} (summary.json there)")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the command too (``asyncrl run --debug ...``); unset, the top-level
    value (flag or ``ASYNCRL_DEBUG=1``) stands."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Fully asynchronous RL for reasoning language models, orchestrated by Prefect.",
    )
    parser.add_argument(
        "--debug", action="store_true", default=os.environ.get(DEBUG_ENV) == "1",
        help=f"show the traceback of an error instead of one line (also {DEBUG_ENV}=1)",
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    init_model = commands.add_parser("init-model", help="write a tiny HF-format Qwen2 model with a local tokenizer")
    init_model.add_argument("dir", help="output directory (must be empty or absent)")
    init_model.add_argument("--seed", type=int, default=0)
    init_model.add_argument("--overwrite", action="store_true", help="replace an existing model directory")
    init_model.set_defaults(handler=cmd_init_model)
    add_debug_flag(init_model)

    make_data = commands.add_parser("make-data", help="write the synthetic arithmetic task as Parquet splits")
    make_data.add_argument("dir", help="output directory for train.parquet and heldout.parquet")
    make_data.add_argument("--n-train", type=positive_int, default=4000, help="training problems (>= 1)")
    make_data.add_argument("--n-heldout", type=positive_int, default=200, help="held-out problems (>= 1)")
    make_data.add_argument("--seed", type=int, default=0)
    make_data.add_argument("--overwrite", action="store_true", help="replace existing train/heldout files")
    make_data.set_defaults(handler=cmd_make_data)
    add_debug_flag(make_data)

    config = commands.add_parser("config", help="inspect run configs")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser(
        "show",
        help="print a config with overrides, validated (secrets redacted), or the field reference",
        description="With a YAML run config: validate it with the overrides and print it (secrets redacted). "
        "Without one: print the field reference (key, type, default, meaning) of every section, "
        "or of SECTION (e.g. trainer, trainer.optimizer, pipeline.synthetic_data).",
    )
    show.add_argument("config", nargs="?", metavar="CONFIG|SECTION", help="YAML run config, or a config section")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as trainer.batch_groups=4")
    show.add_argument("--markdown", action="store_true", help="print the field reference as Markdown tables")
    show.set_defaults(handler=cmd_config_show)
    add_debug_flag(show)

    run = commands.add_parser("run", help="run the pipeline locally: data, SFT warm start, async RL, eval, register")
    run.add_argument("config", help="YAML run config, e.g. configs/demo.yaml")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as trainer.max_steps=4")
    run.add_argument("--refresh", action="store_true", help="redo the cached stages (data, model, SFT, evaluation)")
    run.set_defaults(handler=cmd_run)
    add_debug_flag(run)

    add_reward_commands(commands)
    add_lineage_commands(commands, add_debug_flag)
    add_registry_commands(commands, add_debug_flag)
    add_replay_command(commands, add_debug_flag)
    add_fleet_commands(commands, add_debug_flag)
    add_chaos_command(commands)
    bench = commands.add_parser("bench", help="benchmarks that print figures (table and JSON)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    add_reward_bench(bench_commands)
    add_trainer_bench(bench_commands)
    add_trainer_memory_bench(bench_commands)
    add_rollout_bench(bench_commands)
    add_e2e_bench(bench_commands)
    add_ablation_bench(bench_commands)
    add_time_to_accuracy_bench(bench_commands)
    add_learning_bench(bench_commands)
    add_storage_bench(bench_commands)
    add_weight_sync_bench(bench_commands)
    add_scale_bench(bench_commands)
    return parser


DEBUG_ENV = "ASYNCRL_DEBUG"
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CommandError, ValueError)
"""Reported with their own message, exit status 2 (``ValueError`` covers the dataset and
run-root errors, which name file, row and key)."""
USER_OS_ERRORS: tuple[type[OSError], ...] = (
    FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError,
)  # fmt: skip
"""A path the user gave that is missing, in the way or not theirs: exit status 2."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _os_error_text(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror and len(exc.args) >= 2:  # the OS's own form
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
        return f"{where}: {exc.strerror}"
    return str(exc)


def error_line(exc: BaseException) -> tuple[str, int] | None:
    """The one line and exit status an error a user can act on is reported with; None for
    anything else (a bug, whose traceback is shown)."""
    if isinstance(exc, StorageOperationError):
        return str(exc), 1
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = exc.filename if exc.filename is not None else "the disk"
        return f"{where}: no space left on device; free some space or choose another location", 1
    if isinstance(exc, UnicodeDecodeError):
        return (
            f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8 "
            f"(--debug or {DEBUG_ENV}=1 shows which file)"
        ), 2
    if isinstance(exc, USER_ERRORS):
        return str(exc), 2
    if isinstance(exc, OSError):
        return _os_error_text(exc), 2 if isinstance(exc, USER_OS_ERRORS) else 1
    return None


class _WithoutUserTracebacks(logging.Formatter):
    """Formats as ``inner`` does, leaving out the traceback of errors :func:`error_line`
    describes (the command reports them in one line); the record is left as it was."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or error_line(error) is None:
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


@contextmanager
def console_without_user_tracebacks(debug: bool) -> Iterator[None]:
    """While the block runs (unless ``debug``), the console handlers of the root logger (where
    Prefect's flow and task run logs are shown) print a user error's log line without its
    traceback; other handlers (Prefect's API log) keep it."""
    if debug:
        yield
        return
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    saved = [h.formatter for h in handlers]
    for handler, formatter in zip(handlers, saved):
        handler.setFormatter(_WithoutUserTracebacks(formatter))
    try:
        yield
    finally:
        for handler, formatter in zip(handlers, saved):
            handler.setFormatter(formatter)


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments, where KEY=VALUE overrides may also follow the options
    (``bench learning CONFIG --repeats 1 trainer.max_steps=4``), which argparse alone refuses
    once the options have ended the positional list; anything else left over is an error."""
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra and (len(overrides) < len(extra) or not isinstance(getattr(args, "overrides", None), list)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(build_parser(), argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except Exception as exc:
        described = error_line(exc)
        if described is None or args.debug:
            raise
        message, status = described
        print(f"asyncrl {args.command}: error: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
