"""The published-weights path under faults and races: verified downloads (format 2 manifests
with SHA-256, format 1 still read), a ``LATEST`` pointer that only moves forward, pins and
pruning that keeps lineage files, durable local renames, and multipart-upload cleanup."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

from typing import Any, Protocol

import numpy as np
import pytest
from safetensors.numpy import save_file

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.weight_lineage import LINEAGE_FILE, read_lineage
from asyncrl.storage.weights import MANIFEST_FORMAT, WeightIntegrityError, WeightStore
from asyncrl.storage.local_files import file_sha256


class RootSpec(Protocol):
    """The ``root_spec`` fixture of tests/support/fixtures_storage.py."""

    uri: str
    options: dict[str, Any]

    def open(self) -> RunRoot: ...


def hf_dir(base: Path, version: int) -> Path:
    """A small HF-format directory whose tensor values identify ``version``."""
    directory = base / f"local-v{version}"
    (directory / "extra").mkdir(parents=True)
    save_file({"w": np.full((4, 3), float(version), dtype=np.float32)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "v": version}))
    (directory / "extra" / "notes.txt").write_text(f"version {version}")
    return directory


def test_manifest_lists_sha256_and_a_corrupt_file_is_refused_and_removed(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    local = hf_dir(tmp_path, 1)
    store.publish(1, local)
    manifest = store.manifest(1)
    assert manifest["format"] == MANIFEST_FORMAT == 2
    assert manifest["files"]["model.safetensors"] == {
        "size": (local / "model.safetensors").stat().st_size,
        "sha256": file_sha256(local / "model.safetensors"),
    }
    # Same size, other bytes: only the digest can tell.
    original = (local / "config.json").read_bytes()
    tampered = tmp_path / "tampered.json"
    tampered.write_bytes(original.replace(b'"v": 1', b'"v": 7'))
    assert tampered.stat().st_size == len(original)
    fs.upload_file(root, tampered, paths.weights_file(1, "config.json"))
    dest = tmp_path / "dl" / "v1"
    with pytest.raises(WeightIntegrityError) as info:
        store.download(1, dest)
    message = str(info.value)
    assert root.display(paths.weights_file(1, "config.json")) in message
    assert file_sha256(tampered) in message and file_sha256(local / "config.json") in message
    assert not dest.exists() and list((tmp_path / "dl").iterdir()) == []  # no staging left


def test_a_format_1_manifest_is_still_read_and_checked_by_size(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    local = hf_dir(tmp_path, 2)
    store.publish(2, local)
    old = store.manifest(2)
    old["format"] = 1
    old["files"] = {name: entry["size"] for name, entry in old["files"].items()}
    marker = paths.weights_complete_marker(2)
    fs.delete(root, marker)
    fs.put_if_absent(root, marker, json.dumps(old).encode())
    out = store.download(2, tmp_path / "dl2")
    assert (out / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    short = tmp_path / "short.json"
    short.write_text("{}")
    fs.upload_file(root, short, paths.weights_file(2, "config.json"))
    with pytest.raises(WeightIntegrityError, match=r"config.json: downloaded 2 bytes, manifest says \d+"):
        store.download(2, tmp_path / "dl3")


def test_latest_never_moves_backwards(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    store.publish(3, hf_dir(tmp_path, 3))
    assert store.advance_latest(2, 1.0) is False
    assert store.latest() == 3
    assert store.advance_latest(5, 2.0) is True and store.latest() == 5
    # An unreadable pointer is replaced, never trusted.
    fs.put_atomic_replace(root, paths.WEIGHTS_LATEST, b"garbage")
    assert store.advance_latest(4, 3.0) is True and store.latest() == 4


def test_racing_writers_leave_latest_at_the_newest_and_readers_never_see_it_go_back(root_spec: RootSpec) -> None:
    versions = list(range(1, 13))
    random.Random(7).shuffle(versions)
    stores = [WeightStore(root_spec.open()) for _ in range(4)]  # S3: one client per writer
    seen: list[int] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        reader = WeightStore(root_spec.open())
        while not done.is_set():
            latest = reader.latest()
            if latest is not None:
                seen.append(latest)

    def write(index: int) -> None:
        try:
            for version in versions[index::4]:
                stores[index].advance_latest(version, float(version))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    reader.join()
    assert errors == []
    assert stores[0].latest() == 12
    assert seen == sorted(seen)


def test_an_older_publisher_finishing_last_does_not_move_latest_back(root: RunRoot, tmp_path: Path) -> None:
    """Two trainers (a zombie and its successor): the newer publishes first, the older
    one's manifest and pointer write come later."""
    store = WeightStore(root)
    store.publish(1, hf_dir(tmp_path, 1))
    older = hf_dir(tmp_path, 2)
    # The zombie passed publish's checks before the successor published version 3.
    for relname in ("config.json", "model.safetensors"):
        fs.upload_file(root, older / relname, paths.weights_file(2, relname))
    store.publish(3, hf_dir(tmp_path, 3))
    fs.put_if_absent(root, paths.weights_complete_marker(2), json.dumps(
        {"format": 2, "version": 2, "published_at": 9.0, "files": {}}).encode())
    assert store.advance_latest(2, 9.0) is False
    assert store.latest() == 3


def test_prune_keeps_lineage_pins_and_finishes_a_killed_prune(root: RunRoot, tmp_path: Path) -> None:
    store = WeightStore(root)
    for version in range(6):
        local = hf_dir(tmp_path, version)
        (local / LINEAGE_FILE).write_text(json.dumps({"version": version, "step": version}))
        store.publish(version, local)
    store.pin(1)
    store.pin(1)  # idempotent
    assert store.pinned_versions() == {1}
    with pytest.raises(UnknownWeightVersionError):
        store.pin(9)
    # A prune killed after deleting version 2's manifest.
    fs.delete(root, paths.weights_complete_marker(2))
    assert store.prune(keep_latest=1, referenced={3}) == [0, 2, 4]
    assert store.list_versions() == [1, 3, 5]
    for version in (0, 2, 4):  # gone from weights/, the lineage kept apart
        assert fs.list_tree(root, paths.weights_version_dir(version)) == []
        assert read_lineage(root, version) == {"version": version, "step": version}
    assert store.pruned_versions() == [0, 2, 4]
    assert store.prune(keep_latest=1) == [3]  # already pruned versions are not listed again
    assert store.list_versions() == [1, 5]
    store.download(1, tmp_path / "pinned")


def test_local_renames_are_fsynced_file_before_and_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fs.open_root(str(tmp_path / "run"))
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("dir" if os.path.isdir(target) else "file", target))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    source = tmp_path / "blob.bin"
    source.write_bytes(b"x" * 1000)
    fs.upload_file(root, source, "weights/v000001/blob.bin")
    final = root.full_path("weights/v000001/blob.bin")
    kinds = [kind for kind, _ in events]
    assert kinds == ["file", "rename", "dir"]
    assert events[0][1].startswith(os.path.dirname(final) + "/.blob.bin.")
    assert events[1][1] == final and events[2][1] == os.path.dirname(final)

    events.clear()
    fs.download_file(root, "weights/v000001/blob.bin", tmp_path / "out" / "blob.bin")
    assert [kind for kind, _ in events] == ["file", "rename", "dir"]
    assert events[2][1] == str(tmp_path / "out")


def _start_upload(root: RunRoot, relpath: str) -> str:
    bucket, key, _ = root.fs.split_path(root.full_path(relpath))
    upload = root.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    root.fs.call_s3(
        "upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * (5 * 2**20)
    )
    return key


def _open_uploads(root: RunRoot) -> list[str]:
    bucket = root.fs.split_path(root.path)[0]
    return sorted(u["Key"] for u in root.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) or [])


@pytest.mark.parametrize("root_spec", ["moto"], indirect=True)
def test_incomplete_multipart_uploads_are_aborted(root_spec: RootSpec, tmp_path: Path) -> None:
    root = root_spec.open()
    assert fs.abort_incomplete_uploads(root, paths.WEIGHTS_DIR) == []
    killed = _start_upload(root, "weights/v000001/model.safetensors")
    other = _start_upload(root, "weights/v000002/model.safetensors")
    outside = fs.open_root(root_spec.uri.rsplit("/", 1)[0] + "/other-run", dict(root_spec.options))
    foreign = _start_upload(outside, "weights/v000001/model.safetensors")
    assert _open_uploads(root) == sorted([killed, other, foreign])

    # Retrying the upload of one large file aborts that key's leftovers only.
    big = tmp_path / "big.bin"
    big.write_bytes(b"b" * fs.MULTIPART_MIN_BYTES)
    fs.upload_file(root, big, "weights/v000001/model.safetensors")
    assert _open_uploads(root) == sorted([other, foreign])
    assert fs.read_bytes(root, "weights/v000001/model.safetensors") == big.read_bytes()

    # A cleanup of the run's weights aborts the rest under it, never another run's.
    assert fs.abort_incomplete_uploads(root, paths.WEIGHTS_DIR) == ["weights/v000002/model.safetensors"]
    assert _open_uploads(root) == [foreign]
