"""A rollout server can start from a published weight version of the run (fetched from storage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.rollout.prefect_tasks import config_for_version
from asyncrl.tasks.rollout.server import RolloutServerConfig


def test_server_config_for_a_published_version(weight_variants: dict[int, Path], tmp_path: Path) -> None:
    root_uri = f"file://{tmp_path / 'run'}"
    store = WeightStore(open_root(root_uri))
    store.publish(0, weight_variants[0])
    store.publish(1, weight_variants[1])
    base = RolloutServerConfig(model_dir=weight_variants[0], kv_cache_gib=1.0)

    config = config_for_version(base, root_uri, {}, 1, tmp_path / "cache")
    assert config.model_dir != base.model_dir and config.kv_cache_gib == base.kv_cache_gib
    served = (config.model_dir / "model.safetensors").read_bytes()
    assert served == (weight_variants[1] / "model.safetensors").read_bytes()
    # a second server on the same machine reuses the fetched copy
    assert config_for_version(base, root_uri, {}, 1, tmp_path / "cache").model_dir == config.model_dir

    with pytest.raises(UnknownWeightVersionError, match=r"weight version 7 is not published; available .*\[0, 1\]"):
        config_for_version(base, root_uri, {}, 7, tmp_path / "cache")
