"""Code rewards: extract the program from a response and run it against unit tests in the sandbox.

Tests file format (JSON; each list may be absent, at least one test required)::

    {"stdio": [{"input": "1 2\\n", "output": "3\\n"}, ...],
     "asserts": ["assert add(1, 2) == 3", ...],
     "calls": [{"function": "add", "arguments": "[1, 2]", "expected": "3"}, ...],
     "time_limit_s": 2.0}

``arguments``/``expected``: JSON texts (:class:`~asyncrl.tasks.reward.types.CallCase`);
``time_limit_s``: the problem's own limit per test. With bubblewrap all the tests of one
program run in one sandbox, each as its own process (``code.sandbox_per``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_outcome import RunOutcome, SandboxFile, SandboxUnavailable
from asyncrl.tasks.reward.sandbox_session import SandboxSession
from asyncrl.tasks.reward.types import CallCase, CodeTests, Reason, RewardResult, StdioCase, TestOutcome, failure

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
PYTHON_FENCES = ("python", "python3", "py")
MAIN_FILE = "main.py"
"""The program as a stdio test runs it."""
SOLUTION_FILE = "solution.py"
"""The program as assert and call tests load it (module ``solution``)."""
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
# A call test loads the program the same way (with typing's names predefined, as LeetCode
# does), finds the function (a top-level function the program defines, else a method of an
# instance of its class Solution), calls it with the decoded arguments and prints CALL_RESULT_MARK
# and the JSON of the return value as the last line of stdout. The function name and the
# arguments enter as string literals (repr) decoded inside the sandbox, never as code; the
# expected value never enters the sandbox: the comparison is done outside (call_result_matches).
CALL_RESULT_MARK = "@@asyncrl-call-result@@"
CALL_SCRIPT = """\
import json as _json, os as _os, sys as _sys
_FUNCTION = {function!r}
_ARGUMENTS = {arguments!r}
_MARK = {mark!r}
_solution = {{"__name__": "solution", "__builtins__": __builtins__,
             "__file__": _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "solution.py")}}
exec("from typing import *", _solution)
_preset = dict(_solution)
with open(_solution["__file__"], encoding="utf-8") as _f:
    exec(compile(_f.read(), _solution["__file__"], "exec"), _solution)
_target = _solution.get(_FUNCTION)
if _target is _preset.get(_FUNCTION, _preset) or not callable(_target) or isinstance(_target, type):
    _class = _solution.get("Solution")
    _target = getattr(_class(), _FUNCTION, None) if isinstance(_class, type) else None
if not callable(_target):
    _sys.stderr.write(f"function {{_FUNCTION!r}} not found: neither a top-level function nor a method of class Solution\\n")
    _sys.exit(1)
_value = _target(*_json.loads(_ARGUMENTS))
try:
    _text = _json.dumps(_value)
except (TypeError, ValueError) as _exc:
    _text = None
    _error = f"{{type(_value).__name__}} is not JSON: {{_exc}}"
_sys.stdout.flush()
_sys.stdout.write("\\n" + _MARK + (_text if _text is not None else "!" + _error) + "\\n")
_sys.stdout.flush()
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
    allowed = ("stdio", "asserts", "calls", "time_limit_s")
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object with 'stdio', 'asserts' and/or 'calls', got {type(data).__name__}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {', '.join(repr(k) for k in allowed)}")
    stdio_raw = data.get("stdio", [])
    asserts_raw = data.get("asserts", [])
    calls_raw = data.get("calls", [])
    for key, value in (("stdio", stdio_raw), ("asserts", asserts_raw), ("calls", calls_raw)):
        if not isinstance(value, list):
            raise ValueError(f"{source}: '{key}' must be a list, got {type(value).__name__}")
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
    calls: list[CallCase] = []
    fields = {"function", "arguments", "expected"}
    for i, case in enumerate(calls_raw):
        if not isinstance(case, dict) or set(case) != fields:
            raise ValueError(
                f"{source}: calls[{i}] must be an object with exactly 'function', 'arguments' and 'expected', got {case!r:.200}"
            )
        for key in sorted(fields):
            if not isinstance(case[key], str):
                raise ValueError(f"{source}: calls[{i}].{key} must be a string (JSON text), got {type(case[key]).__name__}")
        call = CallCase(function=case["function"], arguments=case["arguments"], expected=case["expected"])
        problem = call_case_problem(call)
        if problem:
            raise ValueError(f"{source}: calls[{i}].{problem}")
        calls.append(call)
    time_limit = data.get("time_limit_s")
    if time_limit is not None and (
        isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not (math.isfinite(time_limit) and time_limit > 0)
    ):
        raise ValueError(f"{source}: time_limit_s must be a positive number of seconds, got {time_limit!r}")
    tests = CodeTests(
        stdio=tuple(stdio),
        asserts=tuple(asserts_raw),
        calls=tuple(calls),
        time_limit_s=None if time_limit is None else float(time_limit),
    )
    if tests.count == 0:
        raise ValueError(f"{source}: no tests: 'stdio', 'asserts' and 'calls' are all empty")
    return tests


def call_case_problem(case: CallCase) -> str:
    """What makes a call case unusable, as ``<field>: <problem>`` (empty when it is fine):
    ``function`` must be an identifier, ``arguments`` the JSON text of a list and ``expected``
    a JSON text."""
    if not case.function.isidentifier():
        return f"function: {case.function!r:.80} is not a Python identifier"
    try:
        arguments = json.loads(case.arguments)
    except json.JSONDecodeError as exc:
        return f"arguments: not JSON text: {exc}"
    if not isinstance(arguments, list):
        return f"arguments: must be the JSON text of a list of arguments, got a JSON {type(arguments).__name__}"
    try:
        json.loads(case.expected)
    except json.JSONDecodeError as exc:
        return f"expected: not JSON text: {exc}"
    return ""


def problem_limits(limits: SandboxLimits, time_limit_s: float | None) -> SandboxLimits:
    """The sandbox limits of one problem's tests: with its own ``time_limit_s``, wall_s =
    min(time_limit_s, limits.wall_s) and cpu_s = min(ceil(time_limit_s), limits.cpu_s) (RLIMIT_CPU
    counts whole seconds); without one, ``limits`` unchanged. The other limits never change."""
    if time_limit_s is None:
        return limits
    return limits.model_copy(
        update={"wall_s": min(time_limit_s, limits.wall_s), "cpu_s": min(math.ceil(time_limit_s), limits.cpu_s)}
    )


def call_result_matches(expected: Any, actual: Any) -> bool:
    """A call test's verdict on the decoded JSON values: Python ``==`` (so 1 == 1.0, and a
    returned tuple, written as a JSON list, equals a list), or, when ``expected`` is a
    one-element list, ``actual`` equal to that element (APPS wraps return values in a list)."""
    if actual == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and actual == expected[0]


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
    gives 0 with ``sandbox_unavailable``, never a partial score. Every test runs under
    ``problem_limits(config.limits, tests.time_limit_s)``; a malformed call case
    (``call_case_problem``) is a ``bad_request`` and nothing runs.
    """
    start = time.monotonic()
    sandbox = sandbox if sandbox is not None else Sandbox(config)
    program = extract_program(response, config.extract)
    if program is None:
        return failure(Reason.NO_ANSWER, f"no program found in the response (extract: {config.extract})")
    if tests.count == 0:
        return failure(Reason.BAD_REQUEST, "no tests to run")
    for i, case in enumerate(tests.calls):
        problem = call_case_problem(case)
        if problem:
            return failure(Reason.BAD_REQUEST, f"calls[{i}].{problem}")
    if tests.time_limit_s is not None and not (math.isfinite(tests.time_limit_s) and tests.time_limit_s > 0):
        return failure(Reason.BAD_REQUEST, f"time_limit_s: must be a positive number of seconds, got {tests.time_limit_s!r}")
    try:
        sandbox.check()
    except SandboxUnavailable as exc:
        return failure(Reason.SANDBOX_UNAVAILABLE, str(exc), sandboxed=sandbox.sandboxed)
    limits = problem_limits(config.limits, tests.time_limit_s)
    files, runs = _test_runs(program, tests)
    outcomes: list[TestOutcome] = []
    with contextlib.ExitStack() as stack:
        # bubblewrap and sandbox_per: program: one sandbox for all the tests of this program, each
        # test its own process (SandboxSession); else (or unsandboxed) one run per test.
        per_program = sandbox.sandboxed and config.sandbox_per == "program"
        session = stack.enter_context(SandboxSession(sandbox, files, limits)) if per_program else None
        for test in runs:
            if session is not None:
                run = session.run(test.main, test.stdin)
            else:
                run = sandbox.run(files, test.main, test.stdin, limits)
            outcome = _judge(test, run)
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
    main: str
    """The file that runs (``python -I /sandbox/<main>``)."""
    stdin: bytes
    kind: str
    """``stdio``, ``assert`` or ``call``: how the run is judged (``_judge``)."""
    expected: str = ""
    """The expected stdout of a stdio case, the expected JSON text of a call case."""


def _test_runs(program: str, tests: CodeTests) -> tuple[list[SandboxFile], list[_TestRun]]:
    """The files of every test of a program and one run per test: stdio cases, then asserts, then
    calls. A stdio test runs the program as ``main.py``; an assert test runs ``assert_<i>.py``,
    its code after loading the program (``solution.py``) as a module (ASSERT_PRELUDE); a call test
    runs ``call_<i>.py`` (CALL_SCRIPT). The expected outputs and values are not among the files."""
    files: list[SandboxFile] = []
    runs: list[_TestRun] = []
    if tests.stdio:
        files.append(SandboxFile(MAIN_FILE, program.encode()))
        runs += [
            _TestRun(f"stdio[{i}]", MAIN_FILE, case.input.encode(), "stdio", case.output)
            for i, case in enumerate(tests.stdio)
        ]
    if tests.asserts or tests.calls:
        files.append(SandboxFile(SOLUTION_FILE, program.encode()))
    for i, code in enumerate(tests.asserts):
        files.append(SandboxFile(f"assert_{i}.py", f"{ASSERT_PRELUDE}{code}\n".encode()))
        runs.append(_TestRun(f"assert[{i}]", f"assert_{i}.py", b"", "assert"))
    for i, case in enumerate(tests.calls):
        script = CALL_SCRIPT.format(function=case.function, arguments=case.arguments, mark=CALL_RESULT_MARK)
        files.append(SandboxFile(f"call_{i}.py", script.encode()))
        runs.append(_TestRun(f"call[{i}]", f"call_{i}.py", b"", "call", case.expected))
    return files, runs


def _judge(test: _TestRun, run: RunOutcome) -> TestOutcome:
    """Pass/fail of one test from its run: stdio compares stdout (``outputs_match``), an assert
    needs a clean exit (an AssertionError is a wrong answer), a call compares the JSON value after
    the last CALL_RESULT_MARK line with the expected one (``call_result_matches``); a call whose
    program exited cleanly without that line (it ended the process itself) is a crash."""
    name = test.name
    if run.reason == Reason.CRASH and test.kind == "assert" and "AssertionError" in run.detail:
        return TestOutcome(name, False, Reason.WRONG_ANSWER, _tail_lines(run.detail), run.wall_s)
    if run.reason != Reason.OK:
        return TestOutcome(name, False, run.reason, run.detail, run.wall_s)
    if test.kind == "assert":
        return TestOutcome(name, True, Reason.OK, "", run.wall_s)
    actual = run.stdout.decode("utf-8", "replace")
    if test.kind == "call":
        return _judge_call(name, test.expected, actual, run.wall_s)
    if outputs_match(test.expected, actual):
        return TestOutcome(name, True, Reason.OK, "", run.wall_s)
    return TestOutcome(
        name, False, Reason.WRONG_ANSWER, f"expected {_short(test.expected)!r}, got {_short(actual)!r}", run.wall_s
    )


def _judge_call(name: str, expected_text: str, stdout: str, wall_s: float) -> TestOutcome:
    """The verdict of a call test from the stdout of CALL_SCRIPT (see ``_judge``)."""
    marker = "\n" + CALL_RESULT_MARK
    at = stdout.rfind(marker)
    if at < 0:
        return TestOutcome(name, False, Reason.CRASH, "the program exited before the function returned", wall_s)
    line = stdout[at + len(marker) :].split("\n", 1)[0]
    if line.startswith("!"):
        return TestOutcome(name, False, Reason.WRONG_ANSWER, f"the return value {_short(line[1:])}", wall_s)
    try:
        actual = json.loads(line)
    except json.JSONDecodeError:
        return TestOutcome(name, False, Reason.WRONG_ANSWER, f"unreadable return value {_short(line)!r}", wall_s)
    if call_result_matches(json.loads(expected_text), actual):
        return TestOutcome(name, True, Reason.OK, "", wall_s)
    return TestOutcome(
        name, False, Reason.WRONG_ANSWER, f"expected {_short(expected_text)}, got {_short(line)}", wall_s
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
