"""The pipeline's synthetic inputs: RL prompts, held-out split and warm-start set are disjoint,
and the files match the settings they were written for (or a user's file is refused, kept)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from asyncrl.configs.loading import ConfigError
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.data.prepared_stamp import file_state, write_stamp
from asyncrl.tasks.pipeline.stages import data_present, prepare_inputs, synthetic_settings
from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, split_train_heldout


def config(tmp_path: Path, **synthetic: Any) -> RunConfig:
    data = {"train_path": str(tmp_path / "train.parquet"), "eval_path": str(tmp_path / "heldout.parquet")}
    if synthetic.get("n_sft"):
        data["sft_path"] = str(tmp_path / "sft.parquet")
    return RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tmp_path / "model")},
            "data": data,
            "pipeline": {"synthetic_data": {"n_train": 300, "n_heldout": 40, "max_steps": 3, **synthetic}},
            "storage": {"root": str(tmp_path / "store")},
        }
    )


def column(path: Path, name: str) -> list[str]:
    return pq.read_table(path).column(name).to_pylist()


def test_warm_start_set_is_disjoint_and_mixed(tmp_path: Path) -> None:
    prepare_inputs(config(tmp_path, n_sft=200, sft_answer_only_share=0.25))
    train, heldout, sft = (column(tmp_path / f"{n}.parquet", "prompt") for n in ("train", "heldout", "sft"))
    assert (len(train), len(heldout), len(sft)) == (300, 40, 200)
    assert not (set(train) & set(heldout) or set(train) & set(sft) or set(heldout) & set(sft))
    answers = column(tmp_path / "sft.parquet", "answer")
    solutions = column(tmp_path / "sft.parquet", "solution")
    assert sum(s == f"#### {a}" for s, a in zip(solutions, answers, strict=True)) == 50
    # The RL prompts keep their worked solutions (they are not trained on by SFT).
    assert all("=" in s for s in column(tmp_path / "train.parquet", "solution"))


def test_without_a_warm_start_set_the_splits_are_the_plain_train_heldout_split(tmp_path: Path) -> None:
    run = config(tmp_path)
    prepare_inputs(run)
    spec = run.pipeline.synthetic_data.spec()  # type: ignore[union-attr]
    train, heldout = split_train_heldout(make_arithmetic_dataset(340, seed=0, spec=spec), 40, seed=0)
    assert column(tmp_path / "train.parquet", "prompt") == [p.prompt for p in train]
    assert column(tmp_path / "heldout.parquet", "prompt") == [p.prompt for p in heldout]
    assert not (tmp_path / "sft.parquet").exists()


def parquet_bytes(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in tmp_path.glob("*.parquet")}


def test_files_written_for_these_settings_are_left_alone(tmp_path: Path) -> None:
    run = config(tmp_path, n_sft=50)
    prepare_inputs(run)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.parquet")}
    assert data_present(run)
    prepare_inputs(run)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.parquet")} == before


def test_files_written_for_other_settings_are_written_again_naming_the_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = config(tmp_path, n_sft=50)
    prepare_inputs(run)
    before = parquet_bytes(tmp_path)
    other = run.model_copy(update={"seed": 3})
    assert not data_present(other)  # a cached stage result would not be reused for them
    with caplog.at_level(logging.WARNING, logger="asyncrl.pipeline"):
        prepare_inputs(other)
    after = parquet_bytes(tmp_path)
    assert set(after) == set(before) and all(after[name] != before[name] for name in before)
    assert "data.train_path" in caplog.text and "seed: 0 -> 3" in caplog.text
    assert data_present(other) and not data_present(run)
    # The same holds for a generator setting: n_train changes the files and is named.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.pipeline"):
        prepare_inputs(config(tmp_path, n_sft=50, n_train=200).model_copy(update={"seed": 3}))
    assert "synthetic.n_train: 300 -> 200" in caplog.text
    assert len(column(tmp_path / "train.parquet", "prompt")) == 200


def test_a_users_file_at_a_synthetic_path_is_refused_and_kept(tmp_path: Path) -> None:
    run = config(tmp_path)
    mine = b"my own prompts, not the generator's"
    (tmp_path / "train.parquet").write_bytes(mine)
    with pytest.raises(ConfigError, match=r"data.train_path: .*train.parquet is there, but it carries no stamp"):
        prepare_inputs(run)
    assert (tmp_path / "train.parquet").read_bytes() == mine
    assert not (tmp_path / "heldout.parquet").exists()  # nothing written before the refusal


def test_a_file_edited_after_it_was_written_is_refused(tmp_path: Path) -> None:
    run = config(tmp_path)
    prepare_inputs(run)
    edited = (tmp_path / "heldout.parquet").read_bytes() + b"\n"
    (tmp_path / "heldout.parquet").write_bytes(edited)
    with pytest.raises(ConfigError, match="data.eval_path: .*changed after the synthetic generator wrote it"):
        prepare_inputs(run.model_copy(update={"seed": 5}))
    assert (tmp_path / "heldout.parquet").read_bytes() == edited


def test_files_of_a_data_stage_killed_while_writing_are_written_again(tmp_path: Path) -> None:
    run = config(tmp_path)
    prepare_inputs(run)
    settings = synthetic_settings(run)
    assert settings is not None
    write_stamp(tmp_path / "train.parquet", settings, pending=True)  # as left by a kill mid-write
    assert file_state(tmp_path / "train.parquet", settings).state == "stale"
    assert not data_present(run)
    prepare_inputs(run)
    assert data_present(run)
