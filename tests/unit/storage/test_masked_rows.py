"""Multi-turn rows (schema version 3): ``output_mask`` and ``turn_starts`` round trip, old
shards still read, and every broken masked row is refused naming its row and field."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.schema import (
    SCHEMA_VERSION,
    TRAJECTORY_SCHEMA,
    Sample,
    ShardMetadata,
    groups_to_table,
    turn_starts_problem,
    upgrade_table,
    validate_table,
)
from asyncrl.storage.shards import ShardReader, ShardWriter

RUN = "run-masked"

# Three model turns (offsets 0-2, 5-6, 8) with environment tokens between them (3-4, 7).
MASK = [True, True, True, False, False, True, True, False, True]
TURNS = [0, 5, 8]
OUTPUT = [100, 101, 102, 900, 901, 103, 104, 902, 105]
LOGPROBS = [-0.25, -0.5, -0.75, 0.0, 0.0, -1.0, -1.25, 0.0, -1.5]
VERSIONS = [0, 0, 1, 1, 1, 1, 2, 2, 2]


def masked_sample(group_id: str = "g0", reward: float = 1.0, **change: Any) -> Sample:
    """A valid agent-episode row (prompt as in the samples of tests/support/fixtures_storage.py); ``change`` replaces fields."""
    base = Sample(
        prompt_id=f"p-{group_id}",
        group_id=group_id,
        prompt_token_ids=[11, 12, 13],
        output_token_ids=list(OUTPUT),
        behaviour_logprobs=list(LOGPROBS),
        token_versions=list(VERSIONS),
        reward=reward,
        finish_reason="stop",
        submit_time=1_700_000_000.25,
        finish_time=1_700_000_003.5,
        output_mask=list(MASK),
        turn_starts=list(TURNS),
    )
    return dataclasses.replace(base, **change)


@pytest.fixture
def local_root(tmp_path: Path) -> RunRoot:
    return open_root(str(tmp_path / "run"))


def _arrow_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_masked_and_single_turn_rows_round_trip(local_root: RunRoot, sample_factory, group_factory) -> None:
    agent = [masked_sample("g1", reward=0.0), masked_sample("g1", reward=1.0)]
    mixed = [sample_factory("g2"), masked_sample("g2")]  # a group may mix single- and multi-turn rows
    single = group_factory("g3")
    info = ShardWriter(local_root, RUN).write_groups([agent, mixed, single])
    reader = ShardReader(local_root, RUN)
    assert reader.read_groups(info) == [agent, mixed, single]
    table = reader.read(info)
    # single-turn rows are stored as nulls, so single-turn shards do not grow
    assert table.column("output_mask").to_pylist() == [MASK, MASK, None, MASK, None, None, None]
    assert table.column("turn_starts").to_pylist() == [TURNS, TURNS, None, TURNS, None, None, None]
    assert table.column("output_mask").type == pa.list_(pa.bool_())
    assert table.column("turn_starts").type == pa.list_(pa.int32())
    assert ShardMetadata.from_arrow(table.schema.metadata, "t").schema_version == SCHEMA_VERSION == 3
    # the version range (and so the shard name) is that of the model tokens
    assert (info.min_version, info.max_version) == (0, 2)


def test_model_values_pick_the_model_tokens(sample_factory) -> None:
    sample = masked_sample()
    assert sample.model_token_count == 6
    assert sample.model_values(sample.token_versions) == [0, 0, 1, 1, 2, 2]
    assert sample.model_values(sample.behaviour_logprobs) == [-0.25, -0.5, -0.75, -1.0, -1.25, -1.5]
    single = sample_factory()
    assert single.model_token_count == 3 and single.model_values(single.token_versions) == [0, 0, 1]
    with pytest.raises(ValueError, match="8 per-token values for an output_mask of 9 tokens"):
        sample.model_values(VERSIONS[:-1])


@pytest.mark.parametrize("version", [1, 2])
def test_older_shards_are_read_as_single_turn_rows(local_root: RunRoot, group_factory, version: int) -> None:
    group = group_factory("g1", size=2)
    dropped = ["output_mask", "turn_starts"] + (["task"] if version == 1 else [])
    table = groups_to_table(RUN, [group], "test").drop_columns(dropped)
    meta = ShardMetadata(version, RUN, 0, 0, 1, num_groups=1, num_rows=2)
    name = paths.shard_name(0, 0, 1)
    fs.put_if_absent(local_root, paths.shard_path(name), _arrow_bytes(table.replace_schema_metadata(meta.to_arrow())))
    reader = ShardReader(local_root, RUN)
    assert reader.read_groups(name) == [group]
    read = reader.read(name)
    assert read.schema.names == TRAJECTORY_SCHEMA.names
    assert read.column("output_mask").null_count == read.column("turn_starts").null_count == 2
    assert ShardMetadata.from_arrow(read.schema.metadata, "t").schema_version == version


def test_upgrade_leaves_a_current_table_alone_and_a_foreign_one_to_validation(group_factory) -> None:
    table = groups_to_table(RUN, [group_factory("g1")], "test")
    current = table.replace_schema_metadata(ShardMetadata(3, RUN, 0, 0, 1, 1, 3).to_arrow())
    assert upgrade_table(current) is current
    foreign = table.drop_columns(["reward", "output_mask", "turn_starts"]).replace_schema_metadata(
        ShardMetadata(2, RUN, 0, 0, 1, 1, 3).to_arrow()
    )
    with pytest.raises(ShardValidationError, match=r"missing fields \['reward'\]"):
        validate_table(upgrade_table(foreign), "test")
    v3_without_masks = table.drop_columns(["output_mask", "turn_starts"]).replace_schema_metadata(
        ShardMetadata(3, RUN, 0, 0, 1, 1, 3).to_arrow()
    )
    with pytest.raises(ShardValidationError, match=r"missing fields \['output_mask', 'turn_starts'\]"):
        validate_table(upgrade_table(v3_without_masks), "test")


def _with_env(values: list[Any], position: int, value: Any) -> list[Any]:
    changed = list(values)
    changed[position] = value
    return changed


BAD_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "mask shorter than output": ({"output_mask": MASK[:-1]}, r"len\(output_mask\)=8, len\(output_token_ids\)=9"),
    "mask longer than output": ({"output_mask": [*MASK, True]}, r"len\(output_mask\)=10, len\(output_token_ids\)=9"),
    "no model token": ({"output_mask": [False] * 9}, r"output_mask holds no True"),
    "mask without turn_starts": ({"turn_starts": None}, r"output_mask is set but turn_starts is null"),
    "turn_starts without mask": ({"output_mask": None}, r"turn_starts is set but output_mask is null"),
    "empty turn_starts": ({"turn_starts": []}, r"turn_starts is empty"),
    "first turn not at 0": ({"turn_starts": [5, 8]}, r"turn_starts\[0\] is 5, must be 0"),
    "not increasing": ({"turn_starts": [0, 8, 5]}, r"turn_starts 8 -> 5 is not strictly increasing"),
    "repeated": ({"turn_starts": [0, 5, 5, 8]}, r"turn_starts 5 -> 5 is not strictly increasing"),
    "outside the output": ({"turn_starts": [0, 5, 8, 9]}, r"turn_starts\[3\]=9 is outside the output's 9 tokens"),
    "on an environment token": ({"turn_starts": [0, 4, 8]}, r"turn_starts\[1\]=4 is an environment token"),
    "inside a model turn": ({"turn_starts": [0, 5, 6, 8]}, r"turn_starts\[2\]=6 follows a model token"),
    "a turn left out": ({"turn_starts": [0, 5]}, r"turn_starts misses the model turn beginning at output offset 8"),
    "env token with a log-prob": (
        {"behaviour_logprobs": _with_env(LOGPROBS, 4, -0.5)},
        r"environment token 4 has behaviour log-prob -0.5, must be 0.0",
    ),
    "env token with its own version": (
        {"token_versions": [0, 0, 1, 1, 2, 2, 2, 2, 2]},
        r"environment token 4 has token version 2, must repeat 1 of the token before it",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_broken_masked_row_is_refused_naming_row_and_field(local_root: RunRoot, group_factory, case: str) -> None:
    change, expected = BAD_ROWS[case]
    group = [masked_sample("g7"), masked_sample("g7", **change)]  # the bad row is row 3 of the shard
    with pytest.raises(ShardValidationError, match=rf"row 3 \(group_id 'g7'\): {expected}"):
        ShardWriter(local_root, RUN).write_groups([group_factory("g6", size=2), group])
    assert ShardReader(local_root, RUN).list_shards() == []


def test_a_stored_broken_masked_row_is_quarantined(local_root: RunRoot) -> None:
    bad = masked_sample("g1", behaviour_logprobs=_with_env(LOGPROBS, 7, -2.0))
    table = groups_to_table(RUN, [[bad]], "test")
    meta = ShardMetadata(SCHEMA_VERSION, RUN, 0, 0, 2, num_groups=1, num_rows=1)
    name = paths.shard_name(0, 0, 2)
    fs.put_if_absent(local_root, paths.shard_path(name), _arrow_bytes(table.replace_schema_metadata(meta.to_arrow())))
    with pytest.raises(ShardValidationError, match=r"row 0 \(group_id 'g1'\): environment token 7 .*moved to quarantine"):
        ShardReader(local_root, RUN).read(name)
    assert fs.list_dir(local_root, paths.QUARANTINE_DIR) == [name]


def test_a_null_element_in_the_mask_is_refused() -> None:
    table = groups_to_table(RUN, [[masked_sample("g1", output_mask=[True, None, *MASK[2:]])]], "test")
    with pytest.raises(ShardValidationError, match="field output_mask holds null list elements"):
        validate_table(table, "test")


def test_turn_starts_problem_accepts_exactly_the_turn_beginnings() -> None:
    assert turn_starts_problem(MASK, TURNS) is None
    assert turn_starts_problem([True], [0]) is None
    assert turn_starts_problem([True, False, False], [0]) is None  # an episode may end on environment tokens
    assert turn_starts_problem([True, True], [0, 1]) == "turn_starts[1]=1 follows a model token: not the start of a turn"


def test_a_sliced_table_is_checked_row_by_row(group_factory) -> None:
    """Arrow slices share their parent's buffers (offsets not from 0): each column is read at its own offsets."""
    good = masked_sample("g2")
    bad = masked_sample("g3", token_versions=[0, 0, 1, 1, 2, 2, 2, 2, 2])
    table = groups_to_table(RUN, [group_factory("g1", size=1), [good], [bad]], "test")
    assert validate_table(table.slice(1, 1), "test") == 1
    with pytest.raises(ShardValidationError, match=r"row 1 \(group_id 'g3'\): environment token 4 has token version 2"):
        validate_table(table.slice(1), "test")
