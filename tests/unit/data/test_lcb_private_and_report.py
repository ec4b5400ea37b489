"""LiveCodeBench's pickled private tests (decoded with every global refused) and the report
of what a load read."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import re
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.tasks.data.loader import LoadReport, load_prompts, load_prompts_with_report
from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.reward.types import CallCase, CodeTests, StdioCase

CALLED: list[str] = []


class Trap:
    """A global with a visible side effect: constructing it records the call."""

    def __init__(self) -> None:
        CALLED.append("Trap")

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return Trap, ()  # unpickling calls Trap()


def packed(payload: bytes) -> str:
    """A pickle as LiveCodeBench ships it: base64(zlib(pickle))."""
    return base64.b64encode(zlib.compress(payload)).decode("ascii")


def lcb_row(private: Any, public: list[dict[str, str]] | None = None) -> dict[str, Any]:  # noqa: ANN401
    return {
        "question_content": "Read two integers; print their sum.",
        "public_test_cases": json.dumps(public or [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": private,
        "metadata": json.dumps({"func_name": "add"}),
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


PRIVATE = [
    {"input": "5 5\n", "output": "10\n", "testtype": "stdin"},
    {"input": "-1 1\n", "output": "0\n", "testtype": "stdin"},
]


def test_pickled_private_cases_are_decoded_and_used(tmp_path: Path) -> None:
    rows = [lcb_row(packed(pickle.dumps(json.dumps(PRIVATE))))]
    (record,) = load_prompts(write_jsonl(tmp_path / "lcb.jsonl", rows))
    assert record.tests == CodeTests(
        stdio=(StdioCase("1 2\n", "3\n"), StdioCase("5 5\n", "10\n"), StdioCase("-1 1\n", "0\n"))
    )


def test_pickled_private_cases_in_parquet_with_functional_cases(tmp_path: Path) -> None:
    private = [{"input": "[1, 2]\n3", "output": "[4]", "testtype": "functional"}]
    public = [{"input": "[0]\n0", "output": "[0]", "testtype": "functional"}]
    path = tmp_path / "lcb.parquet"
    pq.write_table(pa.Table.from_pylist([lcb_row(packed(pickle.dumps(json.dumps(private), protocol=0)), public)]), path)
    (record,) = load_prompts(path)
    assert record.tests == CodeTests(calls=(CallCase("add", "[[0], 0]", "[0]"), CallCase("add", "[[1, 2], 3]", "[4]")))


def test_plain_json_private_cases_still_work(tmp_path: Path) -> None:
    for private in (json.dumps(PRIVATE), PRIVATE):
        (record,) = load_prompts(write_jsonl(tmp_path / "lcb.jsonl", [lcb_row(private)]))
        assert record.tests is not None and len(record.tests.stdio) == 3


def test_a_pickle_naming_a_class_is_refused_and_never_called(tmp_path: Path) -> None:
    payload = pickle.dumps(Trap())
    CALLED.clear()
    pickle.loads(payload)  # the control: a plain unpickler would construct it
    assert CALLED == ["Trap"]
    CALLED.clear()
    rows = [lcb_row(json.dumps(PRIVATE)), lcb_row(packed(payload))]
    with pytest.raises(DatasetError) as caught:
        load_prompts(write_jsonl(tmp_path / "lcb.jsonl", rows))
    assert str(caught.value) == (
        f"{tmp_path / 'lcb.jsonl'}, line 2 (row 1): field 'private_test_cases': "
        f"the pickle names a global ({Trap.__module__}.Trap); refusing to load it"
    )
    assert CALLED == []


@pytest.mark.parametrize(
    ("opcodes", "name"),
    [
        (b"cos\nsystem\n(Vtouch {flag}\ntR.", "os.system"),
        (b"c__builtin__\neval\n(V__import__('pathlib').Path('{flag}').touch()\ntR.", "__builtin__.eval"),
        (b"\x80\x04\x8c\x08builtins\x8c\x04exec\x93V__import__('pathlib').Path('{flag}').touch()\n\x85R.", "builtins.exec"),
    ],
    ids=["GLOBAL os.system", "GLOBAL __builtin__.eval", "STACK_GLOBAL builtins.exec"],
)
def test_crafted_code_running_pickles_are_refused(tmp_path: Path, opcodes: bytes, name: str) -> None:
    flag = tmp_path / "ran"
    payload = opcodes.replace(b"{flag}", str(flag).encode())
    refusal = rf"row 0\): field 'private_test_cases': the pickle names a global \({re.escape(name)}\); refusing to load it$"
    with pytest.raises(DatasetError, match=refusal):
        load_prompts(write_jsonl(tmp_path / "lcb.jsonl", [lcb_row(packed(payload))]))
    assert not flag.exists()


@pytest.mark.parametrize(
    ("private", "message"),
    [
        ("not base64 at all!", "field 'private_test_cases': neither a JSON list nor base64(zlib(pickle)) text"),
        (base64.b64encode(zlib.compress(b"garbage")).decode(), "field 'private_test_cases': not a readable pickle"),
        (packed(pickle.dumps("[{")), "field 'private_test_cases': the unpickled value is not valid JSON"),
        (packed(pickle.dumps(json.dumps({"input": "1"}))), "field 'private_test_cases': expected a list of test cases, got dict"),
    ],
    ids=["not base64", "not a pickle", "not JSON inside", "not a list"],
)
def test_a_private_field_in_no_known_form_fails_the_load(tmp_path: Path, private: str, message: str) -> None:
    with pytest.raises(DatasetError, match=re.escape(message)):
        load_prompts(write_jsonl(tmp_path / "lcb.jsonl", [lcb_row(private)]))


# ----- the load report -----


def mixed_dataset(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}])
    functional = [{"input": "[1]\n2", "output": "3", "testtype": "functional"}]
    write_jsonl(
        tmp_path / "lcb.jsonl",
        [lcb_row(packed(pickle.dumps(json.dumps(PRIVATE)))), lcb_row(json.dumps(functional), public=functional)],
    )
    write_jsonl(
        tmp_path / "cc.jsonl",
        [
            {
                "description": "Print the sum.",
                "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                "private_tests": {"input": ["2 2\n"], "output": ["4\n"]},
                "generated_tests": {"input": ["0 0\n", "9 1\n"], "output": ["0\n", "10\n"]},
            }
        ],
    )
    tests = {"stdio": [{"input": "", "output": "x\n"}], "asserts": ["assert f() == 1", "assert f() != 2"]}
    write_jsonl(tmp_path / "code.jsonl", [{"prompt": "Write f.", "tests": json.dumps(tests)}])
    mixture = tmp_path / "mix.yaml"
    mixture.write_text(
        "sources:\n" + "".join(f"  - path: {name}\n" for name in ("gsm8k.jsonl", "lcb.jsonl", "cc.jsonl", "code.jsonl")),
        encoding="utf-8",
    )
    return mixture


def test_the_report_counts_rows_and_tests_per_kind(tmp_path: Path) -> None:
    mixture = mixed_dataset(tmp_path)
    records, report = load_prompts_with_report(mixture)
    assert report == LoadReport(
        path=str(mixture),
        files=tuple(
            (str(tmp_path / name), layout)
            for name, layout in (
                ("gsm8k.jsonl", "GSM8K"), ("lcb.jsonl", "LiveCodeBench"), ("cc.jsonl", "CodeContests"), ("code.jsonl", "code")
            )
        ),
        rows={"math": 2, "code": 4},
        tests={"stdio": 8, "call": 2, "assert": 2},
        test_origins={"public": 3, "private": 4, "generated": 2, "unsplit": 3},
        records=len(records),
    )
    assert len(records) == 8  # 6 rows in 4 equal-weight sources: 2 records each
    assert report.summary() == (
        f"{mixture}: mixture of 4 files [{tmp_path / 'gsm8k.jsonl'} (GSM8K), {tmp_path / 'lcb.jsonl'} (LiveCodeBench), "
        f"{tmp_path / 'cc.jsonl'} (CodeContests), {tmp_path / 'code.jsonl'} (code)], 8 records per epoch: "
        "6 rows: math 2, code 4; code tests 12: stdio 8, call 2, assert 2; public 3, private 4, generated 2, unsplit 3"
    )


def test_a_load_logs_its_report_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mixture = mixed_dataset(tmp_path)
    with caplog.at_level(logging.INFO, logger="asyncrl.data"):
        load_prompts(mixture)
        load_prompts(tmp_path / "gsm8k.jsonl")
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.data"]
    assert len(lines) == 2  # one per load; a mixture's sources are not logged apart
    assert lines[0].startswith(f"dataset {mixture}: mixture of 4 files")
    assert lines[1] == f"dataset {tmp_path / 'gsm8k.jsonl'} (GSM8K): 2 rows: math 2"
