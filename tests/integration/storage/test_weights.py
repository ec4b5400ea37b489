from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weights import WeightStore


def hf_dir(base: Path, version: int) -> Path:
    """A small HF-format directory whose tensor values identify ``version``."""
    directory = base / f"local-v{version}"
    (directory / "extra").mkdir(parents=True)
    save_file({"w": np.full((4, 3), float(version), dtype=np.float32)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "v": version}))
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "extra" / "notes.txt").write_text(f"version {version}")
    (directory / ".cache").mkdir()
    (directory / ".cache" / "lock").write_text("ignored")
    return directory


def test_publish_list_latest_download(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    assert store.latest() is None and store.list_versions() == []
    store.publish(1, hf_dir(tmp_path, 1))
    store.publish(3, hf_dir(tmp_path, 3))
    assert store.latest() == 3
    assert store.list_versions() == [1, 3]
    pointer = json.loads(fs.read_bytes(root, paths.WEIGHTS_LATEST))
    assert pointer["version"] == 3 and pointer["published_at"] > 0

    out = store.download(1, tmp_path / "dl" / "v1")
    assert out == tmp_path / "dl" / "v1"
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == ["config.json", "extra/notes.txt", "model.safetensors", "tokenizer.json"]
    assert np.array_equal(load_file(str(out / "model.safetensors"))["w"], np.full((4, 3), 1.0, dtype=np.float32))
    assert json.loads((out / "config.json").read_text())["v"] == 1
    assert [p.name for p in out.parent.iterdir()] == ["v1"]  # no staging directory left

    with pytest.raises(FileExistsError, match="v1"):
        store.download(3, out)


def test_non_monotone_or_repeated_publish_is_refused(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    store.publish(2, hf_dir(tmp_path, 2))
    with pytest.raises(ValueError, match="version 2 is not newer than the latest published version 2"):
        store.publish(2, hf_dir(tmp_path / "again", 2))
    with pytest.raises(ValueError, match="version 1 is not newer"):
        store.publish(1, hf_dir(tmp_path, 1))
    assert store.latest() == 2 and store.list_versions() == [2]
    assert fs.list_dir(root, paths.WEIGHTS_DIR) == ["LATEST", "v000002"]


def test_a_publisher_killed_before_moving_the_pointer_continues_after_its_version(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    assert store.newest_complete() is None
    store.publish(0, hf_dir(tmp_path, 0))
    store.publish(1, hf_dir(tmp_path, 1))
    # The kill landed after v1's manifest and before LATEST moved to it.
    fs.put_atomic_replace(root, paths.WEIGHTS_LATEST, json.dumps({"version": 0, "published_at": 1.0}).encode())
    assert (store.latest(), store.newest_complete()) == (0, 1)
    with pytest.raises(ValueError, match="weight version 1 is already published"):
        store.publish(1, hf_dir(tmp_path / "again", 1))
    store.publish(store.newest_complete() + 1, hf_dir(tmp_path, 2))
    assert (store.latest(), store.list_versions()) == (2, [0, 1, 2])


def test_unknown_version_names_available_ones(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    store.publish(0, hf_dir(tmp_path, 0))
    store.publish(4, hf_dir(tmp_path, 4))
    with pytest.raises(KeyError) as info:
        store.download(7, tmp_path / "dl")
    assert isinstance(info.value, UnknownWeightVersionError)
    assert str(info.value) == "weight version 7 is not published; available complete versions: [0, 4]"
    assert not (tmp_path / "dl").exists()


def test_incomplete_version_is_invisible_and_replaced(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    store.publish(1, hf_dir(tmp_path, 1))
    # An interrupted publish of version 2: a file but no manifest.
    stale = tmp_path / "stale.bin"
    stale.write_bytes(b"stale")
    fs.upload_file(root, stale, paths.weights_file(2, "stale.bin"))
    assert store.list_versions() == [1] and store.latest() == 1
    with pytest.raises(UnknownWeightVersionError):
        store.download(2, tmp_path / "dl")
    store.publish(2, hf_dir(tmp_path, 2))
    assert store.list_versions() == [1, 2]
    assert fs.list_dir(root, paths.weights_version_dir(2)) == [
        "_COMPLETE", "config.json", "extra", "model.safetensors", "tokenizer.json",
    ]


def test_prune_keeps_newest_referenced_and_pointer(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    for version in range(1, 6):
        store.publish(version, hf_dir(tmp_path, version))
    assert store.prune(keep_latest=2, referenced={1}) == [2, 3]
    assert store.list_versions() == [1, 4, 5]
    assert store.prune(keep_latest=0, referenced=set()) == [1, 4]
    assert store.list_versions() == [5] and store.latest() == 5
    assert fs.list_dir(root, paths.WEIGHTS_DIR) == ["LATEST", "v000005"]
    assert store.prune(keep_latest=0) == []
    store.download(5, tmp_path / "dl5")


def test_every_version_keeps_its_digests_after_a_prune(root: RunRoot, tmp_path: Path) -> None:
    """The weight files' SHA-256 of a pruned version stay readable (a replay compares every
    version): from the manifest while published, from the copy a prune keeps after."""
    from asyncrl.storage.local_files import file_sha256

    store = WeightStore(root)
    for version in range(1, 4):
        store.publish(version, hf_dir(tmp_path, version))
    before = {v: store.weight_digests(v) for v in (1, 2, 3)}
    assert before[1]["model.safetensors"] == file_sha256(tmp_path / "local-v1" / "model.safetensors")
    assert set(before[1]) == {"model.safetensors", "config.json", "tokenizer.json", "extra/notes.txt"}
    assert before[1] != before[2]
    assert store.prune(keep_latest=1) == [1, 2]
    assert {v: store.weight_digests(v) for v in (1, 2, 3)} == before
    assert fs.list_dir(root, paths.PRUNED_MANIFEST_DIR) == ["v000001.json", "v000002.json"]
    with pytest.raises(UnknownWeightVersionError, match="weight version 7 is not published"):
        store.weight_digests(7)


def test_bad_local_directory_is_refused(tmp_path: Path) -> None:
    store = WeightStore(open_root(str(tmp_path / "run")))
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(no_config / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks \['config.json'\]"):
        store.publish(0, no_config)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        store.publish(0, no_weights)
    with pytest.raises(ValueError, match="does not exist"):
        store.publish(0, tmp_path / "missing")
    with pytest.raises(ValueError, match="non-negative int"):
        store.publish(-1, no_weights)
    assert store.latest() is None


def test_a_linked_download_shares_the_local_stores_files_and_copies_from_s3(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    store.publish(1, hf_dir(tmp_path, 1))
    store.publish(2, hf_dir(tmp_path, 2))
    out = store.download(1, tmp_path / "cache" / "v1", link=True)
    assert np.array_equal(load_file(str(out / "model.safetensors"))["w"], np.full((4, 3), 1.0, dtype=np.float32))
    linked = (out / "model.safetensors").stat().st_nlink > 1
    assert linked == root.is_local  # local: the store's own inode, no bytes copied; S3: a download
    assert [p.name for p in out.parent.iterdir()] == ["v1"]
    assert store.prune(keep_latest=1) == [1]  # the store drops its names; the cache's links keep the bytes
    assert np.array_equal(load_file(str(out / "model.safetensors"))["w"], np.full((4, 3), 1.0, dtype=np.float32))
