"""Bad rows of each layout are refused at load with the file, row and field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.records import DatasetError

GOOD: dict[str, dict[str, Any]] = {
    "code": {"prompt": "p", "tests": json.dumps({"stdio": [{"input": "", "output": "x"}]})},
    "apps": {"question": "q", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})},
    "lcb": {
        "question_content": "q",
        "public_test_cases": json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}]),
        "metadata": "{}",
    },
    "cc": {"description": "d", "public_tests": {"input": ["1\n"], "output": ["1\n"]}},
    "math": {"problem": "p", "solution": "so \\boxed{1}"},
    "gsm8k": {"prompt": "a", "answer": "1"},
}


def with_(layout: str, **changes: Any) -> dict[str, Any]:  # noqa: ANN401
    row = {**GOOD[layout], **changes}
    return {k: v for k, v in row.items() if v is not ...}


def as_json(**value: Any) -> str:  # noqa: ANN401
    return json.dumps(value)


def calls(**case: Any) -> str:  # noqa: ANN401
    return as_json(calls=[{"function": "f", "arguments": "[1]", "expected": "1", **case}])


def functional(inputs: str, **metadata: Any) -> dict[str, Any]:  # noqa: ANN401
    cases = [{"input": inputs, "output": "1", "testtype": "functional"}]
    return with_("lcb", public_test_cases=json.dumps(cases), metadata=json.dumps(metadata))


CASES: list[tuple[str, dict[str, Any], str]] = [
    # asyncrl code layout: prompt + tests
    ("code", with_("code", tests=...), "field 'tests' is missing"),
    ("code", with_("code", tests=None), "field 'tests' is null"),
    ("code", with_("code", tests="{stdio"), "field 'tests': not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    # APPS/TACO: question + input_output
    ("apps", with_("apps", input_output=...), "field 'input_output' is missing"),
    ("apps", with_("apps", input_output="{"), "field 'input_output': not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("apps", with_("apps", input_output=as_json(inputs=["1", "2"], outputs=["1"])), "field 'input_output': 2 inputs but 1 outputs"),
    ("apps", with_("apps", input_output=as_json(inputs=[], outputs=[])), "field 'input_output': no tests: 'inputs' is empty"),
    ("apps", with_("apps", input_output=as_json(inputs="1", outputs=["1"])), "field 'input_output': 'inputs' must be a list, got str"),
    ("apps", with_("apps", input_output=as_json(inputs=[1], outputs=["1"])), "field 'input_output': inputs[0] must be text or a list of text lines, got int 1"),
    ("apps", with_("apps", input_output=as_json(fn_name="f", inputs=["1"], outputs=[1])), "field 'input_output': inputs[0] must be the argument list of f(), got str"),
    ("apps", with_("apps", input_output=as_json(fn_name="", inputs=[[1]], outputs=[1])), "field 'input_output': 'fn_name' must be a function name (a Python identifier), got ''"),
    ("apps", with_("apps", time_limit="fast"), "field 'time_limit': must be a number of seconds or text like '2 seconds', got 'fast'"),
    ("apps", with_("apps", solutions='{"a": 1}'), "field 'solutions': must be a JSON list of programs, got dict"),
    # LiveCodeBench: question_content + public_test_cases (+ metadata)
    ("lcb", functional("1"), "field 'metadata': a functional test case needs 'func_name' (a Python identifier), got metadata {}"),
    ("lcb", functional("[1, 2\n3", func_name="f"), "field 'public_test_cases': [0].input line 1 is not valid JSON (Expecting ',' delimiter): '[1, 2'"),
    ("lcb", with_("lcb", public_test_cases=json.dumps([{"input": "1", "output": "1", "testtype": "stdout"}])), "field 'public_test_cases': [0].testtype must be 'stdin' or 'functional', got 'stdout'"),
    ("lcb", with_("lcb", public_test_cases=json.dumps([{"input": 1, "output": "1", "testtype": "stdin"}])), "field 'public_test_cases': [0].input must be text, got int"),
    ("lcb", with_("lcb", public_test_cases="[]"), "field 'public_test_cases': no tests: the list is empty"),
    ("lcb", with_("lcb", public_test_cases='{"input": "1"}'), "field 'public_test_cases': expected a list of test cases, got dict"),
    ("lcb", with_("lcb", private_test_cases="[{"), "field 'private_test_cases': not valid JSON (Expecting property name enclosed in double quotes at line 1 column 3)"),
    # CodeContests: description + public/private/generated tests
    ("cc", with_("cc", public_tests={"input": [], "output": []}), "no tests: fields 'public_tests', 'private_tests', 'generated_tests' are all absent or empty"),
    ("cc", with_("cc", public_tests={"input": ["1", "2"], "output": ["1"]}), "field 'public_tests': 2 inputs but 1 outputs"),
    ("cc", with_("cc", public_tests=["1"]), "field 'public_tests': expected an object with 'input' and 'output' lists, got list"),
    ("cc", with_("cc", time_limit={"seconds": -1}), "field 'time_limit': 'seconds' and 'nanos' must be numbers >= 0, got {'seconds': -1}"),
    # MATH: problem + solution with \boxed{}
    ("math", with_("math", solution="no box"), "field 'solution' has no complete, non-empty \\boxed{...} answer and the file has no 'answer' column"),
    ("math", with_("math", solution="\\boxed{\\frac{1}{2}"), "field 'solution' has no complete, non-empty \\boxed{...} answer and the file has no 'answer' column"),
    # the task column must agree with the layout
    ("gsm8k", with_("gsm8k", task="code"), "field 'tests' is missing"),
    ("apps", with_("apps", task="math"), "field 'answer' is missing"),
    ("gsm8k", with_("gsm8k", task=3), "field 'task' must be text, got int 3"),
]


@pytest.mark.parametrize(("layout", "row", "problem"), CASES)
def test_bad_row_names_file_row_and_field(tmp_path: Path, layout: str, row: dict[str, Any], problem: str) -> None:
    path = tmp_path / f"{layout}.jsonl"
    path.write_text(json.dumps(GOOD[layout]) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}, line 2 (row 1): {problem}"


# The tests format is checked by code_reward.code_tests_from_json, whose wording this test
# does not fix: the message names file, row and field, and the problem.
TESTS_CASES: list[tuple[dict[str, Any], str]] = [
    (with_("code", tests="[1]"), 'got list'),
    (with_("code", tests=as_json(stdio=[], asserts=[])), 'no tests'),
    (with_("code", tests=as_json(stdio="x")), "'stdio'"),
    (with_("code", tests=as_json(stdio=[{"input": 1, "output": "1"}])), 'stdio[0].input'),
    (with_("code", tests=as_json(stdin=[])), "unknown key(s) ['stdin']"),
    (with_("code", tests=as_json(asserts=[" "])), 'asserts[0] must be'),
    (with_("code", tests=calls(arguments="1")), 'calls[0].arguments'),
    (with_("code", tests=calls(expected="nope")), 'calls[0].expected'),
    (with_("code", tests=calls(function="")), 'calls[0].function'),
    (with_("code", tests=as_json(asserts=["assert 1"], time_limit_s=-1)), 'time_limit_s'),
]


@pytest.mark.parametrize(("row", "problem"), TESTS_CASES)
def test_bad_tests_name_file_row_and_field(tmp_path: Path, row: dict[str, Any], problem: str) -> None:
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(GOOD["code"]) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 2 (row 1): field 'tests': ") and problem in message, message


def test_every_good_row_loads(tmp_path: Path) -> None:
    for layout, row in GOOD.items():
        path = tmp_path / f"{layout}.jsonl"
        path.write_text(json.dumps(row) + "\n", encoding="utf-8")
        assert len(load_prompts(path)) == 1


def test_a_plugin_field_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plug.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "task": ["judge"], "blob": pa.array([b"\x00\x01"], pa.binary())}), path)
    with pytest.raises(DatasetError) as info:
        load_prompts(path, plugins=["judge"])
    assert str(info.value).startswith(f"{path}, row 0: field 'blob' is not JSON-able, so a plug-in cannot get it (")


def test_a_file_without_any_layout_lists_the_layouts(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"text": "a", "label": 1}) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 1 (row 0): no prompt field; expected one of prompt, question (GSM8K, APPS/TACO)")
    assert "question_content (LiveCodeBench)" in message and message.endswith("columns: text, label")
    path.write_text(json.dumps({"prompt": "a", "label": 1}) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"answer field 'answer' is missing .*; columns: prompt, label$"):
        load_prompts(path)
