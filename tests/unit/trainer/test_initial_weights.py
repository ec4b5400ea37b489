"""The weights the trainer starts from: the store's latest version (fetched into the node's
weight cache, older versions pruned), else ``model.path`` in place; a non-leader rank learns
where the leader puts them without downloading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.model.weight_fetch import cached_version_dir
from asyncrl.tasks.trainer.main import initial_model_dir


def model_dir(local: Path, version: int) -> Path:
    local.mkdir(parents=True)
    save_file({"w": np.full(8, float(version), dtype=np.float32)}, str(local / "model.safetensors"))
    (local / "config.json").write_text(json.dumps({"v": version}))
    return local


def test_the_trainer_starts_from_the_latest_version_else_model_path(tmp_path: Path) -> None:
    root = open_root(f"file://{tmp_path / 'run'}")
    base = model_dir(tmp_path / "base", 0)
    work = tmp_path / "work"
    assert initial_model_dir(root, str(base), work) == (base, None)

    store = WeightStore(root)
    for version in (0, 1):
        store.publish(version, model_dir(tmp_path / f"v{version}", version))
    cache = work / "weights-cache"
    assert initial_model_dir(root, str(base), work, fetch=False) == (cached_version_dir(cache, root.uri, 1), 1)
    assert not cache.exists()  # a non-leader rank downloads nothing
    first, _ = initial_model_dir(root, str(base), work)
    assert json.loads((first / "config.json").read_text()) == {"v": 1}

    store.publish(2, model_dir(tmp_path / "v2", 2))
    restarted, version = initial_model_dir(root, str(base), work)
    assert version == 2 and restarted == cached_version_dir(cache, root.uri, 2)
    assert not first.exists()  # the version of the previous start is pruned


def test_the_kl_reference_is_the_run_s_first_version_else_model_path(tmp_path: Path) -> None:
    root = open_root(f"file://{tmp_path / 'run'}")
    base = model_dir(tmp_path / "base", 0)
    work = tmp_path / "work"
    assert initial_model_dir(root, str(base), work, first=True) == (base, None)  # nothing published yet
    store = WeightStore(root)
    for version in (0, 1, 2):
        store.publish(version, model_dir(tmp_path / f"v{version}", 10 + version))
    latest, _ = initial_model_dir(root, str(base), work)
    reference, version = initial_model_dir(root, str(base), work, first=True)
    assert version == 0 and json.loads((reference / "config.json").read_text()) == {"v": 10}
    assert latest.exists()  # fetching the reference prunes nothing of the engine's weights
