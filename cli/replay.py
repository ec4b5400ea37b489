"""``asyncrl replay RUN_ROOT`` and ``asyncrl compare RUN_A RUN_B``.

Replay: the trainer alone over a run's ledger, every weight version
compared with the original's (:mod:`asyncrl.tasks.pipeline.replay`); with trainer overrides,
a fork on the same samples. Exit status: 0 every version identical (or a fork trained), 1 a
version of a replay differs (the first is named), 2 a run root that cannot be replayed (what
is missing is named)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def cmd_replay(args: argparse.Namespace) -> int:
    from asyncrl.tasks.pipeline.replay import ReplayRequest, replay_run

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    work = Path(args.work_dir) if args.work_dir else Path("runs") / "replay"
    report = replay_run(ReplayRequest(args.root, work, to=args.to, overrides=tuple(args.overrides), from_step=args.from_step))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    first = report["first_difference"]
    print(f"replayed {report['steps']} steps of {report['original']} into {report['replay']} in {report['wall_s']:.0f} s: "
          f"{report['versions_identical']} of {report['versions_compared']} versions identical")  # fmt: skip
    if report["steps_without_digests"]:
        print(f"not compared (the original pruned their weights before digests were kept): steps {report['steps_without_digests']}")
    if first is not None:
        where = f", first tensor {first['first_tensor']} (max |diff| {first['max_abs_diff']:.3g})" if first["first_tensor"] else ""
        print(f"first difference: the weights after step {first['step']} (version {first['version']}, replay "
              f"version {first['replay_version']}): {', '.join(first['files_differing'])}{where} {first['note']}".rstrip())  # fmt: skip
    return 0 if first is None or args.overrides else 1  # a fork's weights are meant to differ


def cmd_compare(args: argparse.Namespace) -> int:
    from asyncrl.tasks.pipeline.compare import compare_runs, write_comparison

    work = Path(args.work_dir) if args.work_dir else Path("runs") / "compare"
    result = compare_runs(args.run_a, args.run_b, work)
    write_comparison(result, Path(args.json) if args.json else None, Path(args.png) if args.png else None)
    print("| step | version A | version B | identical | ||w_A - w_B|| | loss A | loss B | pass@1 A | pass@1 B |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def shown(value: Any) -> str:  # noqa: ANN401 - a figure or None
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    for row in result["rows"]:
        print(f"| {row['step']} | {row['version_a']} | {row['version_b']} | {shown(row['identical'])} | "
              f"{shown(row.get('weight_distance'))} | {shown(row['a'].get('loss'))} | {shown(row['b'].get('loss'))} | "
              f"{shown(row['a'].get('pass_at_1'))} | {shown(row['b'].get('pass_at_1'))} |")  # fmt: skip
    first = result["first_difference"]
    print("no step differs" if first is None else f"first difference: the weights after step {first['step']} "
          f"(version {first['version_a']} of A, {first['version_b']} of B)")  # fmt: skip
    return 0


def add_replay_command(commands: Any, add_debug_flag: Any) -> None:  # noqa: ANN401 - argparse's subparsers
    replay = commands.add_parser(
        "replay", help="re-run a run's training from its stored shards and check every weight version is identical"
    )
    replay.add_argument("root", help="the run root to replay (a path or URI; only read)")
    replay.add_argument(
        "overrides", nargs="*", metavar="trainer.KEY=VALUE",
        help="fork: train the same samples with these trainer settings (e.g. trainer.optimizer.lr=2e-5)",
    )  # fmt: skip
    replay.add_argument("--to", default=None, help="the replay's run root (default: WORK_DIR/store)")
    replay.add_argument(
        "--from-step", type=int, default=0, metavar="K",
        help="start from the run's checkpoint of step K (one it kept) instead of its first weights",
    )  # fmt: skip
    replay.add_argument("--work-dir", default=None, help="scratch: the replay's logs, first weights, comparisons (default runs/replay)")
    replay.add_argument("--json", default=None, help="write the report here")
    replay.set_defaults(handler=cmd_replay)
    add_debug_flag(replay)

    compare = commands.add_parser(
        "compare", help="two runs by step: first differing weights, weight distance, training figures, pass@1"
    )
    compare.add_argument("run_a", help="a run root (path or URI)")
    compare.add_argument("run_b", help="another run root: a replay, a fork, another recipe")
    compare.add_argument("--json", default=None, help="write the comparison here")
    compare.add_argument("--png", default=None, help="plot the weight distance and the loss and reward curves here")
    compare.add_argument("--work-dir", default=None, help="scratch for downloaded weights (default runs/compare)")
    compare.set_defaults(handler=cmd_compare)
    add_debug_flag(compare)
