"""The pipeline stages' cache keys: the same config and the same bytes give the same key
wherever and whenever they are read; a changed setting or a changed input file gives another;
a stage whose outputs are gone is seen as absent; a run root trained from another warm
start is refused before anything runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.pipeline import stages
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.tasks.pipeline.stage_cache import content_digest, stage_key


def config(tmp_path: Path, **pipeline: Any) -> RunConfig:
    return RunConfig.model_validate({
        "name": "cache",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "data" / "train.parquet"),
                 "eval_path": str(tmp_path / "data" / "heldout.parquet")},
        "pipeline": {"synthetic_data": {"n_train": 16, "n_heldout": 4}, "sft_steps": 3, **pipeline},
        "storage": {"root": str(tmp_path / "store")},
    })  # fmt: skip


def test_content_digest_reads_bytes_not_names_or_times(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"same bytes")
    b.write_bytes(b"same bytes")
    os.utime(b, (0, 0))
    assert content_digest(a) == content_digest(b)
    b.write_bytes(b"other bytes")
    assert content_digest(a) != content_digest(b)
    assert content_digest(tmp_path / "missing") == "absent" and content_digest(None) == "absent"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    before = content_digest(model)
    (model / "weights.bin").write_bytes(b"\0")
    assert content_digest(model) != before  # a directory is all its files


def test_stage_key_follows_settings_inputs_and_code(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    key = stage_key("sft", {"steps": 3}, [data])
    assert key == stage_key("sft", {"steps": 3}, [data]) and key.startswith("sft-")
    assert key != stage_key("sft", {"steps": 4}, [data])
    assert key != stage_key("prepare-data", {"steps": 3}, [data])
    assert key != stage_key("sft", {"steps": 3}, [data], with_code=False)
    data.write_text('{"prompt": "1+2", "answer": "3"}\n')
    assert key != stage_key("sft", {"steps": 3}, [data])


def test_prepare_data_is_keyed_by_its_generator_and_present_only_with_its_files(tmp_path: Path) -> None:
    run = config(tmp_path)
    assert not stages.data_present(run)
    digests = stages.prepare_data(run)
    assert stages.data_present(run) and set(digests) == set(stages.data_files(run))
    assert stages.data_key(run) == stages.data_key(config(tmp_path))
    assert stages.data_key(run) != stages.data_key(run.model_copy(update={"seed": 1}))
    Path(run.data.eval_path or "").unlink()  # an output gone: the stage must run again
    assert not stages.data_present(run)


def test_sft_key_follows_its_settings_and_its_examples(tmp_path: Path) -> None:
    run = config(tmp_path)
    stages.prepare_data(run)
    key = stages.sft_key(run)
    assert key == stages.sft_key(config(tmp_path))
    assert key != stages.sft_key(config(tmp_path, sft_steps=4))
    assert key != stages.sft_key(config(tmp_path, sft_batch_size=8))
    Path(run.data.train_path).write_bytes(Path(run.data.train_path).read_bytes() + b"\n")
    assert key != stages.sft_key(run)  # the examples are read by content


def test_a_run_root_trained_from_another_warm_start_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = config(tmp_path)
    stages.prepare_data(run)
    run_paths = prepare_run(run)
    WeightStore(run_paths.root).publish(0, tiny_model_dir)
    fs.put_atomic_replace(run_paths.root, stages.SFT_RECORD, json.dumps({"identity": "sft-other", "version": 0}).encode())

    assert not stages.sft_present(run, run_paths)
    with pytest.raises(ValueError, match="from another warm start; this config's SFT stage"):
        stages.run_sft(run, run_paths)
    identity = stages.sft_key(run, with_code=False)
    fs.put_atomic_replace(run_paths.root, stages.SFT_RECORD, json.dumps({"identity": identity, "version": 0}).encode())
    assert stages.sft_present(run, run_paths) and stages.run_sft(run, run_paths) == 0  # its own warm start: reused
