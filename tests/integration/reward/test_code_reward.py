"""Code rewards: program extraction, stdin/stdout, assert and call tests, time limits, scoring modes,
missing sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.tasks.reward.code_reward import (
    code_tests_from_json,
    extract_program,
    load_code_tests,
    outputs_match,
    problem_limits,
    score_code,
)
from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.types import CallCase, CodeTests, Reason, StdioCase

ADD_TESTS = CodeTests(
    stdio=(StdioCase("1 2\n", "3\n"), StdioCase("-5 5\n", "0\n")),
    asserts=("assert add(2, 2) == 4", "def check(candidate):\n    assert candidate(10, -3) == 7\ncheck(add)"),
)
GOOD = """I will read two numbers and add them.
```python
def _id(x):
    return x

def add(a, b):
    return _id(a) + b

if __name__ == "__main__":
    print(add(*map(int, input().split())))
```
"""


def test_correct_program_passes_stdio_and_assert_tests(sandbox: Sandbox) -> None:
    result = score_code(GOOD, ADD_TESTS, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (1.0, Reason.OK), result
    assert [t.name for t in result.tests] == ["stdio[0]", "stdio[1]", "assert[0]", "assert[1]"]
    assert all(t.passed for t in result.tests)


def test_wrong_program_fails_every_test_with_wrong_answer(sandbox: Sandbox) -> None:
    result = score_code(GOOD.replace("_id(a) + b", "_id(a) - b"), ADD_TESTS, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (0.0, Reason.WRONG_ANSWER)
    assert [t.reason for t in result.tests] == [Reason.WRONG_ANSWER] * 4
    assert "expected '3\\n', got '-1\\n'" in result.tests[0].detail
    assert "AssertionError" in result.tests[2].detail


def test_partly_right_program_gets_the_fraction_or_nothing(sandbox: Sandbox) -> None:
    partial = GOOD.replace("_id(a) + b", "a + b if b != 5 else -1")  # wrong only on "-5 5"
    fraction = score_code(partial, ADD_TESTS, sandbox.config, sandbox)
    assert fraction.reward == pytest.approx(3 / 4)
    assert fraction.reason == Reason.WRONG_ANSWER
    assert [t.passed for t in fraction.tests] == [True, False, True, True]
    all_or_nothing = sandbox.config.model_copy(update={"scoring": "all"})
    strict = score_code(partial, ADD_TESTS, all_or_nothing, Sandbox(all_or_nothing))
    assert (strict.reward, strict.reason) == (0.0, Reason.WRONG_ANSWER)
    assert len(strict.tests) == 2  # stopped at the first failure


def test_crashing_program_reports_crash(sandbox: Sandbox) -> None:
    result = score_code("```python\nraise SystemExit(3)\n```", CodeTests(stdio=(StdioCase("", "x"),)), sandbox.config, sandbox)
    assert (result.reward, result.reason) == (0.0, Reason.CRASH)
    assert "exit status 3" in result.detail


def test_response_without_program_is_no_answer(sandbox: Sandbox) -> None:
    result = score_code("I would add the numbers.", ADD_TESTS, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (0.0, Reason.NO_ANSWER)
    assert result.tests == ()


def test_missing_bwrap_refuses_to_run_code(tmp_path: Path) -> None:
    config = CodeRewardConfig(bwrap=str(tmp_path / "no-bwrap"))
    result = score_code(GOOD, ADD_TESTS, config)
    assert (result.reward, result.reason) == (0.0, Reason.SANDBOX_UNAVAILABLE)
    assert "refusing to run model-written code" in result.detail
    assert "allow_unsandboxed" in result.detail and "apt-get install bubblewrap" in result.detail
    assert result.tests == ()


def test_broken_bwrap_is_sandbox_unavailable_not_a_program_failure() -> None:
    # An executable that exits at once without starting anything, like bwrap refused by the kernel.
    config = CodeRewardConfig(bwrap="/bin/false")
    result = score_code(GOOD, ADD_TESTS, config)
    assert (result.reward, result.reason) == (0.0, Reason.SANDBOX_UNAVAILABLE)
    assert "bubblewrap could not start the sandbox" in result.detail
    assert result.tests == ()


def test_unsandboxed_mode_runs_only_when_explicitly_allowed(tmp_path: Path) -> None:
    config = CodeRewardConfig(bwrap=str(tmp_path / "no-bwrap"), allow_unsandboxed=True)
    result = score_code(GOOD, ADD_TESTS, config)
    assert (result.reward, result.reason, result.sandboxed) == (1.0, Reason.OK, False)
    timeout = score_code(
        "```python\nwhile True:\n    pass\n```",
        CodeTests(stdio=(StdioCase("", "x"),)),
        config.model_copy(update={"limits": config.limits.model_copy(update={"cpu_s": 1})}),
    )
    assert (timeout.reward, timeout.reason) == (0.0, Reason.TIMEOUT)


@pytest.mark.parametrize(
    ("response", "mode", "expected"),
    [
        ("a\n```python\nprint(1)\n```\nb\n```python\nprint(2)\n```", "last_fence", "print(2)\n"),
        ("a\n```python\nprint(1)\n```\nb\n```python\nprint(2)\n```", "first_fence", "print(1)\n"),
        ("```bash\nls\n```\n```py\nprint(3)\n```\n```text\nout\n```", "last_fence", "print(3)\n"),
        ("```\nprint(4)\n```", "last_fence", "print(4)\n"),
        ("```python\nprint(5)", "last_fence", None),  # unclosed: truncated generation
        ("print(6)", "last_fence", None),
        ("print(6)", "whole", "print(6)"),
        ("```python\n\n```", "last_fence", None),
    ],
)
def test_extract_program(response: str, mode: str, expected: str | None) -> None:
    assert extract_program(response, mode) == expected


def test_extract_program_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="allowed: 'last_fence'"):
        extract_program("x", "middle")


def test_outputs_match_normalises_line_ends_and_trailing_space() -> None:
    assert outputs_match("3\n", "3")
    assert outputs_match("a b\nc\n", "a b  \r\nc\n\n")
    assert not outputs_match("3\n", "3.0\n")
    assert not outputs_match("a\nb", "a b")


def test_load_code_tests(tmp_path: Path) -> None:
    path = tmp_path / "tests.json"
    path.write_text(json.dumps({"stdio": [{"input": "1\n", "output": "1\n"}], "asserts": ["assert True"]}))
    assert load_code_tests(path) == CodeTests(stdio=(StdioCase("1\n", "1\n"),), asserts=("assert True",))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "expected a JSON object"),
        ({"cases": []}, "unknown key(s) ['cases']"),
        ({"stdio": [{"input": "1"}]}, "stdio[0] must be an object with exactly 'input' and 'output'"),
        ({"stdio": [{"input": 1, "output": "1"}]}, "stdio[0].input must be a string"),
        ({"asserts": ["assert 1", ""]}, "asserts[1] must be a non-empty string"),
        ({"stdio": [], "asserts": []}, "no tests"),
    ],
)
def test_bad_tests_files_name_the_problem(data: object, message: str) -> None:
    with pytest.raises(ValueError, match="problem.json: ") as info:
        code_tests_from_json(data, "problem.json")
    assert message in str(info.value)


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        load_code_tests(path)


CALLS_PROGRAM = """Here is my solution.
```python
def add(a, b):
    return a + b

def divmod_pair(a, b):
    return a // b, a % b

def nested(xs):
    return {"sum": sum(xs), "items": [tuple(xs)]}

def as_set(xs):
    return set(xs)

class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return [seen[target - n], i]
            seen[n] = i
        raise ValueError("no pair sums to the target")

    def add(self, a, b):
        return -1  # a top-level function of that name comes first
```
"""


def call(function: str, arguments: str, expected: str) -> CallCase:
    return CallCase(function=function, arguments=arguments, expected=expected)


def test_call_cases_on_the_real_sandbox(sandbox: Sandbox) -> None:
    tests = CodeTests(
        calls=(
            call("add", "[1, 2]", "3"),  # top-level function (not Solution.add)
            call("twoSum", "[[2, 7, 11, 15], 9]", "[0, 1]"),  # a method of class Solution
            call("divmod_pair", "[7, 2]", "[3, 1]"),  # a returned tuple compares as a list
            call("add", "[2, 2]", "[4]"),  # APPS: a one-element expected list accepts its element
            call("nested", "[[1, 2]]", '{"items": [[1, 2]], "sum": 3}'),  # tuples inside, key order free
            call("add", '["a\\"); import os; os._exit(0) #", "b"]', '"a\\"); import os; os._exit(0) #b"'),
        )
    )
    result = score_code(CALLS_PROGRAM, tests, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (1.0, Reason.OK), result
    assert [t.name for t in result.tests] == [f"call[{i}]" for i in range(6)]


def test_call_case_failures_have_their_reasons(sandbox: Sandbox) -> None:
    tests = CodeTests(
        calls=(
            call("add", "[1, 2]", "4"),  # wrong value
            call("twoSum", "[[1, 2], 10]", "[0, 1]"),  # the method raises
            call("missing", "[]", "1"),  # no such function or method
            call("add", "[1, 2]", "[3, 3]"),  # a two-element list never accepts an element
            call("as_set", "[[1]]", "[1]"),  # a set has no JSON form
            call("divmod_pair", "[1, 0]", "[0, 0]"),  # ZeroDivisionError
        )
    )
    result = score_code(CALLS_PROGRAM, tests, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (0.0, Reason.WRONG_ANSWER)
    reasons = [(t.name, t.reason) for t in result.tests]
    assert reasons == [
        ("call[0]", Reason.WRONG_ANSWER),
        ("call[1]", Reason.CRASH),
        ("call[2]", Reason.CRASH),
        ("call[3]", Reason.WRONG_ANSWER),
        ("call[4]", Reason.WRONG_ANSWER),
        ("call[5]", Reason.CRASH),
    ]
    details = [t.detail for t in result.tests]
    assert details[0] == "expected 4, got 3"
    assert "ValueError: no pair sums to the target" in details[1]
    assert "'missing' not found: neither a top-level function nor a method of class Solution" in details[2]
    assert "set is not JSON" in details[4]
    assert "ZeroDivisionError" in details[5]
    assert result.detail.startswith("0/6 tests passed; call[0]: expected 4, got 3")


def test_call_program_that_exits_early_or_prints_is_judged_by_its_return_value(sandbox: Sandbox) -> None:
    chatty = "```python\ndef f(x):\n    print('debug', x)\n    return x * 2\n```"
    quitter = "```python\nimport sys\ndef f(x):\n    sys.exit(0)\n```"
    tests = CodeTests(calls=(call("f", "[21]", "42"),))
    assert score_code(chatty, tests, sandbox.config, sandbox).reason == Reason.OK
    result = score_code(quitter, tests, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (0.0, Reason.CRASH)
    assert "exited before the function returned" in result.detail


def test_call_cases_mix_with_stdio_and_asserts(sandbox: Sandbox) -> None:
    tests = CodeTests(stdio=ADD_TESTS.stdio, asserts=ADD_TESTS.asserts[:1], calls=(call("add", "[5, 6]", "11"),))
    result = score_code(GOOD, tests, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (1.0, Reason.OK), result
    assert [t.name for t in result.tests] == ["stdio[0]", "stdio[1]", "assert[0]", "call[0]"]


def test_malformed_call_case_is_a_bad_request(sandbox: Sandbox) -> None:
    for case, message in [
        (call("add", "{not json", "3"), "calls[0].arguments: not JSON text"),
        (call("add", '{"a": 1}', "3"), "calls[0].arguments: must be the JSON text of a list"),
        (call("add", "[1, 2]", "three"), "calls[0].expected: not JSON text"),
        (call("os.system", "[]", "0"), "calls[0].function: 'os.system' is not a Python identifier"),
    ]:
        result = score_code(GOOD, CodeTests(calls=(case,)), sandbox.config, sandbox)
        assert (result.reward, result.reason) == (0.0, Reason.BAD_REQUEST)
        assert message in result.detail


def test_problem_time_limit_shorter_than_the_configured_one_times_out_there(sandbox: Sandbox) -> None:
    assert sandbox.config.limits.wall_s == 3.0
    slow = "```python\nimport time\ntime.sleep(1.2)\nprint(input())\n```"
    stdio = (StdioCase("hi\n", "hi\n"),)
    # Within the configured 3 s it passes...
    assert score_code(slow, CodeTests(stdio=stdio), sandbox.config, sandbox).reason == Reason.OK
    # ...the problem's own 0.4 s stops it at 0.4 s.
    result = score_code(slow, CodeTests(stdio=stdio, time_limit_s=0.4), sandbox.config, sandbox)
    assert (result.reward, result.reason) == (0.0, Reason.TIMEOUT)
    assert "wall time limit of 0.4 s exceeded" in result.tests[0].detail
    assert 0.4 <= result.tests[0].wall_s < 1.2
    # A call case too, and a busy loop (CPU limit min(ceil(0.4), 1) = 1 s, wall 0.4 s).
    spin = "```python\ndef f():\n    while True:\n        pass\n```"
    result = score_code(spin, CodeTests(calls=(call("f", "[]", "0"),), time_limit_s=0.4), sandbox.config, sandbox)
    assert result.reason == Reason.TIMEOUT and result.tests[0].wall_s < 1.0


def test_problem_limits() -> None:
    limits = SandboxLimits(cpu_s=5, wall_s=10.0, memory_mb=256)
    assert problem_limits(limits, None) is limits
    tight = problem_limits(limits, 2.5)
    assert (tight.wall_s, tight.cpu_s, tight.memory_mb) == (2.5, 3, 256)
    capped = problem_limits(limits, 60.0)
    assert (capped.wall_s, capped.cpu_s) == (10.0, 5)
    assert problem_limits(limits, 0.1).cpu_s == 1


def test_load_code_tests_with_calls_and_time_limit(tmp_path: Path) -> None:
    path = tmp_path / "tests.json"
    data = {"calls": [{"function": "f", "arguments": "[1, [2]]", "expected": "[3]"}], "time_limit_s": 2}
    path.write_text(json.dumps(data))
    assert load_code_tests(path) == CodeTests(calls=(call("f", "[1, [2]]", "[3]"),), time_limit_s=2.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"calls": {}}, "'calls' must be a list, got dict"),
        ({"calls": [{"function": "f", "arguments": "[]"}]}, "calls[0] must be an object with exactly 'function'"),
        ({"calls": [{"function": "f", "arguments": [1], "expected": "1"}]}, "calls[0].arguments must be a string"),
        ({"calls": [{"function": "f", "arguments": "1", "expected": "1"}]}, "calls[0].arguments: must be the JSON text of a list"),
        ({"calls": [{"function": "f", "arguments": "[]", "expected": "nope"}]}, "calls[0].expected: not JSON text"),
        ({"calls": [{"function": "f()", "arguments": "[]", "expected": "1"}]}, "calls[0].function: 'f()' is not a Python identifier"),
        ({"stdio": [{"input": "", "output": ""}], "time_limit_s": 0}, "time_limit_s must be a positive number"),
        ({"stdio": [{"input": "", "output": ""}], "time_limit_s": "2"}, "time_limit_s must be a positive number"),
        ({"stdio": [{"input": "", "output": ""}], "time_limit_s": True}, "time_limit_s must be a positive number"),
        ({"time_limit_s": 2}, "no tests"),
    ],
)  # fmt: skip
def test_bad_calls_and_time_limits_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ValueError, match="problem.json: ") as info:
        code_tests_from_json(data, "problem.json")
    assert message in str(info.value)


def test_typing_names_are_not_taken_for_the_programs_functions(sandbox: Sandbox) -> None:
    program = "```python\nclass Solution:\n    def cast(self, x: List[int]) -> int:\n        return len(x)\n```"
    result = score_code(program, CodeTests(calls=(call("cast", "[[1, 2, 3]]", "3"),)), sandbox.config, sandbox)
    assert (result.reward, result.reason) == (1.0, Reason.OK), result
