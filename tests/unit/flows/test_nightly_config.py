"""The nightly continuation's config: a folder of prompts asks for new files by default, so a
night with nothing new is skipped; the flow's parameter or the config may say otherwise."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.nightly import nightly_config


def config(train_path: str, require_new_files: bool = False) -> RunConfig:
    return RunConfig.model_validate({
        "name": "demo",
        "model": {"path": "/models/tiny"},
        "data": {"train_path": train_path, "require_new_files": require_new_files},
        "storage": {"root": "/store/demo"},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("train_path", "in_config", "given", "expected"),
    [
        ("s3://bucket/prompts/", False, None, True),
        ("/data/prompts", False, None, True),
        ("/data/train.parquet", False, None, False),
        ("/data/train.parquet", True, None, True),
        ("s3://bucket/prompts/", False, False, False),
        ("/data/train.parquet", False, True, True),
    ],
)
def test_a_folder_requires_new_files_unless_told_otherwise(
    train_path: str, in_config: bool, given: bool | None, expected: bool
) -> None:
    tonight = nightly_config(config(train_path, in_config), Path("/work/base"), dt.date(2026, 12, 6), given)
    assert tonight.data.require_new_files is expected
    assert tonight.name == "demo-nightly-20261206" and tonight.data.train_path == train_path
