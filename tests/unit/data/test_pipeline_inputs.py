"""The pipeline's synthetic inputs: RL prompts, held-out split and warm-start set are disjoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.launch.stages import prepare_inputs
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


def test_existing_files_are_left_alone(tmp_path: Path) -> None:
    run = config(tmp_path, n_sft=50)
    prepare_inputs(run)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.parquet")}
    prepare_inputs(run.model_copy(update={"seed": 3}))
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.parquet")} == before
