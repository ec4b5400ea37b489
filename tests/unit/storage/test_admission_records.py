"""The scheduler's admission records in a shard's schema metadata: they round trip, a shard
without them reads as before, and records that do not match the shard's groups are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.storage.admissions import META_ADMISSIONS, Admission, read_admissions
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import open_root
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter

RUN = "run-admissions"


def group(gid: str, versions: list[int]) -> list[Sample]:
    return [Sample("p", gid, [1, 2], [3] * len(versions), [-0.5] * len(versions), versions, 1.0, "stop", 1.0, 2.0)] * 2


def test_records_round_trip_and_a_shard_without_them_has_none(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    writer, reader = ShardWriter(root, RUN), ShardReader(root, RUN)
    records = {"g00000000": Admission(0, 0), "g00000001": Admission(5, 2)}
    with_records = writer.write_groups([group("g00000000", [0, 1]), group("g00000001", [5, 5])], records)
    without = writer.write_groups([group("g00000002", [5, 6])])
    assert read_admissions(reader.read(with_records).schema.metadata, with_records.name) == records
    assert read_admissions(reader.read(without).schema.metadata, without.name) is None
    assert [len(reader.read_groups(s)) for s in (with_records, without)] == [2, 1]  # the trainer's read is unchanged


def test_records_must_name_exactly_the_shards_groups(tmp_path: Path) -> None:
    writer = ShardWriter(open_root(str(tmp_path / "store")), RUN)
    with pytest.raises(ShardValidationError, match=r"admission records of groups \['g00000009'\], the shard holds \['g00000000'\]"):
        writer.write_groups([group("g00000000", [0])], {"g00000009": Admission(0, 0)})
    with pytest.raises(ValueError, match=r"Admission.updates must be an int >= 0"):
        Admission(1, -1)


@pytest.mark.parametrize("raw", [b"[1, 2]", b'{"g0": [1]}', b'{"g0": [1, -2]}', b"not json"])
def test_a_malformed_entry_names_its_shard(raw: bytes) -> None:
    with pytest.raises(ShardValidationError, match=r"^trajectories/s: schema metadata asyncrl\.admissions"):
        read_admissions({META_ADMISSIONS: raw}, "trajectories/s")
