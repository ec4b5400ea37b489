"""Rollout servers start from a published weight version of the run, fetched from storage
into a local cache (:func:`fetch_weight_version`); a run's servers start from the newest
one, or from ``model.path`` before any is published (:func:`serving_weights`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.weight_sync import fetch_weight_version
from asyncrl.tasks.launch.components_setup import serving_weights
from asyncrl.tasks.system.run_paths import run_paths


def weights_file(model_dir: Path) -> bytes:
    return (model_dir / "model.safetensors").read_bytes()


def test_a_published_version_is_fetched_once_and_an_unpublished_one_refused(
    weight_variants: dict[int, Path], tmp_path: Path
) -> None:
    root_uri = f"file://{tmp_path / 'run'}"
    store = WeightStore(open_root(root_uri))
    store.publish(0, weight_variants[0])
    store.publish(1, weight_variants[1])
    cache = tmp_path / "cache"

    model_dir, cached = fetch_weight_version(root_uri, {}, 1, cache)
    assert not cached and model_dir.is_relative_to(cache)
    assert weights_file(model_dir) == weights_file(weight_variants[1])
    # a second server on the same machine reuses the fetched copy
    assert fetch_weight_version(root_uri, {}, 1, cache) == (model_dir, True)

    with pytest.raises(UnknownWeightVersionError, match=r"weight version 7 is not published; available .*\[0, 1\]"):
        fetch_weight_version(root_uri, {}, 7, cache)


def test_servers_start_from_the_newest_published_version(
    tiny_model_dir: Path, weight_variants: dict[int, Path], tmp_path: Path
) -> None:
    config = RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_path": str(tmp_path / "train.parquet")},
            "storage": {"root": f"file://{tmp_path / 'run'}"},
        }
    )
    paths = run_paths(config)
    assert serving_weights(config, paths) == (tiny_model_dir, 0)  # nothing published yet: model.path

    store = WeightStore(paths.root)
    store.publish(1, weight_variants[1])
    store.publish(2, weight_variants[2])
    model_dir, version = serving_weights(config, paths)
    assert version == 2 and model_dir.is_relative_to(paths.work_dir / "weights-cache")
    assert weights_file(model_dir) == weights_file(weight_variants[2])
    assert serving_weights(config, paths) == (model_dir, 2)  # a restarted server reuses the copy
