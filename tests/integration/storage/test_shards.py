from __future__ import annotations

import dataclasses
import math
import threading

import pyarrow as pa
import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.schema import SCHEMA_VERSION, ShardMetadata, groups_to_table
from asyncrl.storage.shards import ShardInfo, ShardReader, ShardWriter, read_claims

RUN = "run-a"


def _arrow_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_round_trip_keeps_groups_and_metadata(root: RunRoot, group_factory, sample_factory) -> None:
    groups = [
        group_factory("g1", size=3, versions=(2, 2, 3)),
        [sample_factory("g2", versions=(4, 5), reward=-1.5), sample_factory("g2", versions=(5,), finish_reason="length")],
    ]
    info = ShardWriter(root, RUN).write_groups(groups)
    assert (info.seq, info.min_version, info.max_version) == (0, 2, 5)
    assert info.name == "shard-00000000-v000002-v000005.arrow"

    reader = ShardReader(root, RUN)
    assert reader.list_shards() == [info]
    assert reader.read_groups(info) == groups
    table = reader.read(info.name)
    assert table.num_rows == 5
    assert table.column("run_id").to_pylist() == [RUN] * 5
    assert table.column("group_size").to_pylist() == [3, 3, 3, 2, 2]
    meta = ShardMetadata.from_arrow(table.schema.metadata, "t")
    assert meta == ShardMetadata(SCHEMA_VERSION, RUN, 0, 2, 5, num_groups=2, num_rows=5)


def _assert_nothing_written(root: RunRoot) -> None:
    assert ShardReader(root, RUN).list_shards() == []


def test_writer_rejects_broken_groups(tmp_path, group_factory, sample_factory) -> None:
    root = open_root(str(tmp_path))
    writer = ShardWriter(root, RUN)
    good = group_factory("g1")
    cases = {
        "no groups": [],
        "group 1 is empty": [good, []],
        "mixes group_ids": [[sample_factory("g2"), sample_factory("g3")]],
        "split over groups 0 and 2": [group_factory("g4"), good, group_factory("g4")],
        "not a Sample": [[{"group_id": "g5"}]],
    }
    for expected, groups in cases.items():
        with pytest.raises(ShardValidationError, match=expected):
            writer.write_groups(groups)
    _assert_nothing_written(root)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"token_versions": [0, 1]}, r"len\(output_token_ids\)=3, len\(behaviour_logprobs\)=3, len\(token_versions\)=2"),
        ({"behaviour_logprobs": [-0.5]}, r"len\(behaviour_logprobs\)=1"),
        ({"token_versions": [0, -1, 0]}, "token version -1 is negative"),
        ({"token_versions": [2, 1, 1]}, r"token versions decrease \(2 -> 1\)"),
        ({"behaviour_logprobs": [-0.5, 0.25, -1.0]}, "behaviour log-prob 0.25"),
        ({"behaviour_logprobs": [-0.5, math.nan, -1.0]}, "behaviour log-prob nan"),
        ({"reward": math.inf}, "reward inf is not finite"),
        ({"finish_time": 1.0}, "finish_time 1.0"),
        ({"output_token_ids": [], "behaviour_logprobs": [], "token_versions": []}, "output_token_ids is empty"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"finish_reason": ""}, "finish_reason is empty"),
        ({"prompt_id": "other"}, "prompt_id 'other' differs"),
        ({"prompt_token_ids": [1, 2]}, "prompt_token_ids differ"),
        ({"output_token_ids": [1, 2, 2**40]}, "field output_token_ids"),
    ],
)
def test_writer_rejects_broken_rows(tmp_path, group_factory, change, expected) -> None:
    root = open_root(str(tmp_path))
    group = group_factory("gbad", size=3)
    group[2] = dataclasses.replace(group[2], **change)
    with pytest.raises(ShardValidationError, match=expected) as info:
        ShardWriter(root, RUN).write_groups([group_factory("gok"), group])
    assert "gbad" in str(info.value) or "field" in str(info.value)
    _assert_nothing_written(root)


def test_sequence_numbers_grow_and_shards_are_never_overwritten(root: RunRoot, group_factory) -> None:
    writer = ShardWriter(root, RUN)
    first = writer.write_groups([group_factory("a", versions=(1,))])
    # A file that took the next name without claiming its number: the writer must skip it.
    squatter = paths.shard_name(1, 1, 1)
    fs.put_if_absent(root, paths.shard_path(squatter), b"not mine")
    second = writer.write_groups([group_factory("b", versions=(1,))])
    assert (first.seq, second.seq) == (0, 2)
    assert fs.read_bytes(root, paths.shard_path(squatter)) == b"not mine"
    with pytest.raises(FileExistsError):
        fs.put_if_absent(root, first.relpath, b"overwrite attempt")
    assert ShardReader(root, RUN).read_groups(first) == [group_factory("a", versions=(1,))]


def test_concurrent_writers_get_distinct_sequence_numbers(root_spec, group_factory) -> None:
    writers = 4
    per_writer = 2
    results: list[ShardInfo] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(writers)

    def work(index: int) -> None:
        writer = ShardWriter(root_spec.open(), RUN)
        barrier.wait()
        for k in range(per_writer):
            try:
                info = writer.write_groups([group_factory(f"w{index}-{k}", size=2, versions=(index,))])
            except BaseException as exc:  # reported below
                with lock:
                    errors.append(exc)
                return
            with lock:
                results.append(info)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(info.seq for info in results) == list(range(writers * per_writer))
    reader = ShardReader(root_spec.open(), RUN)
    assert sorted(reader.list_shards(), key=lambda i: i.seq) == sorted(results, key=lambda i: i.seq)
    group_ids = {g[0].group_id for info in results for g in reader.read_groups(info)}
    assert group_ids == {f"w{i}-{k}" for i in range(writers) for k in range(per_writer)}


def test_oldest_policy_first_and_consumed_filter(root: RunRoot, group_factory) -> None:
    writer = ShardWriter(root, RUN)
    ranges = [(5, 6), (2, 3), (2, 2), (0, 7)]
    infos = [writer.write_groups([group_factory(f"g{i}", versions=r)]) for i, r in enumerate(ranges)]
    fs.put_if_absent(root, paths.join(paths.TRAJECTORIES_DIR, "notes.txt"), b"foreign")
    fs.put_if_absent(root, paths.join(paths.TRAJECTORIES_DIR, "shard-1.arrow"), b"foreign")
    reader = ShardReader(root, RUN)
    ordered = reader.list_shards()
    assert [(i.min_version, i.seq) for i in ordered] == [(0, 3), (2, 1), (2, 2), (5, 0)]
    assert reader.list_unconsumed(set()) == ordered
    assert reader.list_unconsumed({infos[3].name, infos[1].name}) == [infos[2], infos[0]]


def _assert_quarantined(root: RunRoot, bad_name: str, good: ShardInfo, match: str, original: bytes) -> None:
    reader = ShardReader(root, RUN)
    with pytest.raises(ShardValidationError, match=match) as info:
        reader.read(bad_name)
    message = str(info.value)
    assert bad_name in message and "quarantine" in message
    assert [i.name for i in reader.list_shards()] == [good.name]
    assert fs.read_bytes(root, paths.quarantine_path(bad_name)) == original
    assert reader.read(good).num_rows == 3


def test_corrupt_file_is_quarantined(root: RunRoot, group_factory) -> None:
    good = ShardWriter(root, RUN).write_groups([group_factory("g1")])
    valid = fs.read_bytes(root, good.relpath)
    bad_name = paths.shard_name(7, 0, 1)
    truncated = valid[: len(valid) // 2]
    fs.put_if_absent(root, paths.shard_path(bad_name), truncated)
    _assert_quarantined(root, bad_name, good, "not a readable Arrow IPC file", truncated)


def test_foreign_schema_is_quarantined(root: RunRoot, group_factory) -> None:
    good = ShardWriter(root, RUN).write_groups([group_factory("g1")])
    bad_name = paths.shard_name(7, 0, 1)
    foreign = _arrow_bytes(pa.table({"a": [1, 2], "b": ["x", "y"]}))
    fs.put_if_absent(root, paths.shard_path(bad_name), foreign)
    _assert_quarantined(root, bad_name, good, "foreign schema", foreign)


def test_shard_of_another_run_is_quarantined(root: RunRoot, group_factory) -> None:
    other = ShardWriter(root, "run-b").write_groups([group_factory("g0")])
    other_bytes = fs.read_bytes(root, other.relpath)
    good = ShardWriter(root, RUN).write_groups([group_factory("g1")])
    _assert_quarantined(root, other.name, good, "run_id 'run-b' is not this run's 'run-a'", other_bytes)


def test_name_that_lies_about_versions_is_quarantined(root: RunRoot, group_factory) -> None:
    good = ShardWriter(root, RUN).write_groups([group_factory("g1", versions=(0, 0, 1))])
    copied = fs.read_bytes(root, good.relpath)
    bad_name = paths.shard_name(9, 0, 4)
    fs.put_if_absent(root, paths.shard_path(bad_name), copied)
    _assert_quarantined(root, bad_name, good, "name says", copied)


def test_incomplete_group_in_file_is_quarantined(tmp_path, group_factory) -> None:
    root = open_root(str(tmp_path))
    good = ShardWriter(root, RUN).write_groups([group_factory("g1")])
    table = groups_to_table(RUN, [group_factory("g2", size=3)], "test").slice(0, 2)
    meta = ShardMetadata(SCHEMA_VERSION, RUN, 5, 0, 1, num_groups=1, num_rows=2)
    data = _arrow_bytes(table.replace_schema_metadata(meta.to_arrow()))
    bad_name = paths.shard_name(5, 0, 1)
    fs.put_if_absent(root, paths.shard_path(bad_name), data)
    _assert_quarantined(root, bad_name, good, "'g2' has 2 rows, group_size says 3", data)


# --- consumed shards, claims and restarts ---------------------------------------------------


def test_retire_moves_consumed_shards_out_of_the_poll_and_restore_brings_them_back(root: RunRoot, group_factory) -> None:
    writer = ShardWriter(root, RUN)
    first, second, third = (writer.write_groups([group_factory(f"g{i}")]) for i in range(3))
    reader = ShardReader(root, RUN)
    reader.retire([first.name, second.name])
    assert reader.list_pending() == [third]
    assert fs.list_dir(root, paths.TRAJECTORIES_DIR) == ["_seq", third.name]  # the poll lists only what waits
    consumed = [dataclasses.replace(first, consumed=True), dataclasses.replace(second, consumed=True)]
    assert reader.list_consumed() == consumed
    assert reader.list_shards() == [*consumed, third]
    assert consumed[0].relpath == f"consumed/{first.name}"
    # Consumed shards stay readable, by name or by their info (audits, lineage).
    assert reader.read_groups(first.name) == [group_factory("g0")]
    assert reader.read_groups(consumed[1]) == [group_factory("g1")]
    assert reader.read_groups(first) == [group_factory("g0")]  # an info taken before the move
    assert reader.locate(first.name) == consumed[0] and reader.locate(third.name) == third
    assert reader.locate(paths.shard_name(99, 0, 0)) is None
    reader.restore([second.name])
    assert reader.list_pending() == [second, third]
    with pytest.raises(FileNotFoundError, match="none at"):
        reader.retire([paths.shard_name(99, 0, 0)])


def test_a_move_cut_by_a_kill_completes_when_repeated(root: RunRoot, group_factory) -> None:
    shard = ShardWriter(root, RUN).write_groups([group_factory("g0")])
    data = fs.read_bytes(root, shard.relpath)
    reader = ShardReader(root, RUN)
    # Killed between the copy and the delete: the shard is in both places.
    fs.put_if_absent(root, paths.consumed_shard_path(shard.name), data)
    assert [i.name for i in reader.list_shards()] == [shard.name]
    reader.retire([shard.name])
    reader.retire([shard.name])  # repeated after it finished: nothing to do
    assert reader.list_pending() == [] and fs.read_bytes(root, paths.consumed_shard_path(shard.name)) == data
    # The same for a restore cut after its copy.
    fs.put_if_absent(root, shard.relpath, data)
    reader.restore([shard.name])
    reader.restore([shard.name])
    assert reader.list_pending() == [shard] and reader.list_consumed() == []


def test_claims_name_their_shard_and_groups(root: RunRoot, group_factory) -> None:
    writer = ShardWriter(root, RUN)
    first = writer.write_groups([group_factory("g0"), group_factory("g1")])
    second = writer.write_groups([group_factory("g2")])
    claims = read_claims(root, 0)
    assert [(c.seq, c.shard, c.group_ids) for c in claims] == [
        (0, first.name, ("g0", "g1")),
        (1, second.name, ("g2",)),
    ]
    assert read_claims(root, 1) == claims[1:] and read_claims(root, 2) == []


def test_a_new_writer_finds_the_next_number_without_listing(
    root: RunRoot, group_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    for seq in range(37):  # claims of an earlier writer (some of them never got a shard)
        fs.put_if_absent(root, paths.shard_seq_claim(seq), b'{"run_id": "run-a"}')
    probes: list[str] = []
    real_exists = fs.exists

    def exists(root_: RunRoot, relpath: str) -> bool:
        probes.append(relpath)
        return real_exists(root_, relpath)

    def no_listing(*args: object) -> list[str]:
        raise AssertionError("the writer listed a directory")

    monkeypatch.setattr(fs, "exists", exists)
    monkeypatch.setattr(fs, "list_dir", no_listing)
    writer = ShardWriter(root, RUN)
    assert writer.write_groups([group_factory("g0")]).seq == 37
    assert len(probes) <= 2 * math.ceil(math.log2(38)) + 1
    probes.clear()
    assert writer.write_groups([group_factory("g1")]).seq == 38 and probes == []  # remembered in memory
    # Another writer took the next numbers meanwhile: the lost claim searches on from there.
    for seq in range(39, 45):
        fs.put_if_absent(root, paths.shard_seq_claim(seq), b'{"run_id": "other"}')
    assert writer.write_groups([group_factory("g2")]).seq == 45


def test_quarantine_is_one_public_move_that_a_repeat_completes(root: RunRoot, group_factory) -> None:
    shard = ShardWriter(root, RUN).write_groups([group_factory("g0")])
    reader = ShardReader(root, RUN)
    assert reader.quarantine(shard) == paths.quarantine_path(shard.name)
    assert reader.quarantine(shard) == paths.quarantine_path(shard.name)
    assert reader.list_shards() == [] and fs.list_dir(root, paths.QUARANTINE_DIR) == [shard.name]


# --- schema versions -------------------------------------------------------------------------


def test_a_version_1_shard_without_task_is_read_as_math(tmp_path, group_factory) -> None:
    """Shards written before the ``task`` column (schema version 1) are still trained on."""
    root = open_root(str(tmp_path))
    group = group_factory("g1", size=2)
    table = groups_to_table(RUN, [group], "test").drop_columns(["task"])
    meta = ShardMetadata(1, RUN, 0, 0, 1, num_groups=1, num_rows=2)
    name = paths.shard_name(0, 0, 1)
    fs.put_if_absent(root, paths.shard_path(name), _arrow_bytes(table.replace_schema_metadata(meta.to_arrow())))
    groups = ShardReader(root, RUN).read_groups(name)
    assert groups == [group] and {s.task for s in groups[0]} == {"math"}


def test_tasks_round_trip_and_an_empty_task_is_quarantined(tmp_path, group_factory) -> None:
    root = open_root(str(tmp_path))
    code = [dataclasses.replace(s, task="code") for s in group_factory("g1")]
    info = ShardWriter(root, RUN).write_groups([code, group_factory("g2")])
    assert [[s.task for s in g] for g in ShardReader(root, RUN).read_groups(info)] == [["code"] * 3, ["math"] * 3]
    table = groups_to_table(RUN, [[dataclasses.replace(s, task="") for s in group_factory("g3")]], "test")
    meta = ShardMetadata(SCHEMA_VERSION, RUN, 5, 0, 1, num_groups=1, num_rows=3)
    data = _arrow_bytes(table.replace_schema_metadata(meta.to_arrow()))
    bad_name = paths.shard_name(5, 0, 1)
    fs.put_if_absent(root, paths.shard_path(bad_name), data)
    with pytest.raises(ShardValidationError, match="task is empty"):
        ShardReader(root, RUN).read(bad_name)
