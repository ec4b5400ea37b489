"""The Arrow schema of trajectory shards, the :class:`Sample` record, and validation.

One row per sample (one generated answer). The rows of a prompt group (the n
samples of one prompt) are contiguous and always in the same shard; every row
carries ``group_size`` so a reader can check that its group is complete.

Row invariants checked by :func:`validate_table`:

* ``len(output_token_ids) == len(behaviour_logprobs) == len(token_versions) >= 1``
  and ``prompt_token_ids`` is not empty;
* token versions are non-negative and non-decreasing along the output (a weight
  update only ever moves a running sequence to a newer policy);
* behaviour log-probabilities are finite and ``<= 0``; reward is finite;
* ``submit_time <= finish_time``, both finite; ``finish_reason`` and ``task`` not empty;
* all rows of a group are contiguous, share ``prompt_id`` and ``prompt_token_ids``,
  and number exactly ``group_size``; ``run_id`` is the run's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from asyncrl.storage.errors import ShardValidationError

SCHEMA_VERSION = 2
"""Version 2 added ``task`` (the reward that scored the row: ``math``, ``code`` or a plug-in's
name). Version-1 shards are still read: :func:`upgrade_table` gives their rows task ``math``,
the only task version 1 could train."""
READABLE_SCHEMA_VERSIONS: tuple[int, ...] = (1, SCHEMA_VERSION)
V1_TASK = "math"

TRAJECTORY_FIELDS: tuple[pa.Field, ...] = (
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("group_size", pa.int32(), nullable=False),
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("output_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("submit_time", pa.float64(), nullable=False),
    pa.field("finish_time", pa.float64(), nullable=False),
    pa.field("task", pa.string(), nullable=False),
)
TRAJECTORY_SCHEMA = pa.schema(list(TRAJECTORY_FIELDS))

# Schema metadata keys written in every shard.
META_SCHEMA_VERSION = b"asyncrl.schema_version"
META_RUN_ID = b"asyncrl.run_id"
META_SEQ = b"asyncrl.seq"
META_MIN_VERSION = b"asyncrl.min_version"
META_MAX_VERSION = b"asyncrl.max_version"
META_NUM_GROUPS = b"asyncrl.num_groups"
META_NUM_ROWS = b"asyncrl.num_rows"
_META_KEYS = (
    META_SCHEMA_VERSION,
    META_RUN_ID,
    META_SEQ,
    META_MIN_VERSION,
    META_MAX_VERSION,
    META_NUM_GROUPS,
    META_NUM_ROWS,
)


@dataclass(frozen=True)
class Sample:
    """One generated answer to a prompt, as the trainer needs it.

    ``behaviour_logprobs[t]`` is log pi_behav of output token t under the policy
    version ``token_versions[t]`` that sampled it. Times are unix seconds.
    The run id and the group size are shard-level facts added by the writer.
    Samples read back from a shard hold plain lists.
    """

    prompt_id: str
    group_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    token_versions: Sequence[int]
    reward: float
    finish_reason: str
    submit_time: float
    finish_time: float
    task: str = V1_TASK
    """The reward that scored this sample: ``math``, ``code`` or a plug-in's name."""


@dataclass(frozen=True)
class ShardMetadata:
    """The facts a shard's schema metadata repeats."""

    schema_version: int
    run_id: str
    seq: int
    min_version: int
    max_version: int
    num_groups: int
    num_rows: int

    def to_arrow(self) -> dict[bytes, bytes]:
        """Schema metadata mapping (all values as decimal/UTF-8 strings)."""
        return {
            META_SCHEMA_VERSION: str(self.schema_version).encode(),
            META_RUN_ID: self.run_id.encode(),
            META_SEQ: str(self.seq).encode(),
            META_MIN_VERSION: str(self.min_version).encode(),
            META_MAX_VERSION: str(self.max_version).encode(),
            META_NUM_GROUPS: str(self.num_groups).encode(),
            META_NUM_ROWS: str(self.num_rows).encode(),
        }

    @staticmethod
    def from_arrow(metadata: dict[bytes, bytes] | None, source: str) -> ShardMetadata:
        """Parse schema metadata; :class:`ShardValidationError` names a missing or bad key."""
        metadata = metadata or {}
        missing = [key.decode() for key in _META_KEYS if key not in metadata]
        if missing:
            raise ShardValidationError(source, f"schema metadata lacks {missing}")
        numbers: dict[bytes, int] = {}
        for key in _META_KEYS:
            if key == META_RUN_ID:
                continue
            raw = metadata[key].decode(errors="replace")
            try:
                numbers[key] = int(raw)
            except ValueError:
                raise ShardValidationError(source, f"schema metadata {key.decode()}={raw!r} is not an int") from None
        return ShardMetadata(
            schema_version=numbers[META_SCHEMA_VERSION],
            run_id=metadata[META_RUN_ID].decode(errors="replace"),
            seq=numbers[META_SEQ],
            min_version=numbers[META_MIN_VERSION],
            max_version=numbers[META_MAX_VERSION],
            num_groups=numbers[META_NUM_GROUPS],
            num_rows=numbers[META_NUM_ROWS],
        )


def _list_column(values: list[Sequence[Any]], value_type: pa.DataType, field_name: str, source: str) -> pa.Array:
    try:
        return pa.array([list(v) for v in values], type=pa.list_(value_type))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise ShardValidationError(source, f"field {field_name}: {exc}") from None


def _scalar_column(values: list[Any], value_type: pa.DataType, field_name: str, source: str) -> pa.Array:
    try:
        return pa.array(values, type=value_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise ShardValidationError(source, f"field {field_name}: {exc}") from None


def groups_to_table(run_id: str, groups: Sequence[Sequence[Sample]], source: str) -> pa.Table:
    """Build a table of :data:`TRAJECTORY_SCHEMA` (no metadata) from whole groups.

    ``group_size`` of every row is the length of its group. Values that do not
    fit the column types raise :class:`ShardValidationError` naming the field.
    """
    samples = [sample for group in groups for sample in group]
    sizes = [len(group) for group in groups for _ in group]
    columns = [
        _scalar_column([run_id] * len(samples), pa.string(), "run_id", source),
        _scalar_column([s.prompt_id for s in samples], pa.string(), "prompt_id", source),
        _scalar_column([s.group_id for s in samples], pa.string(), "group_id", source),
        _scalar_column(sizes, pa.int32(), "group_size", source),
        _list_column([s.prompt_token_ids for s in samples], pa.int32(), "prompt_token_ids", source),
        _list_column([s.output_token_ids for s in samples], pa.int32(), "output_token_ids", source),
        _list_column([s.behaviour_logprobs for s in samples], pa.float32(), "behaviour_logprobs", source),
        _list_column([s.token_versions for s in samples], pa.int32(), "token_versions", source),
        _scalar_column([s.reward for s in samples], pa.float32(), "reward", source),
        _scalar_column([s.finish_reason for s in samples], pa.string(), "finish_reason", source),
        _scalar_column([s.submit_time for s in samples], pa.float64(), "submit_time", source),
        _scalar_column([s.finish_time for s in samples], pa.float64(), "finish_time", source),
        _scalar_column([s.task for s in samples], pa.string(), "task", source),
    ]
    return pa.Table.from_arrays(columns, schema=TRAJECTORY_SCHEMA)


def table_to_samples(table: pa.Table) -> list[Sample]:
    """Rows of a trajectory table as :class:`Sample` objects, in row order."""
    data = table.select([f.name for f in TRAJECTORY_FIELDS]).to_pydict()
    return [
        Sample(
            prompt_id=data["prompt_id"][i],
            group_id=data["group_id"][i],
            prompt_token_ids=data["prompt_token_ids"][i],
            output_token_ids=data["output_token_ids"][i],
            behaviour_logprobs=data["behaviour_logprobs"][i],
            token_versions=data["token_versions"][i],
            reward=data["reward"][i],
            finish_reason=data["finish_reason"][i],
            submit_time=data["submit_time"][i],
            finish_time=data["finish_time"][i],
            task=data["task"][i],
        )
        for i in range(table.num_rows)
    ]


def table_to_groups(table: pa.Table) -> list[list[Sample]]:
    """Rows of a (validated) trajectory table split into groups of consecutive equal ``group_id``."""
    groups: list[list[Sample]] = []
    for sample in table_to_samples(table):
        if groups and groups[-1][0].group_id == sample.group_id:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def upgrade_table(table: pa.Table) -> pa.Table:
    """A version-1 shard table (no ``task`` column, metadata version 1) with the ``task``
    column added as :data:`V1_TASK` and its metadata kept; any other table unchanged (the
    validation that follows judges it)."""
    metadata = table.schema.metadata or {}
    if metadata.get(META_SCHEMA_VERSION) != b"1" or "task" in table.column_names:
        return table
    column = pa.array([V1_TASK] * table.num_rows, type=pa.string())
    upgraded = table.append_column(pa.field("task", pa.string(), nullable=False), column)
    return upgraded.replace_schema_metadata(metadata)


def check_schema(schema: pa.Schema, source: str) -> None:
    """Raise :class:`ShardValidationError` unless ``schema`` has exactly the trajectory fields.

    Names, order and types must match :data:`TRAJECTORY_SCHEMA` (metadata aside).
    """
    expected = {f.name: f.type for f in TRAJECTORY_FIELDS}
    actual = {f.name: f.type for f in schema}
    missing = [name for name in expected if name not in actual]
    extra = [name for name in actual if name not in expected]
    if missing or extra:
        raise ShardValidationError(source, f"foreign schema: missing fields {missing}, unexpected fields {extra}")
    for name, value_type in expected.items():
        if not actual[name].equals(value_type):
            raise ShardValidationError(source, f"field {name} has type {actual[name]}, expected {value_type}")
    if schema.names != TRAJECTORY_SCHEMA.names:
        raise ShardValidationError(source, f"fields in order {schema.names}, expected {TRAJECTORY_SCHEMA.names}")


def _check_no_nulls(table: pa.Table, source: str) -> None:
    for name in table.column_names:
        column = table.column(name)
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            raise ShardValidationError(source, f"row {row}: field {name} is null")
        if pa.types.is_list(column.type):
            values = pc.list_flatten(column)
            if values.null_count:
                raise ShardValidationError(source, f"field {name} holds null list elements")


def _row_problem(table: pa.Table, row: int, message: str) -> str:
    group_id = table.column("group_id")[row].as_py()
    return f"row {row} (group_id {group_id!r}): {message}"


def _lengths(table: pa.Table, name: str) -> np.ndarray:
    return pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False)


def _check_token_rows(table: pa.Table, source: str) -> None:
    """Per-row token invariants (lengths, versions, log-probs), vectorised over the table."""
    n_prompt = _lengths(table, "prompt_token_ids")
    n_output = _lengths(table, "output_token_ids")
    n_logprob = _lengths(table, "behaviour_logprobs")
    n_version = _lengths(table, "token_versions")
    for row in np.flatnonzero(n_prompt == 0):
        raise ShardValidationError(source, _row_problem(table, int(row), "prompt_token_ids is empty"))
    for row in np.flatnonzero(n_output == 0):
        raise ShardValidationError(source, _row_problem(table, int(row), "output_token_ids is empty"))
    for row in np.flatnonzero((n_logprob != n_output) | (n_version != n_output)):
        raise ShardValidationError(
            source,
            _row_problem(
                table,
                int(row),
                f"len(output_token_ids)={n_output[row]}, len(behaviour_logprobs)={n_logprob[row]}, "
                f"len(token_versions)={n_version[row]} must be equal",
            ),
        )
    row_of_token = np.repeat(np.arange(table.num_rows), n_output)
    versions = pc.list_flatten(table.column("token_versions")).to_numpy(zero_copy_only=False)
    for index in np.flatnonzero(versions < 0)[:1]:
        row = int(row_of_token[index])
        raise ShardValidationError(source, _row_problem(table, row, f"token version {versions[index]} is negative"))
    if versions.size > 1:
        same_row = row_of_token[1:] == row_of_token[:-1]
        for index in np.flatnonzero(same_row & (versions[1:] < versions[:-1]))[:1]:
            row = int(row_of_token[index])
            raise ShardValidationError(
                source,
                _row_problem(table, row, f"token versions decrease ({versions[index]} -> {versions[index + 1]})"),
            )
    logprobs = pc.list_flatten(table.column("behaviour_logprobs")).to_numpy(zero_copy_only=False)
    for index in np.flatnonzero(~np.isfinite(logprobs) | (logprobs > 0))[:1]:
        row = int(row_of_token[index])
        raise ShardValidationError(
            source, _row_problem(table, row, f"behaviour log-prob {logprobs[index]} is not finite and <= 0")
        )


def _check_scalar_rows(table: pa.Table, source: str) -> None:
    reward = table.column("reward").to_numpy()
    for row in np.flatnonzero(~np.isfinite(reward))[:1]:
        raise ShardValidationError(source, _row_problem(table, int(row), f"reward {reward[row]} is not finite"))
    submit = table.column("submit_time").to_numpy()
    finish = table.column("finish_time").to_numpy()
    for row in np.flatnonzero(~np.isfinite(submit) | ~np.isfinite(finish) | (finish < submit))[:1]:
        raise ShardValidationError(
            source,
            _row_problem(table, int(row), f"submit_time {submit[row]} / finish_time {finish[row]} not finite and ordered"),
        )
    for name in ("finish_reason", "task"):
        empty = pc.equal(pc.utf8_length(table.column(name)), 0)
        if pc.any(empty).as_py():
            row = pc.index(empty, True).as_py()
            raise ShardValidationError(source, _row_problem(table, row, f"{name} is empty"))


def _check_groups(table: pa.Table, source: str) -> int:
    """Check group contiguity and completeness; return the number of groups."""
    group_ids = table.column("group_id").to_pylist()
    sizes = table.column("group_size").to_pylist()
    prompt_ids = table.column("prompt_id").to_pylist()
    prompts = table.column("prompt_token_ids")
    seen: set[str] = set()
    start = 0
    while start < len(group_ids):
        group_id = group_ids[start]
        if group_id in seen:
            raise ShardValidationError(source, f"row {start}: rows of group_id {group_id!r} are not contiguous")
        seen.add(group_id)
        end = start
        while end < len(group_ids) and group_ids[end] == group_id:
            end += 1
        expected = sizes[start]
        for row in range(start, end):
            if sizes[row] != expected:
                raise ShardValidationError(
                    source, _row_problem(table, row, f"group_size {sizes[row]} differs from {expected} in row {start}")
                )
            if prompt_ids[row] != prompt_ids[start]:
                raise ShardValidationError(
                    source,
                    _row_problem(table, row, f"prompt_id {prompt_ids[row]!r} differs from {prompt_ids[start]!r} in row {start}"),
                )
            if row > start and not prompts[row].equals(prompts[start]):
                raise ShardValidationError(source, _row_problem(table, row, f"prompt_token_ids differ from row {start}"))
        if end - start != expected:
            raise ShardValidationError(
                source, f"row {start}: group_id {group_id!r} has {end - start} rows, group_size says {expected}"
            )
        start = end
    return len(seen)


def token_version_range(table: pa.Table) -> tuple[int, int]:
    """``(min, max)`` over all output-token policy versions of a non-empty table."""
    versions = pc.list_flatten(table.column("token_versions"))
    bounds = pc.min_max(versions).as_py()
    return int(bounds["min"]), int(bounds["max"])


def validate_table(table: pa.Table, source: str, run_id: str | None = None) -> int:
    """Check ``table`` against the schema and the row invariants of this module.

    ``source`` names the file (or input) in errors; with ``run_id`` every row
    must carry it. Returns the number of groups. Raises
    :class:`ShardValidationError` naming the source, row, field and value.
    """
    check_schema(table.schema, source)
    if table.num_rows == 0:
        raise ShardValidationError(source, "table has no rows")
    _check_no_nulls(table, source)
    if run_id is not None:
        wrong = pc.not_equal(table.column("run_id"), run_id)
        if pc.any(wrong).as_py():
            row = pc.index(wrong, True).as_py()
            other = table.column("run_id")[row].as_py()
            raise ShardValidationError(source, f"row {row}: run_id {other!r} is not this run's {run_id!r}")
    _check_token_rows(table, source)
    _check_scalar_rows(table, source)
    return _check_groups(table, source)


def validate_shard_metadata(
    table: pa.Table, source: str, run_id: str, seq: int, min_version: int, max_version: int, num_groups: int
) -> ShardMetadata:
    """Check the schema metadata of a validated shard table against its name and content.

    The metadata must name ``run_id``, a version of :data:`READABLE_SCHEMA_VERSIONS`, the ``seq`` and
    version range of the file name; the range must be the table's actual
    ``token_version_range``; row count and ``num_groups`` (as counted by
    :func:`validate_table`) must match.
    """
    meta = ShardMetadata.from_arrow(table.schema.metadata, source)
    if meta.schema_version not in READABLE_SCHEMA_VERSIONS:
        raise ShardValidationError(
            source, f"schema version {meta.schema_version}, expected one of {list(READABLE_SCHEMA_VERSIONS)}"
        )
    if meta.run_id != run_id:
        raise ShardValidationError(source, f"shard belongs to run {meta.run_id!r}, not to run {run_id!r}")
    named = (seq, min_version, max_version)
    stored = (meta.seq, meta.min_version, meta.max_version)
    if stored != named:
        raise ShardValidationError(source, f"metadata (seq, min_version, max_version)={stored} but name says {named}")
    actual = token_version_range(table)
    if actual != (min_version, max_version):
        raise ShardValidationError(source, f"token versions span {actual}, name says {(min_version, max_version)}")
    if meta.num_rows != table.num_rows:
        raise ShardValidationError(source, f"metadata num_rows={meta.num_rows}, table has {table.num_rows}")
    if meta.num_groups != num_groups:
        raise ShardValidationError(source, f"metadata num_groups={meta.num_groups}, table has {num_groups}")
    return meta

