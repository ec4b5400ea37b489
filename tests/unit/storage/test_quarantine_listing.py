"""The quarantine listing: which shards ``quarantine/`` holds (a second copy of one shard
included) and the groups each held, read from its claim, since the file may be unreadable."""

from __future__ import annotations

from pathlib import Path

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter, list_quarantined

RUN_ID = "quarantine-test"


def group(gid: str) -> list[Sample]:
    return [Sample("p", gid, [1, 2], [3], [-0.5], [0], 1.0, "stop", 1.0, 2.0) for _ in range(2)]


def test_quarantine_names_are_parsed_with_or_without_their_unique_suffix() -> None:
    name = paths.shard_name(3, 0, 1)
    assert paths.parse_quarantine_name(name) == name
    assert paths.parse_quarantine_name(f"{name}.0a1b2c3d") == name
    assert paths.parse_quarantine_name(f"{name}.not-hex") is None
    assert paths.parse_quarantine_name("notes.txt") is None


def test_the_listing_names_each_quarantined_shard_once_with_the_groups_of_its_claim(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    writer, reader = ShardWriter(root, RUN_ID), ShardReader(root, RUN_ID)
    kept = writer.write_groups([group("g00000000")])
    bad = writer.write_groups([group("g00000001"), group("g00000002")])
    assert list_quarantined(root) == []
    fs.put_atomic_replace(root, bad.relpath, b"not arrow")  # corrupt in place: unreadable
    reader.quarantine(bad)
    fs.put_if_absent(root, bad.relpath, b"other bytes")  # the same name quarantined again
    second = reader.quarantine(bad)
    assert second.startswith(paths.quarantine_path(bad.name) + ".")
    fs.put_atomic_replace(root, paths.quarantine_path("notes.txt"), b"x")  # not a shard: ignored

    (listed,) = list_quarantined(root)
    assert (listed.name, listed.seq, listed.group_ids) == (bad.name, bad.seq, ("g00000001", "g00000002"))
    assert sorted(listed.copies) == sorted([paths.quarantine_path(bad.name), second])
    assert reader.locate(kept.name) is not None
