"""The one weight fetch of every process: a published version comes from the store through a
verified local cache that stays bounded and never loses a version being loaded; the run's base
weights are ``model.path``, used in place when local and copied once when remote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest
from safetensors.numpy import save_file

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weights import WeightIntegrityError, WeightStore
from asyncrl.tasks.model.checks import ModelPathError
from asyncrl.tasks.model.weight_fetch import (
    cached_version_dir,
    fetch_weight_version,
    model_weights,
    prune_weight_cache,
    version_lease,
)


def model_dir(local: Path, version: int) -> Path:
    local.mkdir(parents=True)
    save_file({"w": np.full(64, float(version), dtype=np.float32)}, str(local / "model.safetensors"))
    (local / "config.json").write_text(json.dumps({"v": version}))
    return local


def publish(store: WeightStore, base: Path, version: int) -> None:
    store.publish(version, model_dir(base / f"v{version}", version))


def cached(cache: Path, root_uri: str) -> list[str]:
    base = cached_version_dir(cache, root_uri, 0).parent
    return sorted(entry.name for entry in base.iterdir() if not entry.name.endswith(".lock"))


def config_of(directory: Path) -> dict[str, int]:
    return json.loads((directory / "config.json").read_text())


@pytest.fixture
def root(tmp_path: Path) -> RunRoot:
    return open_root(f"file://{tmp_path / 'run'}")


@pytest.fixture
def remote_model(tmp_path: Path) -> Iterator[str]:
    """A model directory in fsspec's in-memory filesystem: a remote ``model.path``."""
    memory = fsspec.filesystem("memory")
    base = f"/models/{tmp_path.name}"
    memory.pipe({f"{base}/config.json": b'{"v": 0}', f"{base}/model.safetensors": b"weights"})
    yield f"memory://{base}"
    memory.rm(base, recursive=True)


def test_a_published_version_is_fetched_once_and_an_unpublished_one_refused(
    weight_variants: dict[int, Path], tmp_path: Path
) -> None:
    root_uri = f"file://{tmp_path / 'run'}"
    store = WeightStore(open_root(root_uri))
    store.publish(0, weight_variants[0])
    store.publish(1, weight_variants[1])
    cache = tmp_path / "cache"

    fetched, was_cached = fetch_weight_version(root_uri, {}, 1, cache)
    assert not was_cached and fetched.is_relative_to(cache)
    assert (fetched / "model.safetensors").read_bytes() == (weight_variants[1] / "model.safetensors").read_bytes()
    # a second server on the same machine reuses the fetched copy
    assert fetch_weight_version(root_uri, {}, 1, cache) == (fetched, True)

    with pytest.raises(UnknownWeightVersionError, match=r"weight version 7 is not published; available .*\[0, 1\]"):
        fetch_weight_version(root_uri, {}, 7, cache)


def test_the_cache_keeps_the_loaded_version_and_those_being_loaded(tmp_path: Path) -> None:
    root_uri = f"file://{tmp_path / 'run'}"
    store = WeightStore(open_root(root_uri))
    cache = tmp_path / "cache"
    for version in range(6):
        publish(store, tmp_path / "local", version)
    sizes = []
    for version in range(4):  # a server loading each new version in turn
        fetch_weight_version(root_uri, {}, version, cache)
        prune_weight_cache(cache, root_uri, version)
        sizes.append(sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()))
        assert cached(cache, root_uri) == [paths.weights_version_dirname(version)]
    assert len(set(sizes)) == 1  # bounded: one version's bytes

    # Another server on the machine still loads version 3 (holds its lease) while this one
    # loads 5: 3 stays; a leftover staging directory of 4 (a killed download) goes.
    leftover = cached_version_dir(cache, root_uri, 4).parent / ".v000004.abc123"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    with version_lease(cache, root_uri, 3):
        fetch_weight_version(root_uri, {}, 5, cache)
        assert prune_weight_cache(cache, root_uri, 5) == [4]
        assert cached(cache, root_uri) == ["v000003", "v000005"]
    assert prune_weight_cache(cache, root_uri, 5) == [3]
    assert cached(cache, root_uri) == ["v000005"]
    # A version pruned from the cache is fetched again when asked for.
    fetched, was_cached = fetch_weight_version(root_uri, {}, 3, cache)
    assert not was_cached and config_of(fetched) == {"v": 3}


def test_a_corrupt_version_is_not_cached(tmp_path: Path) -> None:
    root_uri = f"file://{tmp_path / 'run'}"
    root = open_root(root_uri)
    store = WeightStore(root)
    publish(store, tmp_path / "local", 1)
    path = Path(root.full_path(paths.weights_file(1, "model.safetensors")))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(WeightIntegrityError, match="model.safetensors: downloaded SHA-256"):
        fetch_weight_version(root_uri, {}, 1, cache)
    assert cached(cache, root_uri) == []
    assert fs.exists(root, paths.weights_complete_marker(1))


def test_a_published_version_comes_from_the_store_through_the_cache(
    root: RunRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = WeightStore(root)
    base = model_dir(tmp_path / "base", 0)
    publish(store, tmp_path / "local", 1)
    cache = tmp_path / "cache"
    fetched = model_weights(root, str(base), 1, cache)
    assert fetched == cached_version_dir(cache, root.uri, 1) and config_of(fetched) == {"v": 1}

    def no_download(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a cached version is not downloaded again")

    monkeypatch.setattr(WeightStore, "download", no_download)
    assert model_weights(root, str(base), 1, cache) == fetched


def test_version_0_is_model_path_in_place_until_the_store_holds_it(root: RunRoot, tmp_path: Path) -> None:
    base = model_dir(tmp_path / "base", 0)
    cache = tmp_path / "cache"
    assert model_weights(root, str(base), None, cache) == base  # nothing published yet
    assert model_weights(root, str(base), 0, cache) == base
    assert model_weights(root, f"file://{base}", 0, cache) == base
    assert not cache.exists()  # used in place, nothing copied
    # Once the store holds version 0 (the trainer's initial publish, an SFT warm start), it wins.
    publish(WeightStore(root), tmp_path / "local", 0)
    assert model_weights(root, str(base), 0, cache) == cached_version_dir(cache, root.uri, 0)


def test_a_local_model_path_that_is_no_model_directory_is_named(root: RunRoot, tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(ModelPathError, match=rf"model\.path: {empty} has no config\.json"):
        model_weights(root, str(empty), 0, tmp_path / "cache")
    with pytest.raises(ModelPathError, match=rf"model\.path: {tmp_path / 'missing'} does not exist"):
        model_weights(root, str(tmp_path / "missing"), None, tmp_path / "cache")


def test_a_remote_model_path_is_copied_into_the_cache_once(
    root: RunRoot, remote_model: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    target = model_weights(root, remote_model, 0, cache, fetch=False)
    assert not target.exists()  # fetch=False copies nothing
    # A killed copy left a staging directory: it is never taken for the model, and is removed.
    target.parent.mkdir(parents=True)
    (target.parent / f".{target.name}.killed").mkdir()
    copied = model_weights(root, remote_model, None, cache)
    assert copied == target and copied.is_relative_to(cache)
    assert (copied / "model.safetensors").read_bytes() == b"weights" and config_of(copied) == {"v": 0}
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock", target.name]
    fsspec.filesystem("memory").pipe(f"{remote_model.removeprefix('memory://')}/model.safetensors", b"changed")
    assert (model_weights(root, remote_model, 0, cache) / "model.safetensors").read_bytes() == b"weights"  # once


def test_a_remote_model_path_without_config_json_leaves_nothing(root: RunRoot, remote_model: str, tmp_path: Path) -> None:
    fsspec.filesystem("memory").rm(f"{remote_model.removeprefix('memory://')}/config.json")
    cache = tmp_path / "cache"
    with pytest.raises(ModelPathError, match=rf"model\.path: {remote_model} has no config\.json"):
        model_weights(root, remote_model, None, cache)
    target = model_weights(root, remote_model, None, cache, fetch=False)
    assert [p.name for p in target.parent.iterdir()] == [f".{target.name}.lock"]


def test_fetch_false_downloads_nothing(root: RunRoot, tmp_path: Path) -> None:
    publish(WeightStore(root), tmp_path / "local", 2)
    cache = tmp_path / "cache"
    where = model_weights(root, str(tmp_path / "unused"), 2, cache, fetch=False)
    assert where == cached_version_dir(cache, root.uri, 2) and not cache.exists()
    assert model_weights(root, str(tmp_path / "unused"), 2, cache) == where  # the leader's fetch
    assert config_of(where) == {"v": 2}


def test_an_unpublished_version_is_refused(root: RunRoot, tmp_path: Path) -> None:
    publish(WeightStore(root), tmp_path / "local", 1)
    base = model_dir(tmp_path / "base", 0)
    with pytest.raises(UnknownWeightVersionError, match=r"weight version 3 is not published; available .*\[1\]"):
        model_weights(root, str(base), 3, tmp_path / "cache")
