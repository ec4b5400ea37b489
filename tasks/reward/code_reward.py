"""Code rewards: extract the program from a response and run it against unit tests in the sandbox.

Tests file format (JSON)::

    {"stdio": [{"input": "1 2\\n", "output": "3\\n"}, ...],
     "asserts": ["assert add(1, 2) == 3", ...]}

Either list may be absent; at least one test is required.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.reward.config import CodeRewardConfig
from asyncrl.tasks.reward.sandbox import RunOutcome, Sandbox, SandboxFile, SandboxUnavailable
from asyncrl.tasks.reward.types import CodeTests, Reason, RewardResult, StdioCase, TestOutcome, failure

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
PYTHON_FENCES = ("python", "python3", "py")
MAIN_FILE = "main.py"
SOLUTION_FILE = "solution.py"
# An assert test loads the program as module "solution" (its `if __name__ == "__main__":`
# block does not run), copies its names into the test's globals and runs the test code.
ASSERT_PRELUDE = """\
import os as _os
_solution = {"__name__": "solution", "__builtins__": __builtins__,
             "__file__": _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "solution.py")}
with open(_solution["__file__"], encoding="utf-8") as _f:
    exec(compile(_f.read(), _solution["__file__"], "exec"), _solution)
globals().update({_k: _v for _k, _v in _solution.items() if _k not in ("__name__", "__file__", "__builtins__")})
del _os, _f, _solution
# --- test ---
"""
_SHOWN = 120


def extract_program(response: str, mode: str) -> str | None:
    """The program in a response, or None.

    ``whole``: the response itself (None if blank). ``last_fence`` / ``first_fence``:
    the last / first closed fenced block, taken among ```python blocks when there is
    one, else among all blocks.
    """
    if mode == "whole":
        return response if response.strip() else None
    if mode not in ("last_fence", "first_fence"):
        raise ValueError(f"code.extract: unknown mode {mode!r}; allowed: 'last_fence', 'first_fence', 'whole'")
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response)]
    python = [code for lang, code in blocks if lang in PYTHON_FENCES]
    candidates = python or [code for _, code in blocks]
    candidates = [code for code in candidates if code.strip()]
    if not candidates:
        return None
    return candidates[-1] if mode == "last_fence" else candidates[0]


def code_tests_from_json(data: Any, source: str) -> CodeTests:
    """Validate the tests format (module docstring); errors name the source and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object with 'stdio' and/or 'asserts', got {type(data).__name__}")
    unknown = sorted(set(data) - {"stdio", "asserts"})
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: 'stdio', 'asserts'")
    stdio_raw = data.get("stdio", [])
    asserts_raw = data.get("asserts", [])
    if not isinstance(stdio_raw, list):
        raise ValueError(f"{source}: 'stdio' must be a list, got {type(stdio_raw).__name__}")
    if not isinstance(asserts_raw, list):
        raise ValueError(f"{source}: 'asserts' must be a list, got {type(asserts_raw).__name__}")
    stdio: list[StdioCase] = []
    for i, case in enumerate(stdio_raw):
        if not isinstance(case, dict) or set(case) != {"input", "output"}:
            raise ValueError(f"{source}: stdio[{i}] must be an object with exactly 'input' and 'output', got {case!r}")
        for key in ("input", "output"):
            if not isinstance(case[key], str):
                raise ValueError(f"{source}: stdio[{i}].{key} must be a string, got {type(case[key]).__name__}")
        stdio.append(StdioCase(input=case["input"], output=case["output"]))
    for i, code in enumerate(asserts_raw):
        if not isinstance(code, str) or not code.strip():
            raise ValueError(f"{source}: asserts[{i}] must be a non-empty string of Python code, got {code!r}")
    tests = CodeTests(stdio=tuple(stdio), asserts=tuple(asserts_raw))
    if tests.count == 0:
        raise ValueError(f"{source}: no tests: 'stdio' and 'asserts' are both empty")
    return tests


def load_code_tests(path: Path) -> CodeTests:
    """Read a tests file (JSON, module docstring format)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {_describe_decode_error(exc)}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    return code_tests_from_json(data, str(path))


def _describe_decode_error(exc: UnicodeDecodeError) -> str:
    """Where and what the first undecodable byte is, e.g. ``byte 0xff at offset 12``."""
    bad = exc.object[exc.start : exc.start + 1]
    return f"byte 0x{bad.hex()} at offset {exc.start} ({exc.reason})"


def outputs_match(expected: str, actual: str) -> bool:
    """Equal after normalising both: ``\\r\\n`` -> ``\\n``, trailing spaces of each line and
    trailing blank lines removed."""
    return _normalise(expected) == _normalise(actual)


def score_code(response: str, tests: CodeTests, config: CodeRewardConfig, sandbox: Sandbox | None = None) -> RewardResult:
    """Run the response's program against ``tests``.

    reward = passed / total (``scoring: fraction``), or 1 if every test passed else 0
    (``scoring: all``, which stops at the first failure). The reason is ``ok`` when
    every test passed, else the first failed test's reason. A sandbox that cannot run
    gives 0 with ``sandbox_unavailable``, never a partial score.
    """
    start = time.monotonic()
    sandbox = sandbox if sandbox is not None else Sandbox(config)
    program = extract_program(response, config.extract)
    if program is None:
        return failure(Reason.NO_ANSWER, f"no program found in the response (extract: {config.extract})")
    if tests.count == 0:
        return failure(Reason.BAD_REQUEST, "no tests to run")
    try:
        sandbox.check()
    except SandboxUnavailable as exc:
        return failure(Reason.SANDBOX_UNAVAILABLE, str(exc), sandboxed=sandbox.sandboxed)
    outcomes: list[TestOutcome] = []
    for test in _test_runs(program, tests):
        outcome = _judge(test.name, sandbox.run(test.files, MAIN_FILE, test.stdin), test.expected)
        if outcome.reason == Reason.SANDBOX_UNAVAILABLE:
            return failure(Reason.SANDBOX_UNAVAILABLE, outcome.detail, time.monotonic() - start, sandbox.sandboxed)
        outcomes.append(outcome)
        if config.scoring == "all" and not outcome.passed:
            break
    passed = sum(o.passed for o in outcomes)
    all_passed = passed == tests.count
    reward = passed / tests.count if config.scoring == "fraction" else float(all_passed)
    first_failure = next((o for o in outcomes if not o.passed), None)
    if first_failure is None:
        reason, detail = Reason.OK, f"{passed}/{tests.count} tests passed"
    else:
        reason = first_failure.reason
        detail = f"{passed}/{tests.count} tests passed; {first_failure.name}: {first_failure.detail}"
    return RewardResult(
        reward=reward,
        reason=reason,
        detail=detail,
        tests=tuple(outcomes),
        sandboxed=sandbox.sandboxed,
        elapsed_s=time.monotonic() - start,
    )


@dataclass(frozen=True)
class _TestRun:
    name: str
    files: list[SandboxFile]
    stdin: bytes
    expected: str | None
    """Expected stdout of a stdio case; None for an assert test (a clean exit passes)."""


def _test_runs(program: str, tests: CodeTests) -> list[_TestRun]:
    """One sandbox run per test, stdio cases first; an assert test runs its code after loading
    the program as a module (ASSERT_PRELUDE)."""
    runs = [
        _TestRun(f"stdio[{i}]", [SandboxFile(MAIN_FILE, program.encode())], case.input.encode(), case.output)
        for i, case in enumerate(tests.stdio)
    ]
    solution = SandboxFile(SOLUTION_FILE, program.encode())
    for i, code in enumerate(tests.asserts):
        script = SandboxFile(MAIN_FILE, f"{ASSERT_PRELUDE}{code}\n".encode())
        runs.append(_TestRun(f"assert[{i}]", [solution, script], b"", None))
    return runs


def _judge(name: str, run: RunOutcome, expected: str | None) -> TestOutcome:
    """Pass/fail of one test from its run: stdio compares stdout, asserts need a clean exit."""
    if run.reason == Reason.CRASH and expected is None and "AssertionError" in run.detail:
        return TestOutcome(name, False, Reason.WRONG_ANSWER, _tail_lines(run.detail), run.wall_s)
    if run.reason != Reason.OK:
        return TestOutcome(name, False, run.reason, run.detail, run.wall_s)
    if expected is None:
        return TestOutcome(name, True, Reason.OK, "", run.wall_s)
    actual = run.stdout.decode("utf-8", "replace")
    if outputs_match(expected, actual):
        return TestOutcome(name, True, Reason.OK, "", run.wall_s)
    return TestOutcome(
        name, False, Reason.WRONG_ANSWER, f"expected {_short(expected)!r}, got {_short(actual)!r}", run.wall_s
    )


def _normalise(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _tail_lines(text: str, n: int = 3) -> str:
    """The last lines of a traceback: the failing test line and the error."""
    return "\n".join(text.strip().splitlines()[-n:])


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
