"""Mixture files: weighted epochs, distinct prompt ids, validation and dataset_files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import pytest

from asyncrl.tasks.data.loader import dataset_files, load_prompts
from asyncrl.tasks.data.records import CODE_TASK, MATH_TASK, DatasetError
from asyncrl.tasks.data.mixture import resolve_source

TESTS = json.dumps({"stdio": [{"input": "", "output": "x\n"}]})


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "data" / "small.jsonl", [{"prompt": f"small {i}", "answer": str(i)} for i in range(3)])
    write_jsonl(tmp_path / "data" / "big.jsonl", [{"prompt": f"big {i}", "answer": str(i)} for i in range(9)])
    write_jsonl(tmp_path / "data" / "code.jsonl", [{"prompt": f"code {i}", "tests": TESTS} for i in range(4)])
    return tmp_path


def write_mixture(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_weights_give_the_stated_counts_and_distinct_ids(sources: Path) -> None:
    mixture = write_mixture(
        sources / "mix.yaml",
        "seed: 7\nsources:\n"
        "  - {path: data/small.jsonl, weight: 3}\n"
        "  - {path: data/big.jsonl, weight: 1}\n"
        "  - {path: data/code.jsonl, task: code}\n",
    )
    records = load_prompts(mixture)
    # N = 3 + 9 + 4 = 16, W = 5: c = floor(16*3/5 + .5), floor(16/5 + .5), floor(16/5 + .5) = 10, 3, 3
    by_source = Counter(r.prompt_id.split(":", 1)[0] for r in records)
    assert by_source == {"0": 10, "1": 3, "2": 3}
    assert len({r.prompt_id for r in records}) == len(records) == 16
    small = [r for r in records if r.prompt_id.startswith("0:")]
    assert sorted(Counter(r.prompt for r in small).values()) == [3, 3, 4]  # cycled through a shuffle
    originals = {r.prompt_id: r for r in load_prompts(sources / "data" / "small.jsonl")}
    for record in small:
        base, _, repeat = record.prompt_id[2:].partition("~")
        assert record.prompt == originals[base].prompt and record.answer == originals[base].answer
        assert repeat in ("", "1", "2", "3")
    big = [r for r in records if r.prompt_id.startswith("1:")]
    assert len({r.prompt for r in big}) == 3 and not any("~" in r.prompt_id for r in big)  # a subset, no repeats
    assert {r.task for r in records if r.prompt_id.startswith("2:")} == {CODE_TASK}
    assert {r.task for r in small + big} == {MATH_TASK}
    again = load_prompts(str(mixture))
    assert [r.prompt_id for r in again] == [r.prompt_id for r in records]
    reseeded = load_prompts(write_mixture(sources / "mix2.yml", mixture.read_text().replace("seed: 7", "seed: 8")))
    assert [r.prompt_id for r in reseeded] != [r.prompt_id for r in records]


def test_equal_weights_keep_every_row_once(sources: Path) -> None:
    mixture = write_mixture(sources / "mix.yaml", "sources:\n  - path: data/small.jsonl\n  - path: data/small.jsonl\n")
    records = load_prompts(mixture)
    assert sorted(r.prompt_id for r in records) == sorted(
        f"{i}:{r.prompt_id}" for i in (0, 1) for r in load_prompts(sources / "data" / "small.jsonl")
    )


def test_dataset_files_lists_the_mixture_and_its_resolved_sources(sources: Path) -> None:
    absolute = sources / "data" / "big.jsonl"
    (sources / "conf").mkdir()
    mixture = write_mixture(sources / "conf" / "mix.yaml", f"sources:\n  - path: ../data/small.jsonl\n  - path: {absolute}\n")
    assert dataset_files(mixture) == [str(mixture), str(sources / "data" / "small.jsonl"), str(absolute)]
    assert dataset_files(absolute) == [str(absolute)]
    assert len(load_prompts(mixture)) == 12


def test_resolve_source_keeps_uris_and_joins_relative_paths() -> None:
    assert resolve_source("s3://bucket/mixes/mix.yaml", "../data/a.parquet") == "s3://bucket/data/a.parquet"
    assert resolve_source("s3://bucket/mix.yaml", "gs://other/b.jsonl") == "gs://other/b.jsonl"
    assert resolve_source("/x/y/mix.yaml", "z.jsonl") == "/x/y/z.jsonl"
    assert resolve_source("/x/y/mix.yaml", "/abs.jsonl") == "/abs.jsonl"


def test_a_mixture_on_an_fsspec_filesystem() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/mixtest/data/a.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    fs.pipe("/mixtest/mix.yaml", b"sources:\n  - {path: data/a.jsonl, weight: 2}\n")
    try:
        records = load_prompts("memory://mixtest/mix.yaml")
        assert sorted(r.prompt for r in records) == ["a", "b"]
        assert dataset_files("memory://mixtest/mix.yaml") == ["memory://mixtest/mix.yaml", "memory://mixtest/data/a.jsonl"]
    finally:
        fs.rm("/mixtest", recursive=True)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("sources: []\n", "field 'sources': List should have at least 1 item after validation, not 0"),
        ("seed: 1\n", "field 'sources': Field required"),
        ("sources:\n  - {path: data/small.jsonl, weight: 0}\n", "field 'sources[0].weight': Input should be greater than 0"),
        ("sources:\n  - {path: data/small.jsonl, wieght: 2}\n", "field 'sources[0].wieght': Extra inputs are not permitted"),
        ("sources:\n  - {weight: 2}\n", "field 'sources[0].path': Field required"),
        ("sources:\n  - {path: data/small.jsonl}\nseed: 1.5\n", "field 'seed': Input should be a valid integer"),
        ("- a\n- b\n", "a mixture file must be a mapping with 'sources' (and optional 'seed'), got list"),
        ("sources:\n  - {path: data/small.jsonl, task: judge}\n", "sources[0]: field 'task': unknown task 'judge'; known tasks: math, code"),
        ("sources:\n  - {path: other.yaml}\n", "sources[0].path: 'OTHER' is a mixture; sources must be data files"),
        ("sources: [\n", "not valid YAML"),
    ],
)
def test_bad_mixture_names_the_file_and_field(sources: Path, text: str, problem: str) -> None:
    mixture = write_mixture(sources / "mix.yaml", text)
    problem = problem.replace("'OTHER'", repr(str(sources / "other.yaml")))
    with pytest.raises(DatasetError) as info:
        load_prompts(mixture)
    message = str(info.value)
    assert message.startswith(f"{mixture}: ") and problem in message


def test_a_source_task_applies_to_its_rows(sources: Path) -> None:
    mixture = write_mixture(sources / "mix.yaml", "sources:\n  - {path: data/small.jsonl, task: code}\n")
    with pytest.raises(DatasetError) as info:
        load_prompts(mixture)
    assert str(info.value) == f"{sources / 'data' / 'small.jsonl'}, line 1 (row 0): field 'tests' is missing"
    plug = write_mixture(sources / "plug.yaml", "sources:\n  - {path: data/small.jsonl, task: judge}\n")
    records = load_prompts(plug, plugins=["judge"])
    assert {r.task for r in records} == {"judge"} and {r.answer for r in records} == {"0", "1", "2"}


def test_a_missing_source_names_its_path(sources: Path) -> None:
    mixture = write_mixture(sources / "mix.yaml", "sources:\n  - {path: data/nowhere.parquet}\n")
    with pytest.raises(DatasetError, match=rf"^{sources / 'data' / 'nowhere.parquet'}: file not found"):
        load_prompts(mixture)
