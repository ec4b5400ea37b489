"""load_prompts: our Parquet, GSM8K JSON Lines, users' Parquet, and each bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.records import DatasetError, PromptRecord
from asyncrl.tasks.data.formats import split_final_answer
from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, write_synthetic_dataset

GSM8K_ROWS: list[dict[str, Any]] = [
    {
        "question": "Tom has 1,000 apples and buys 234 more. How many?",
        "answer": "He has 1,000 + 234 = <<1000+234=1234>>1,234 apples.\n#### 1,234",
    },
    {
        "question": "It is 3 degrees and drops by 8. What is the temperature?",
        "answer": "3 - 8 = <<3-8=-5>>-5\n#### -5",
    },
    {"question": "A debt of 1,500 is paid back 500. Balance?", "answer": "-1500 + 500 = -1000\n####   -1,000  "},
    {"question": "What is 6*7?", "answer": "#### 42"},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_parquet_round_trip(tmp_path: Path) -> None:
    path = write_synthetic_dataset(tmp_path / "train.parquet", 300, seed=11)
    records = load_prompts(path)
    problems = make_arithmetic_dataset(300, seed=11)
    assert [r.prompt for r in records] == [p.prompt for p in problems]
    assert [r.answer for r in records] == [p.answer for p in problems]
    assert [r.solution for r in records] == [p.solution for p in problems]
    assert len({r.prompt_id for r in records}) == 300
    assert [r.prompt_id for r in load_prompts(str(path))] == [r.prompt_id for r in records]


def test_prompt_ids_are_distinct_for_repeated_prompts_and_follow_content(tmp_path: Path) -> None:
    rows = [{"prompt": "What is 1+1?", "answer": "2"}] * 2
    first = load_prompts(write_jsonl(tmp_path / "a.jsonl", rows))
    assert first[0].prompt_id != first[1].prompt_id
    changed = load_prompts(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "What is 1+2?", "answer": "3"}]))
    assert changed[0].prompt_id != first[0].prompt_id


def test_gsm8k_jsonl(tmp_path: Path) -> None:
    records = load_prompts(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert [r.answer for r in records] == ["1234", "-5", "-1000", "42"]
    assert records[0].prompt == GSM8K_ROWS[0]["question"]
    assert records[0].solution == "He has 1,000 + 234 = <<1000+234=1234>>1,234 apples."
    assert records[1].solution == "3 - 8 = <<3-8=-5>>-5"
    assert records[3].solution is None


def test_blank_lines_are_skipped_and_rows_counted(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n" + json.dumps(GSM8K_ROWS[0]) + "\n\n" + json.dumps(GSM8K_ROWS[1]) + "\n", encoding="utf-8")
    records = load_prompts(path)
    assert [r.answer for r in records] == ["1234", "-5"]
    assert records[1].prompt_id.startswith("000001-")


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.json"
    path.write_text(json.dumps(GSM8K_ROWS), encoding="utf-8")
    assert [r.answer for r in load_prompts(path)] == ["1234", "-5", "-1000", "42"]


def test_user_parquet_in_gsm8k_layout(tmp_path: Path) -> None:
    path = tmp_path / "user.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    records = load_prompts(path)
    assert [r.answer for r in records] == ["1234", "-5", "-1000", "42"]
    assert records[1].solution == "3 - 8 = <<3-8=-5>>-5"


def test_named_fields_and_numeric_answers(tmp_path: Path) -> None:
    path = tmp_path / "custom.parquet"
    pq.write_table(pa.table({"problem": ["What is 2*3?", "Half of 5?"], "final": [6.0, 2.5], "other": [1, 2]}), path)
    records = load_prompts(path, prompt_field="problem", answer_field="final")
    assert records == [
        PromptRecord(prompt_id=records[0].prompt_id, prompt="What is 2*3?", answer="6"),
        PromptRecord(prompt_id=records[1].prompt_id, prompt="Half of 5?", answer="2.5"),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 1,234", (None, "1234")),
        ("a\n#### -12,345,678", ("a", "-12345678")),
        ("x #### 3.5", ("x", "3.5")),
        ("17", (None, "17")),
        ("#### 1,2345", (None, "1,2345")),  # not thousands groups: kept as written
    ],
)
def test_split_final_answer(text: str, expected: tuple[str | None, str]) -> None:
    assert split_final_answer(text) == expected


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"question": "q?"}, "field 'answer' is missing"),
        ({"question": "q?", "answer": None}, "field 'answer' is null"),
        ({"question": "  ", "answer": "#### 1"}, "field 'question' is empty"),
        ({"question": "q?", "answer": "work\n#### "}, "field 'answer' has nothing after '####'"),
        ({"question": "q?", "answer": ["1"]}, "field 'answer' must be text or a number, got list ['1']"),
    ],
)
def test_bad_jsonl_row_names_file_line_and_field(tmp_path: Path, row: dict[str, Any], problem: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], GSM8K_ROWS[1], row])
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}, line 3 (row 2): {problem}"


def test_bad_parquet_row_names_file_row_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?", "c?"], "answer": ["1", None, "3"]}), path)
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}, row 1: field 'answer' is null"


def test_parquet_without_prompt_column_lists_columns(tmp_path: Path) -> None:
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"text": ["a"], "answer": ["1"]}), path)
    with pytest.raises(
        DatasetError, match=r"no prompt field; expected one of prompt, question .*columns: text, answer"
    ):
        load_prompts(path)
    with pytest.raises(DatasetError, match=r"answer field 'label' is missing; columns: text, answer"):
        load_prompts(path, prompt_field="text", answer_field="label")


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n" + '{"question": "q", "answer": \n', encoding="utf-8")
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))}, line 2: malformed JSON \(Expecting value at column 29\)$"
    ):
        load_prompts(path)


def test_json_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.jsonl"
    path.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}, line 1: expected a JSON object, got list$"):
        load_prompts(path)


def test_unknown_extension_names_path_and_supported_formats(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("prompt,answer\n", encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}: unsupported file extension '.csv'")
    assert ".parquet" in message and ".jsonl" in message


def test_missing_file_names_path_and_supported_formats(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}: file not found (expected Parquet (.parquet")


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: contains no records$"):
        load_prompts(path)


def test_corrupt_parquet_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: not a readable Parquet file"):
        load_prompts(path)


def test_per_prompt_budget_column(tmp_path: Path) -> None:
    path = tmp_path / "budgets.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?", "c?"], "answer": ["1", "2", "3"], "max_new_tokens": [8, None, 300]}), path)
    assert [r.max_new_tokens for r in load_prompts(path)] == [8, None, 300]
    rows = [{"prompt": "a?", "answer": "1", "max_new_tokens": 4.0}, {"prompt": "b?", "answer": "2"}]
    assert [r.max_new_tokens for r in load_prompts(write_jsonl(tmp_path / "b.jsonl", rows))] == [4, None]
    assert load_prompts(write_synthetic_dataset(tmp_path / "plain.parquet", 3, seed=0))[0].max_new_tokens is None


@pytest.mark.parametrize("budget", [0, -3, 2.5, "16", True])
def test_bad_budget_names_file_row_and_field(tmp_path: Path, budget: Any) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a?", "answer": "1", "max_new_tokens": budget}])
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}, line 1 (row 0): field 'max_new_tokens' must be an int >= 1 or null, got {budget!r}"


def test_a_json_lines_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    good = json.dumps(GSM8K_ROWS[0]).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + '{"question": "caf\u00e9", "answer": "1"}'.encode("latin-1") + b"\n")
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: not UTF-8 text (byte ") and "column 18" in message
    assert message.endswith("save the file as UTF-8")


@pytest.mark.parametrize("large", [False, True])
def test_a_parquet_string_column_that_is_not_utf8_names_the_row_and_field(large: bool, tmp_path: Path) -> None:
    """Parquet stores string columns unchecked; a row with Latin-1 bytes is named, not a bare
    UnicodeDecodeError."""
    binary, string = (pa.large_binary(), pa.large_string()) if large else (pa.binary(), pa.string())
    prompts = pa.array([b"What is 1+1?", b"What is 2+2?", "Caf\u00e9: 3+3?".encode("latin-1")], binary).view(string)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": prompts, "answer": pa.array(["2", "4", "6"])}), path)
    with pytest.raises(DatasetError, match=re.escape(f"{path}, row 2: field 'prompt' is not UTF-8 text (byte 3 of the value)")):
        load_prompts(path)
