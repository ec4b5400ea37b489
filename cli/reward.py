"""`asyncrl reward math|code` and `asyncrl bench reward`: debug rewards and measure the service.

Wiring (in cli/main.py)::

    add_reward_commands(commands)          # commands = parser.add_subparsers(...)
    bench = commands.add_parser("bench", help="benchmarks")
    add_reward_bench(bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH"))

Handlers return the exit status; bad input raises ValueError / FileNotFoundError with
the file and field named (cli/main.py prints those without a traceback). The reward
commands score in this process, with the same verifiers and limits as the pool.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asyncrl.configs.reward import CodeRewardConfig, MathRewardConfig, RewardConfig, SandboxLimits
from asyncrl.tasks.reward.sandbox_outcome import escape_controls
from asyncrl.tasks.reward.types import RewardResult


def add_reward_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``reward math`` and ``reward code`` to the top-level subcommands."""
    reward = commands.add_parser("reward", help="score one response with the reward service's verifiers")
    actions = reward.add_subparsers(dest="reward_command", required=True, metavar="KIND")

    math = actions.add_parser("math", help="check a math answer with math-verify")
    math.add_argument("--answer", required=True, help="gold answer: 42, \\frac{1}{2}, or a GSM8K solution ending '#### 42'")
    math.add_argument("--response", required=True, help="file holding the model's response ('-' for stdin)")
    math.add_argument("--timeout", type=int, default=MathRewardConfig().timeout_s, help="verification budget, whole seconds")
    math.add_argument("--json", action="store_true", help="print one JSON object")
    math.set_defaults(handler=cmd_reward_math)

    code = actions.add_parser("code", help="run the response's program against unit tests in the sandbox")
    code.add_argument(
        "--tests",
        required=True,
        help='JSON tests file: {"stdio": [{"input", "output"}], "asserts": [...], '
        '"calls": [{"function", "arguments", "expected"}], "time_limit_s": N}',
    )
    code.add_argument("--response", required=True, help="file holding the model's response ('-' for stdin)")
    code.add_argument("--scoring", choices=("fraction", "all"), default="fraction")
    code.add_argument("--extract", choices=("last_fence", "first_fence", "whole"), default="last_fence")
    defaults = SandboxLimits()
    code.add_argument("--wall-s", type=float, default=defaults.wall_s, help="wall time per test")
    code.add_argument("--cpu-s", type=int, default=defaults.cpu_s, help="CPU seconds per process")
    code.add_argument("--memory-mb", type=int, default=defaults.memory_mb, help="address space per process")
    code.add_argument(
        "--allow-unsandboxed",
        action="store_true",
        help="if bubblewrap is missing, run the program on the host WITHOUT isolation (unsafe)",
    )
    code.add_argument("--json", action="store_true", help="print one JSON object")
    code.set_defaults(handler=cmd_reward_code)


def add_reward_bench(bench_commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``reward`` to the ``bench`` subcommands."""
    bench = bench_commands.add_parser("reward", help="verifications per second for math and code, 1 and 2 workers")
    bench.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    bench.add_argument("--math-items", type=int, default=200)
    bench.add_argument("--code-items", type=int, default=20)
    bench.add_argument("--code-tests", type=int, default=2, help="stdin/stdout tests per code item")
    bench.add_argument(
        "--sandbox-per",
        choices=("program", "test"),
        default=CodeRewardConfig().sandbox_per,
        help="one sandbox per program (its tests as processes inside) or a fresh sandbox per test",
    )
    bench.add_argument("--allow-unsandboxed", action="store_true", help="measure code without bubblewrap (unsafe)")
    bench.add_argument("--json-out", help="also write the JSON result to this file")
    bench.set_defaults(handler=cmd_bench_reward)


def cmd_reward_math(args: argparse.Namespace) -> int:
    from asyncrl.tasks.reward.math_reward import score_math

    result = score_math(_read_response(args.response), args.answer, MathRewardConfig(timeout_s=args.timeout))
    _print_result(result, args.json)
    return 0


def cmd_reward_code(args: argparse.Namespace) -> int:
    from asyncrl.tasks.reward.code_reward import load_code_tests, score_code

    tests = load_code_tests(Path(args.tests))
    config = CodeRewardConfig(
        scoring=args.scoring,
        extract=args.extract,
        allow_unsandboxed=args.allow_unsandboxed,
        limits=SandboxLimits(wall_s=args.wall_s, cpu_s=args.cpu_s, memory_mb=args.memory_mb),
    )
    result = score_code(_read_response(args.response), tests, config)
    if result.sandboxed is False and not args.json:
        print("warning: bubblewrap is missing; the program ran on the host WITHOUT isolation", file=sys.stderr)
    _print_result(result, args.json)
    return 0


def cmd_bench_reward(args: argparse.Namespace) -> int:
    from asyncrl.bench.reward import bench_json, format_bench_table, run_reward_bench

    if any(w < 1 for w in args.workers):
        raise ValueError(f"--workers: every count must be >= 1, got {args.workers}")
    if args.math_items < 0 or args.code_items < 0:
        raise ValueError("--math-items / --code-items: must be >= 0")
    if args.code_tests < 1:
        raise ValueError(f"--code-tests: must be >= 1, got {args.code_tests}")
    config = RewardConfig.model_validate(
        {"code": {"allow_unsandboxed": args.allow_unsandboxed, "sandbox_per": args.sandbox_per}}
    )
    rows = run_reward_bench(config, args.workers, args.math_items, args.code_items, args.code_tests)
    print(format_bench_table(rows))
    payload = bench_json(rows)
    print(json.dumps(payload))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


def _read_response(path: str) -> str:
    """The response text of ``--response`` (``-``: stdin, in its own encoding; a file: UTF-8).
    Undecodable input is a ValueError naming the file and the first bad byte."""
    try:
        if path == "-":
            return sys.stdin.read()
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        name = "<stdin>" if path == "-" else path
        bad = exc.object[exc.start : exc.start + 1].hex()
        encoding = "UTF-8" if exc.encoding.replace("-", "").lower() == "utf8" else exc.encoding
        raise ValueError(
            f"--response {name}: not {encoding} text: byte 0x{bad} at offset {exc.start} ({exc.reason})"
        ) from exc


def _print_result(result: RewardResult, as_json: bool) -> None:
    if as_json:
        payload: dict[str, Any] = result.to_json()
        print(json.dumps(payload))
        return
    # Details may quote the program's output: control characters are escaped before printing.
    print(f"reward {result.reward:g}  reason {result.reason.value}")
    if result.detail:
        print(f"  {escape_controls(result.detail)}")
    for test in result.tests:
        mark = "pass" if test.passed else f"FAIL {test.reason.value}"
        line = f"  {test.name}: {mark} ({test.wall_s:.2f} s)"
        if test.detail and not test.passed:
            line += "\n    " + escape_controls(test.detail).replace("\n", "\n    ")
        print(line)
