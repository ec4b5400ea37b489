from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root


def test_put_if_absent_never_overwrites(root: RunRoot) -> None:
    fs.put_if_absent(root, "a/b/obj.bin", b"first")
    with pytest.raises(FileExistsError, match="a/b/obj.bin"):
        fs.put_if_absent(root, "a/b/obj.bin", b"second")
    assert fs.read_bytes(root, "a/b/obj.bin") == b"first"
    assert fs.list_dir(root, "a/b") == ["obj.bin"]


def test_put_if_absent_is_idempotent_by_content(root: RunRoot) -> None:
    fs.put_if_absent(root, "c/obj", b"same bytes")
    fs.put_if_absent(root, "c/obj", b"same bytes")  # a repeated publish of equal bytes is done, not a conflict
    with pytest.raises(FileExistsError, match="c/obj"):
        fs.put_if_absent(root, "c/obj", b"same bytes, longer")
    assert fs.read_bytes(root, "c/obj") == b"same bytes"


def test_concurrent_put_if_absent_has_one_winner(root_spec) -> None:
    roots = [root_spec.open() for _ in range(6)]
    outcomes: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(roots))

    def attempt(index: int) -> None:
        barrier.wait()
        try:
            fs.put_if_absent(roots[index], "race/key", f"writer-{index}".encode())
            result = f"won-{index}"
        except FileExistsError:
            result = "lost"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(roots))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and outcomes.count("lost") == len(roots) - 1
    assert fs.read_bytes(roots[0], "race/key") == f"writer-{winners[0].split('-')[1]}".encode()


def test_put_atomic_replace_replaces(root: RunRoot) -> None:
    fs.put_atomic_replace(root, "p/ptr", b"1")
    fs.put_atomic_replace(root, "p/ptr", b"22")
    assert fs.read_bytes(root, "p/ptr") == b"22"
    assert fs.list_dir(root, "p") == ["ptr"]


def test_list_dir_names_files_and_dirs_but_no_hidden(root: RunRoot) -> None:
    assert fs.list_dir(root, "nothing/here") == []
    fs.put_if_absent(root, "d/x", b"x")
    fs.put_if_absent(root, "d/sub/y", b"y")
    fs.put_if_absent(root, "d/.tmp-partial", b"z")
    assert fs.list_dir(root, "d") == ["sub", "x"]


def test_listing_sees_other_writers(root_spec) -> None:
    reader, writer = root_spec.open(), root_spec.open()
    assert fs.list_dir(reader, "shared") == []
    fs.put_if_absent(writer, "shared/one", b"1")
    assert fs.list_dir(reader, "shared") == ["one"]
    assert fs.exists(reader, "shared/one")
    fs.put_if_absent(writer, "shared/two", b"2")
    assert fs.list_dir(reader, "shared") == ["one", "two"]
    assert fs.exists(reader, "shared/two")


def test_read_and_delete_missing_objects_name_them(root: RunRoot) -> None:
    with pytest.raises(FileNotFoundError, match="missing/obj"):
        fs.read_bytes(root, "missing/obj")
    with pytest.raises(FileNotFoundError, match="missing/obj"):
        fs.delete(root, "missing/obj")
    fs.delete(root, "missing/obj", missing_ok=True)
    fs.put_if_absent(root, "present", b"p")
    fs.delete(root, "present")
    assert not fs.exists(root, "present")


def test_read_many_and_delete_tree(root: RunRoot) -> None:
    for name in ("t/a", "t/b", "t/c/d"):
        fs.put_if_absent(root, name, name.encode())
    assert fs.read_many(root, ["t/a", "t/c/d"]) == {"t/a": b"t/a", "t/c/d": b"t/c/d"}
    fs.delete_tree(root, "t")
    assert fs.list_dir(root, "t") == []
    fs.delete_tree(root, "t")  # already gone: no error


def test_move_no_overwrite(root: RunRoot) -> None:
    fs.put_if_absent(root, "src", b"s")
    fs.put_if_absent(root, "taken", b"t")
    with pytest.raises(FileExistsError, match="taken"):
        fs.move_no_overwrite(root, "src", "taken")
    assert fs.read_bytes(root, "src") == b"s"
    fs.move_no_overwrite(root, "src", "moved/here")
    assert fs.read_bytes(root, "moved/here") == b"s"
    assert not fs.exists(root, "src")


def test_upload_and_download_file(root: RunRoot, tmp_path: Path) -> None:
    local = tmp_path / "blob.bin"
    local.write_bytes(os.urandom(100_000))
    fs.upload_file(root, local, "files/blob.bin")
    out = tmp_path / "out" / "blob.bin"
    fs.download_file(root, "files/blob.bin", out)
    assert out.read_bytes() == local.read_bytes()
    with pytest.raises(FileNotFoundError, match="files/none"):
        fs.download_file(root, "files/none", tmp_path / "none")


@pytest.mark.parametrize("bad", ["../escape", "/abs", "a//b", "a/./b", ""])
def test_relative_paths_are_checked(bad: str, tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    with pytest.raises(ValueError):
        fs.put_if_absent(root, bad, b"x")
    assert os.listdir(tmp_path) == []


def test_open_root_forms(tmp_path: Path) -> None:
    plain = open_root(str(tmp_path / "r"))
    uri = open_root(f"file://{tmp_path}/r")
    assert plain.is_local and uri.is_local
    assert plain.path == uri.path == str(tmp_path / "r")
    fs.put_if_absent(plain, paths.CONFIG, b"c: 1\n")
    assert fs.read_bytes(uri, paths.CONFIG) == b"c: 1\n"
    with pytest.raises(ValueError, match="memory"):
        open_root("memory://somewhere")
    with pytest.raises(ValueError, match="empty"):
        open_root("")


def test_local_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    fs.put_if_absent(root, "d/a", b"a")
    with pytest.raises(FileExistsError):
        fs.put_if_absent(root, "d/a", b"b")
    fs.put_atomic_replace(root, "d/p", b"1")
    fs.put_atomic_replace(root, "d/p", b"2")
    assert sorted(os.listdir(tmp_path / "d")) == ["a", "p"]
