"""load_prompts on each dataset layout (math, asyncrl code, APPS/TACO, LiveCodeBench,
CodeContests), the task column and plug-in rows."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.tasks.data.formats import last_boxed
from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.records import CODE_TASK, MATH_TASK, DatasetError, make_prompt_id
from asyncrl.tasks.data.reward_requests import reward_request
from asyncrl.tasks.reward.types import CallCase, CodeTests, StdioCase


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ----- MATH -----

MATH_ROWS: list[dict[str, Any]] = [
    {
        "problem": "Compute $\\frac{2}{4}$.",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "We have $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$.",
    },
    {
        "problem": "Solve $x^2 = 4$ for the set of roots.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "First try $\\boxed{2}$; both signs work, so the set is $\\boxed{\\{-2, 2\\}}$.",
    },
    {"problem": "Expand $(x+1)^2 - 2x$.", "solution": "It is $\\fbox{x^{2}+1}$."},
    {"problem": "What is 3+4?", "solution": "The sum is $\\boxed 7$."},
]


def test_math_jsonl_takes_the_last_boxed_answer(tmp_path: Path) -> None:
    records = load_prompts(write_jsonl(tmp_path / "math.jsonl", MATH_ROWS))
    assert [r.answer for r in records] == ["\\frac{1}{2}", "\\{-2, 2\\}", "x^{2}+1", "7"]
    assert [r.solution for r in records] == [row["solution"] for row in MATH_ROWS]
    assert [r.prompt for r in records] == [row["problem"] for row in MATH_ROWS]
    assert {r.task for r in records} == {MATH_TASK} and all(r.tests is None and r.fields == {} for r in records)
    assert records[2].prompt_id == make_prompt_id(2, MATH_ROWS[2]["problem"])


def test_math_answer_column_wins_over_boxed(tmp_path: Path) -> None:
    rows = [{"problem": "p?", "solution": "so $\\boxed{0.5}$", "answer": "\\frac{1}{2}"}]
    (record,) = load_prompts(write_jsonl(tmp_path / "math500.jsonl", rows))
    assert (record.answer, record.solution) == ("\\frac{1}{2}", "so $\\boxed{0.5}$")


@pytest.mark.parametrize(
    ("text", "answer"),
    [("\\boxed{a{b{c}}d}", "a{b{c}}d"), ("\\boxed{1", None), ("no box", None), ("\\boxed{1} \\fbox{2}", "2"), ("\\boxedx{3}", None)],
)
def test_last_boxed(text: str, answer: str | None) -> None:
    assert last_boxed(text) == answer


# ----- asyncrl's own code layout -----

TESTS = {
    "stdio": [{"input": "1 2\n", "output": "3\n"}],
    "asserts": ["assert add(2, 2) == 4"],
    "calls": [{"function": "add", "arguments": "[1, 5]", "expected": "6"}],
    "time_limit_s": 1.5,
}
EXPECTED_TESTS = CodeTests(
    stdio=(StdioCase("1 2\n", "3\n"),),
    asserts=("assert add(2, 2) == 4",),
    calls=(CallCase("add", "[1, 5]", "6"),),
    time_limit_s=1.5,
)


def test_asyncrl_code_parquet_with_json_text_tests(tmp_path: Path) -> None:
    path = tmp_path / "code.parquet"
    table = {
        "prompt": ["Add two numbers.", "Print hi."],
        "tests": [json.dumps(TESTS), json.dumps({"stdio": [{"input": "", "output": "hi\n"}], "asserts": []})],
        "solution": ["def add(a, b):\n    return a + b\n", None],
        "task": ["code", "code"],
        "max_new_tokens": [64, None],
        "num_steps": [1, 2],
    }
    pq.write_table(pa.table(table), path)
    first, second = load_prompts(path)
    assert first.task == CODE_TASK and first.tests == EXPECTED_TESTS and first.answer == ""
    assert first.solution == "def add(a, b):\n    return a + b\n" and first.max_new_tokens == 64
    assert first.fields == {}
    assert second.tests == CodeTests(stdio=(StdioCase("", "hi\n"),)) and second.solution is None
    request = reward_request(first, "```python\nprint(3)\n```")
    assert request.kind == "code" and request.reference == EXPECTED_TESTS


def test_asyncrl_code_parquet_with_nested_tests(tmp_path: Path) -> None:
    path = tmp_path / "nested.parquet"
    rows = [{"prompt": "Add.", "tests": TESTS}, {"prompt": "Hi.", "tests": {"stdio": [{"input": "", "output": "hi\n"}]}}]
    pq.write_table(pa.Table.from_pylist(rows), path)  # the second row's missing struct fields are null
    first, second = load_prompts(path)
    assert first.tests == EXPECTED_TESTS
    assert second.tests == CodeTests(stdio=(StdioCase("", "hi\n"),))


def test_synthetic_code_task_parquet_loads(tmp_path: Path) -> None:
    synthetic_code = pytest.importorskip("asyncrl.tasks.data.synthetic_code")
    problems = synthetic_code.make_code_dataset(5, seed=1)
    records = load_prompts(synthetic_code.write_code_problems(tmp_path / "code.parquet", problems))
    assert [r.tests for r in records] == [p.code_tests() for p in problems]
    assert [r.solution for r in records] == [p.solution for p in problems]
    assert {r.task for r in records} == {CODE_TASK}


def test_a_file_with_a_task_column_mixes_math_and_code_rows(tmp_path: Path) -> None:
    rows = [
        {"prompt": "1+1?", "answer": "2", "tests": None, "task": "math"},
        {"prompt": "Add.", "answer": None, "tests": json.dumps(TESTS), "task": "code"},
        {"prompt": "2+2?", "answer": "#### 4", "tests": None, "task": None},
    ]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=r"mixed\.parquet, row 2: field 'tests' is null$"):
        load_prompts(path)  # a null task is the layout's: a tests column makes it code
    rows[2]["task"] = "math"
    pq.write_table(pa.Table.from_pylist(rows), path)
    math_row, code_row, math_row_2 = load_prompts(path)
    assert (math_row.task, math_row.answer, math_row.tests) == (MATH_TASK, "2", None)
    assert (code_row.task, code_row.tests, code_row.answer) == (CODE_TASK, EXPECTED_TESTS, "")
    assert (math_row_2.task, math_row_2.answer) == (MATH_TASK, "4")


# ----- APPS / TACO -----

APPS_ROWS: list[dict[str, Any]] = [
    {
        "problem_id": 0,
        "question": "Read two integers and print their sum.",
        "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)\n", "print(sum(map(int, input().split())))"]),
        "input_output": json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}),
        "difficulty": "introductory",
        "url": "https://codeforces.com/problemset/problem/1/A",
        "starter_code": "",
    },
    {
        "problem_id": 1,
        "question": "Write a function add(a, b) returning the sum.",
        "solutions": "",
        "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2], [[1], [2]]], "outputs": [[3], [[1, 2]]]}),
        "difficulty": "introductory",
        "url": "https://www.codewars.com/kata/add",
        "starter_code": "def add(a, b):\n\t",
    },
]


def test_apps_jsonl_stdio_and_fn_name(tmp_path: Path) -> None:
    stdio_row, call_row = load_prompts(write_jsonl(tmp_path / "apps.jsonl", APPS_ROWS))
    assert stdio_row.task == CODE_TASK and stdio_row.prompt == APPS_ROWS[0]["question"]
    assert stdio_row.tests == CodeTests(stdio=(StdioCase("1 2\n", "3\n"), StdioCase("10 -3\n", "7\n")))
    assert stdio_row.solution == "a, b = map(int, input().split())\nprint(a + b)\n"
    assert call_row.tests == CodeTests(
        calls=(CallCase("add", "[1, 2]", "[3]"), CallCase("add", "[[1], [2]]", "[[1, 2]]"))
    )
    assert call_row.solution is None
    assert call_row.prompt == (
        "Write a function add(a, b) returning the sum.\n\nStart from this code:\n```python\ndef add(a, b):\n\t\n```"
    )


def test_taco_lists_of_lines_and_time_limit(tmp_path: Path) -> None:
    rows = [
        {
            "question": "Sum pairs.",
            "input_output": {"inputs": [["2", "1 2", "3 4"], "1\n5 5\n"], "outputs": [["3", "7"], "10\n"]},
            "time_limit": "2 seconds",
            "solutions": json.dumps(["t = int(input())\n"]),
        },
        {"question": "Echo.", "input_output": {"inputs": ["x\n"], "outputs": ["x\n"]}, "time_limit": None},
        {"question": "Echo.", "input_output": {"inputs": ["x\n"], "outputs": ["x\n"]}, "time_limit": "0.5 seconds"},
    ]
    first, second, third = load_prompts(write_jsonl(tmp_path / "taco.jsonl", rows))
    assert first.tests == CodeTests(
        stdio=(StdioCase("2\n1 2\n3 4", "3\n7"), StdioCase("1\n5 5\n", "10\n")), time_limit_s=2.0
    )
    assert first.solution == "t = int(input())\n"
    assert second.tests is not None and second.tests.time_limit_s is None
    assert third.tests is not None and third.tests.time_limit_s == 0.5


# ----- LiveCodeBench -----


def lcb_private(cases: list[dict[str, str]]) -> str:
    """Private cases as LiveCodeBench releases them: base64(zlib(pickle(JSON text)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode("ascii")


LCB_ROWS: list[dict[str, Any]] = [
    {
        "question_title": "Sum",
        "question_content": "Read N and N integers; print their sum.",
        "platform": "atcoder",
        "question_id": "abc001_a",
        "starter_code": "",
        "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "3\n1 2 3\n", "output": "6\n", "testtype": "stdin"}]),
        "private_test_cases": lcb_private([{"input": "2\n5 5\n", "output": "10\n", "testtype": "stdin"}]),
        "metadata": "{}",
    },
    {
        "question_title": "Two Sum",
        "question_content": "Return indices of the two numbers adding up to target.",
        "platform": "leetcode",
        "question_id": "1",
        "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
        "difficulty": "easy",
        "public_test_cases": json.dumps(
            [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"}]
        ),
        "private_test_cases": json.dumps([{"input": "[3, 3]\n6\n", "output": "[0,1]", "testtype": "functional"}]),
        "metadata": json.dumps({"func_name": "twoSum"}),
    },
]


def test_livecodebench_stdin_and_functional_cases(tmp_path: Path) -> None:
    stdin_row, functional_row = load_prompts(write_jsonl(tmp_path / "lcb.jsonl", LCB_ROWS))
    assert stdin_row.tests == CodeTests(stdio=(StdioCase("3\n1 2 3\n", "6\n"), StdioCase("2\n5 5\n", "10\n")))
    assert stdin_row.prompt == LCB_ROWS[0]["question_content"]
    assert functional_row.tests == CodeTests(
        calls=(CallCase("twoSum", "[[2, 7, 11, 15], 9]", "[0, 1]"), CallCase("twoSum", "[[3, 3], 6]", "[0, 1]"))
    )
    assert functional_row.prompt.endswith("```python\n" + LCB_ROWS[1]["starter_code"].rstrip("\n") + "\n```")
    assert functional_row.prompt.startswith(LCB_ROWS[1]["question_content"] + "\n\nStart from this code:\n")


# ----- CodeContests -----


def test_codecontests_parquet_with_nested_structs(tmp_path: Path) -> None:
    tests_type = pa.struct([("input", pa.list_(pa.string())), ("output", pa.list_(pa.string()))])
    table = pa.table(
        {
            "name": ["1000_A. Sum", "1000_B. Echo"],
            "description": ["Print a+b.", "Echo the line."],
            "public_tests": pa.array([{"input": ["1 2\n"], "output": ["3\n"]}, {"input": ["x\n"], "output": ["x\n"]}], tests_type),
            "private_tests": pa.array([{"input": ["5 5\n"], "output": ["10\n"]}, {"input": [], "output": []}], tests_type),
            "generated_tests": pa.array([{"input": ["0 0\n"], "output": ["0\n"]}, None], tests_type),
            "time_limit": pa.array(
                [{"seconds": 2, "nanos": 500000000}, None], pa.struct([("seconds", pa.int64()), ("nanos", pa.int64())])
            ),
            "solutions": pa.array(
                [
                    {"language": [2, 3, 3], "solution": ["int main(){}", "print(sum(map(int, input().split())))", "other"]},
                    {"language": [2], "solution": ["int main(){}"]},
                ],
                pa.struct([("language", pa.list_(pa.int32())), ("solution", pa.list_(pa.string()))]),
            ),
        }
    )
    path = tmp_path / "code_contests.parquet"
    pq.write_table(table, path)
    first, second = load_prompts(path)
    assert first.tests == CodeTests(
        stdio=(StdioCase("1 2\n", "3\n"), StdioCase("5 5\n", "10\n"), StdioCase("0 0\n", "0\n")), time_limit_s=2.5
    )
    assert first.solution == "print(sum(map(int, input().split())))" and first.prompt == "Print a+b."
    assert second.tests == CodeTests(stdio=(StdioCase("x\n", "x\n"),)) and second.solution is None


# ----- plug-ins and the task column -----


def test_plugin_row_keeps_its_fields(tmp_path: Path) -> None:
    rows = [
        {"prompt": "Give JSON.", "task": "json_schema", "schema": {"type": "object"}, "strict": True, "answer": "{}"},
        {"prompt": "Give more JSON.", "task": "json_schema", "schema": {"type": "array"}, "max_new_tokens": 9},
        {"prompt": "1+1?", "answer": "2"},
    ]
    plug, plug_no_answer, math_row = load_prompts(write_jsonl(tmp_path / "plug.jsonl", rows), plugins=["json_schema"])
    assert (plug.task, plug.answer, plug.tests) == ("json_schema", "{}", None)
    assert plug.fields == {"schema": {"type": "object"}, "strict": True}
    assert (plug_no_answer.answer, plug_no_answer.max_new_tokens) == ("", 9)
    assert plug_no_answer.fields == {"schema": {"type": "array"}}
    assert (math_row.task, math_row.answer) == (MATH_TASK, "2")
    request = reward_request(plug, "{}")
    assert (request.kind, request.plugin, request.reference, request.metadata) == (
        "plugin", "json_schema", "{}", {"schema": {"type": "object"}, "strict": True}
    )


def test_plugin_rows_in_parquet_keep_non_null_fields(tmp_path: Path) -> None:
    rows = [
        {"prompt": "a", "task": "judge", "rubric": "be kind", "weight": 2.0},
        {"prompt": "b", "task": "judge", "rubric": None, "weight": 1.0},
    ]
    path = tmp_path / "plug.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    first, second = load_prompts(path, plugins=("judge",))
    assert first.fields == {"rubric": "be kind", "weight": 2.0}
    assert second.fields == {"weight": 1.0}


def test_unknown_task_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "task": "judge"}])
    with pytest.raises(DatasetError) as info:
        load_prompts(path, plugins=["json_schema"])
    assert str(info.value) == (
        f"{path}, line 2 (row 1): field 'task': unknown task 'judge'; known tasks: math, code, json_schema; "
        "a plug-in task must be configured under reward.plugins"
    )
    with pytest.raises(DatasetError, match=r"known tasks: math, code \(no plug-ins configured\)"):
        load_prompts(path)


def test_task_argument_must_agree_with_the_task_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1", "task": "math"}])
    assert load_prompts(path, task="math")[0].task == MATH_TASK
    with pytest.raises(DatasetError, match=r"line 1 \(row 0\): field 'task' is 'math', but this file is loaded as task 'code'"):
        load_prompts(path, task="code")
