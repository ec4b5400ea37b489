"""The trainer entry point, called in-process (its process behaviour is in test_resume/test_process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.synthetic import write_synthetic_dataset
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.tasks.trainer.main import main
from asyncrl.tasks.trainer.metrics import read_jsonl_metrics

RUN_ID = "trainer-test"


def test_sft_mode_of_the_entry_point_publishes_a_version(
    tiny_model_dir: Path, tmp_path: Path, run_config_writer: Callable[..., Path]
) -> None:
    data = write_synthetic_dataset(tmp_path / "train.parquet", n=8, seed=4)
    config = run_config_writer(tmp_path / "run.yaml", model=tiny_model_dir, store=tmp_path / "store", data=data, trainer={})
    metrics = tmp_path / "sft.jsonl"
    code = main(["--config", str(config), "--mode", "sft", "--sft-steps", "3", "--sft-batch-size", "4",
                 "--work-dir", str(tmp_path / "work"), "--metrics-file", str(metrics)])
    assert code == 0
    store = WeightStore(open_root(str(tmp_path / "store")))
    assert store.list_versions() == [0]
    lineage = json.loads((store.download(0, tmp_path / "v0") / LINEAGE_FILE).read_text())
    assert lineage["stage"] == "sft" and lineage["parent_version"] is None and lineage["steps"] == 3
    assert [r["step"] for r in read_jsonl_metrics(metrics)] == [1, 2, 3]


def test_bad_config_exits_2_before_loading_anything(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("name: x\nmodel: {path: m}\ndata: {train_path: d}\nstorage: {root: s}\ntrainer: {batch_groups: 0}\n")
    assert main(["--config", str(config)]) == 2
    assert "trainer.batch_groups" in capsys.readouterr().err


def test_bad_trajectories_exit_3_and_consume_nothing(
    tiny_model_dir: Path, tmp_path: Path, run_config_writer: Callable[..., Path], trajectories: Any, capsys: Any
) -> None:
    root = open_root(str(tmp_path / "store"))
    group = trajectories.group("g0", [1.0, 0.0])
    group[1] = type(group[1])(**{**vars(group[1]), "prompt_token_ids": [999] * len(group[1].prompt_token_ids)})
    group[0] = type(group[0])(**{**vars(group[0]), "prompt_token_ids": group[1].prompt_token_ids})
    bad = ShardWriter(root, RUN_ID).write_groups([group])
    config = run_config_writer(tmp_path / "run.yaml", model=tiny_model_dir, store=tmp_path / "store",
                               data=tmp_path / "unused.parquet", trainer={"batch_groups": 1, "max_steps": 1})
    assert main(["--config", str(config), "--work-dir", str(tmp_path / "work")]) == 3
    err = capsys.readouterr().err
    assert f"trainer: bad input, nothing consumed: trajectories/{bad.name}: row 0" in err
    assert "prompt_token_ids holds token id 999" in err
    assert Ledger(root).steps() == [] and WeightStore(root).list_versions() == [0]


def test_a_model_path_that_is_no_model_exits_2(
    tmp_path: Path, run_config_writer: Callable[..., Path], capsys: Any
) -> None:
    (tmp_path / "not-a-model").mkdir()
    config = run_config_writer(tmp_path / "run.yaml", model=tmp_path / "not-a-model", store=tmp_path / "store",
                               data=tmp_path / "unused.parquet", trainer={"batch_groups": 1, "max_steps": 1})
    assert main(["--config", str(config), "--work-dir", str(tmp_path / "work")]) == 2
    assert f"trainer: config error: model.path: {tmp_path / 'not-a-model'} has no config.json" in capsys.readouterr().err
