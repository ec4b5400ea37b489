"""The written-groups index: a scheduler cycle learns which groups are in shards without
listing or reading shards, and a kill at any point of a shard write loses nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.tasks.scheduler.written_index import (
    WrittenGroups,
    load_written_groups,
    save_written_groups,
    written_group_indices,
)
from asyncrl.tasks.scheduler.group_schedule import group_id

RUN_ID = "run-test"


def group(index: int) -> list[Sample]:
    return [
        Sample(prompt_id=f"p{index}", group_id=group_id(index), prompt_token_ids=[1, 2], output_token_ids=[3],
               behaviour_logprobs=[-0.5], token_versions=[0], reward=1.0, finish_reason="stop",
               submit_time=1.0, finish_time=2.0)
        for _ in range(2)
    ]  # fmt: skip


def write(root: RunRoot, writer: ShardWriter, written: WrittenGroups | None, *indices: int) -> str:
    """A shard of ``indices``, then (unless ``written`` is None: killed before it) the index save."""
    shard = writer.write_groups([group(k) for k in indices])
    if written is not None:
        written.add(indices)
        written.next_seq = max(written.next_seq, shard.seq + 1)
        save_written_groups(root, written)
    return shard.name


@pytest.fixture
def no_shard_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail any shard read; record the directories listed."""
    listed: list[str] = []
    real_list = fs.list_dir

    def list_dir(root: RunRoot, reldir: str) -> list[str]:
        listed.append(reldir)
        return real_list(root, reldir)

    def read(*args: object, **kwargs: object) -> object:
        raise AssertionError("a shard was read")

    monkeypatch.setattr(fs, "list_dir", list_dir)
    monkeypatch.setattr(ShardReader, "read", read)
    return listed


def test_the_index_is_a_prefix_plus_the_groups_past_the_first_gap() -> None:
    written = WrittenGroups()
    written.add([0, 1, 3, 5])
    assert (written.prefix, written.extra) == (2, {3, 5})
    written.add([2])
    assert (written.prefix, written.extra) == (4, {5})
    assert 3 in written and 4 not in written and 5 in written
    assert written.count_below(6) == 5 and written.count_below(3) == 3
    assert written.missing_below(8) == [4, 6, 7]
    again = WrittenGroups.from_json(written.to_json().encode(), "x")
    assert (again.prefix, again.extra, again.next_seq) == (4, {5}, 0)
    with pytest.raises(ValueError, match="x: corrupt written-groups index"):
        WrittenGroups.from_json(b'{"prefix": 1}', "x")


def test_restart_recovers_from_the_index_and_the_claims_after_it(tmp_path: Path, no_shard_reads: list[str]) -> None:
    root = open_root(str(tmp_path / "run"))
    writer = ShardWriter(root, RUN_ID)
    written = WrittenGroups()
    write(root, writer, written, 0, 1)
    write(root, writer, written, 3)
    consumed = write(root, writer, None, 2)  # killed after the shard, before the index save
    ShardReader(root, RUN_ID).retire([consumed])  # ... and the trainer has consumed it since
    # Killed after a claim, before its shard: those groups were never written.
    fs.put_if_absent(root, paths.shard_seq_claim(3), json.dumps(
        {"shard": paths.shard_name(3, 0, 0), "groups": [group_id(4)]}).encode())  # fmt: skip
    quarantined = write(root, ShardWriter(root, RUN_ID), None, 5)
    ShardReader(root, RUN_ID).quarantine(quarantined)

    assert json.loads(fs.read_bytes(root, paths.SCHEDULER_WRITTEN))["next_seq"] == 2
    looked = written_group_indices(root, RUN_ID)  # a look that saves nothing
    assert (looked.prefix, looked.extra, looked.next_seq) == (4, {5}, 5)
    assert json.loads(fs.read_bytes(root, paths.SCHEDULER_WRITTEN))["next_seq"] == 2
    recovered = load_written_groups(root, RUN_ID)
    assert (recovered.prefix, recovered.extra, recovered.next_seq) == (4, {5}, 5)
    assert recovered.missing_below(6) == [4]
    assert no_shard_reads == [paths.QUARANTINE_DIR] * 2  # per load; neither trajectories/ nor consumed/ is listed
    no_shard_reads.clear()
    assert load_written_groups(root, RUN_ID).next_seq == 5 and no_shard_reads == []  # saved: nothing to catch up


def test_a_root_from_before_the_index_is_scanned_once(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    writer = ShardWriter(root, RUN_ID)
    for indices in ((0, 1), (2,), (4,)):
        write(root, writer, None, *indices)
    for seq in range(3):  # claims as older writers wrote them: no shard name, no groups
        fs.delete(root, paths.shard_seq_claim(seq))
        fs.put_if_absent(root, paths.shard_seq_claim(seq), b'{"run_id": "run-test"}')
    fs.put_if_absent(root, paths.shard_seq_claim(3), b'{"run_id": "run-test"}')  # one whose shard never came
    written = load_written_groups(root, RUN_ID)
    assert (written.prefix, written.extra, written.next_seq) == (3, {4}, 4)
    reads: list[object] = []
    real_read = ShardReader.read
    setattr_read = pytest.MonkeyPatch()
    setattr_read.setattr(ShardReader, "read", lambda self, shard: (reads.append(shard), real_read(self, shard))[1])
    try:
        assert load_written_groups(root, RUN_ID).missing_below(5) == [3]
    finally:
        setattr_read.undo()
    assert reads == []


def test_the_index_counts_filtered_groups_and_reads_an_index_saved_before_it_did(tmp_path: Path) -> None:
    from asyncrl.tasks.scheduler.filtered import count_filtered, filtered_record_path

    written = WrittenGroups(next_seq=1, prefix=2, extra=set(), filtered=1)
    again = WrittenGroups.from_json(written.to_json().encode(), "x")
    assert (again.prefix, again.filtered, again.in_shards) == (2, 1, 1)
    old = WrittenGroups.from_json(b'{"format": 1, "next_seq": 3, "prefix": 4, "extra": [6]}', "old")
    assert (old.filtered, old.in_shards) == (0, 5)
    with pytest.raises(ValueError, match="x: inconsistent written-groups index"):
        WrittenGroups.from_json(b'{"next_seq": 0, "prefix": 1, "extra": [], "filtered": 2}', "x")

    root = open_root(str(tmp_path / "run"))
    for index in (2, 5):  # filtered after the index was last saved
        fs.put_atomic_replace(root, filtered_record_path(index), b"{}")
    assert count_filtered(root, written, admitted=5) == 1  # 5 was never admitted: not counted
    assert (written.prefix, written.filtered, written.missing_below(5)) == (3, 2, [3, 4])


# ----- quarantined shards: their groups un-written once -----


def test_a_quarantined_shard_s_groups_are_unwritten_once_and_its_regeneration_s_again(tmp_path: Path) -> None:
    from asyncrl.storage.ledger import Ledger
    from asyncrl.tasks.scheduler.written_index import learn_quarantines

    root = open_root(str(tmp_path / "run"))
    writer, reader = ShardWriter(root, RUN_ID), ShardReader(root, RUN_ID)
    written = WrittenGroups()
    first = write(root, writer, written, 0, 1)
    trained = write(root, writer, written, 2, 3)
    Ledger(root).record(1, [trained])
    reader.retire([trained])
    assert learn_quarantines(root, written) == []  # nothing quarantined: one listing, no claim read
    reader.quarantine(first)
    reader.quarantine(reader.locate(trained) or trained)  # consumed (the ledger names it), then quarantined

    assert learn_quarantines(root, written) == [0, 1]
    assert written.regenerate == {0: 0, 1: 0} and written.quarantined == {0, 1}
    assert 0 not in written and 2 in written and written.missing_below(4) == []  # not new groups
    assert (written.total, written.in_shards, written.quarantined_groups, written.count_below(4)) == (2, 2, 2, 2)
    assert learn_quarantines(root, written) == []  # once: the shards are counted as seen
    save_written_groups(root, written)
    again = load_written_groups(root, RUN_ID)  # ... and so after a restart
    assert (again.regenerate, again.quarantined, again.regenerated) == ({0: 0, 1: 0}, {0, 1}, 0)
    assert learn_quarantines(root, again) == []

    # The regeneration is another shard: written, the groups count again; quarantined, again.
    regenerated = write(root, writer, again, 0, 1)
    assert (again.regenerate, again.regenerated, again.total) == ({}, 2, 4)
    reader.quarantine(regenerated)
    assert learn_quarantines(root, again) == [0, 1] and again.regenerate == {0: 2, 1: 2}
    assert again.quarantined_groups == 4
    copy = WrittenGroups.from_json(again.to_json().encode(), "x")
    assert (copy.regenerate, copy.regenerated, copy.quarantined) == ({0: 2, 1: 2}, 2, {0, 1, 2})
    with pytest.raises(ValueError, match="inconsistent"):  # a group to regenerate that was never written
        WrittenGroups.from_json(b'{"next_seq": 1, "prefix": 0, "extra": [], "quarantined": [0], '
                                b'"regenerate": [[3, 0]]}', "x")  # fmt: skip


def test_a_shard_quarantined_before_the_index_counted_it_is_counted_then_unwritten(tmp_path: Path) -> None:
    """Killed after the shard, before the index save; the trainer quarantined it since: the
    claim counts it, then it is un-written like any other."""
    from asyncrl.tasks.scheduler.written_index import learn_quarantines

    root = open_root(str(tmp_path / "run"))
    writer = ShardWriter(root, RUN_ID)
    written = WrittenGroups()
    write(root, writer, written, 0, 1)
    lost = write(root, writer, None, 2, 3)
    ShardReader(root, RUN_ID).quarantine(lost)
    loaded = load_written_groups(root, RUN_ID)
    assert loaded.total == 4 and learn_quarantines(root, loaded) == [2, 3]
    assert loaded.missing_below(4) == [] and loaded.count_below(4) == 2
