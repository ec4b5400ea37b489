"""Code rewards: program extraction, stdin/stdout and assert tests, scoring modes, missing sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.tasks.reward.code_reward import (
    code_tests_from_json,
    extract_program,
    load_code_tests,
    outputs_match,
    score_code,
)
from asyncrl.tasks.reward.config import CodeRewardConfig
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.types import CodeTests, Reason, StdioCase

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
