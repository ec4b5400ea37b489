"""The data stage of a run on a folder ``data.train_path``: its files are the ones the run
chose, its cache key changes with that choice, and the config refuses what a folder cannot be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.loading import ConfigError, config_from_dict
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.data.train_files import choose_train_files, train_files
from asyncrl.tasks.pipeline import stages
from asyncrl.tasks.system.run_paths import run_paths


def write_jsonl(path: Path, count: int, start: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": f"{i}+2=?", "answer": f"#### {i + 2}"}) + "\n"
                            for i in range(start, start + count)))  # fmt: skip


def raw(tmp_path: Path, name: str = "folder-run", **data: Any) -> dict[str, Any]:
    return {
        "name": name,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "prompts") + "/", **data},
        "storage": {"root": str(tmp_path / "roots" / name)},
    }


def test_the_data_stage_reads_the_chosen_files_and_its_key_follows_the_choice(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "prompts" / "a.jsonl", 2)
    write_jsonl(tmp_path / "prompts" / "b.jsonl", 2, start=5)
    first = RunConfig.model_validate(raw(tmp_path, "night-1"))
    choose_train_files(first.data, first.seed, run_paths(first).root, earlier=frozenset)
    assert stages.data_paths(first) == {
        "data.train_path[0]": str(tmp_path / "prompts" / "a.jsonl"), "data.train_path[1]": str(tmp_path / "prompts" / "b.jsonl"),
    }  # fmt: skip
    assert stages.data_present(first)
    assert set(stages.prepare_data(first)) == set(stages.data_files(first))
    key = stages.data_key(first)

    write_jsonl(tmp_path / "prompts" / "c.jsonl", 2, start=9)
    assert stages.data_key(first) == key  # the run's choice is kept: a restart hits the cache

    second = RunConfig.model_validate(raw(tmp_path, "night-2"))
    trained = set(train_files(first.data, run_paths(first).root) or ())
    choose_train_files(second.data, second.seed, run_paths(second).root, earlier=lambda: trained)
    assert stages.data_files(second) == [str(tmp_path / "prompts" / "c.jsonl")]
    assert stages.data_key(second) != key


def test_a_malformed_chosen_file_fails_the_data_stage_naming_its_key(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "prompts" / "a.jsonl", 2)
    (tmp_path / "prompts" / "b.jsonl").write_text("{not json\n")
    config = RunConfig.model_validate(raw(tmp_path))
    choose_train_files(config.data, config.seed, run_paths(config).root, earlier=frozenset)
    with pytest.raises(DatasetError, match=r"^data\.train_path\[1\]: .*b\.jsonl, line 1: malformed JSON"):
        stages.prepare_data(config)


def test_a_folder_without_a_choice_is_refused_by_the_data_stage_naming_the_field(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "prompts" / "a.jsonl", 2)
    with pytest.raises(DatasetError, match=r"^data\.train_path: .* is a folder"):
        stages.data_key(RunConfig.model_validate(raw(tmp_path)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data": {"replay_fraction": 1.5}}, r"data\.replay_fraction: Input should be less than or equal to 1"),
        ({"data": {"replay_fraction": -0.5}}, r"data\.replay_fraction: Input should be greater than or equal to 0"),
        ({"pipeline": {"synthetic_data": {"n_train": 4}}}, r"data\.train_path: .* names a folder; pipeline\.synthetic_data"),
        ({"pipeline": {"sft_steps": 2}}, r"pipeline\.sft_steps: .*set data\.sft_path"),
        ({"data": {"train_path": "/d/train.jsonl", "require_new_files": True}, "pipeline": {"synthetic_data": {"n_train": 4}}},
         r"data\.require_new_files: pipeline\.synthetic_data writes data\.train_path"),
    ],
)
def test_what_a_folder_cannot_be_is_refused_naming_the_field(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    config = raw(tmp_path)
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


def test_a_folder_with_its_own_warm_start_set_is_accepted(tmp_path: Path) -> None:
    config = raw(tmp_path, sft_path=str(tmp_path / "sft.jsonl"), replay_fraction=0.25, require_new_files=True)
    config["pipeline"] = {"sft_steps": 2}
    parsed = config_from_dict(config)
    assert parsed.data.train_folder and parsed.data.replay_fraction == 0.25 and parsed.data.require_new_files
