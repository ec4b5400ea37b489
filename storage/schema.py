"""The Arrow schema of trajectory shards, the :class:`Sample` record, and validation.

One row per sample (one generated answer, or one agent episode). The rows of a prompt group
are contiguous and always in the same shard, and every row carries ``group_size`` so a reader
can check that its group is complete. A multi-turn row (schema version 3) interleaves tokens
the model sampled (``output_mask`` True: trained) with tokens the environment inserted
(False: context only, behaviour log-prob 0.0, the version of the model token before them);
``turn_starts`` lists where each model turn begins. Both are null for a single-turn row.
:func:`validate_table` checks every row invariant (lengths, finite values, non-decreasing
token versions, whole contiguous groups, mask/turn consistency); the full list is in
``docs/internals/storage.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from asyncrl.storage.errors import ShardValidationError

SCHEMA_VERSION = 3
"""Version 2 added ``task`` (the reward that scored the row: ``math``, ``code`` or a plug-in's
name); version 3 added the nullable ``output_mask`` and ``turn_starts`` of multi-turn rows.
Older shards are still read (:func:`upgrade_table`): version-1 rows get task ``math``, the
only task version 1 could train, and version-1 and -2 rows get null masks (single-turn)."""
READABLE_SCHEMA_VERSIONS: tuple[int, ...] = (1, 2, SCHEMA_VERSION)
V1_TASK = "math"
T = TypeVar("T")

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
    pa.field("output_mask", pa.list_(pa.bool_()), nullable=True),
    pa.field("turn_starts", pa.list_(pa.int32()), nullable=True),
)
NULLABLE_FIELDS: frozenset[str] = frozenset(f.name for f in TRAJECTORY_FIELDS if f.nullable)
"""Columns whose rows may be null (their list elements may not)."""
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
    Samples read back from a shard hold plain lists. A multi-turn sample carries
    ``output_mask`` and ``turn_starts`` (module docstring); a single-turn one leaves both None.
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
    output_mask: Sequence[bool] | None = None
    """Per output token: True if the model sampled it (trained), False if the environment
    inserted it (context only). None: every output token is a model token."""
    turn_starts: Sequence[int] | None = None
    """Output offsets where each model turn begins (first 0); None for a single-turn sample."""

    @property
    def model_token_count(self) -> int:
        """Output tokens the model sampled: sum_t output_mask[t], or all of them without a mask."""
        if self.output_mask is None:
            return len(self.output_token_ids)
        return sum(1 for m in self.output_mask if m)

    def model_values(self, values: Sequence[T]) -> list[T]:
        """The entries of a per-output-token sequence (``behaviour_logprobs``,
        ``token_versions``) at model tokens, in order; all of them without a mask."""
        if self.output_mask is None:
            return list(values)
        if len(values) != len(self.output_mask):
            raise ValueError(f"{len(values)} per-token values for an output_mask of {len(self.output_mask)} tokens")
        return [v for v, m in zip(values, self.output_mask) if m]


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


def _list_column(
    values: list[Sequence[Any] | None], value_type: pa.DataType, field_name: str, source: str
) -> pa.Array:
    """A list column; None values become null rows (rejected later unless the field is nullable)."""
    try:
        return pa.array([None if v is None else list(v) for v in values], type=pa.list_(value_type))
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
        _list_column([s.output_mask for s in samples], pa.bool_(), "output_mask", source),
        _list_column([s.turn_starts for s in samples], pa.int32(), "turn_starts", source),
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
            output_mask=data["output_mask"][i],
            turn_starts=data["turn_starts"][i],
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
    """An older shard table in the current layout, its metadata kept (it still names the
    version it was written with): version 1 (metadata version 1) gets the ``task`` column
    as :data:`V1_TASK`; versions 1 and 2 get null ``output_mask`` and ``turn_starts``
    (single-turn rows). Each is inserted at its place in :data:`TRAJECTORY_FIELDS`; a column
    already there is left alone, and any other table is returned unchanged (the validation
    that follows judges it)."""
    metadata = table.schema.metadata or {}
    version = metadata.get(META_SCHEMA_VERSION)
    if version not in (b"1", b"2"):
        return table
    for index, field in enumerate(TRAJECTORY_FIELDS):
        if field.name in table.column_names:
            continue
        index = min(index, table.num_columns)  # a foreign table: check_schema names what it lacks
        if field.name == "task" and version == b"1":
            table = table.add_column(index, field, pa.array([V1_TASK] * table.num_rows, pa.string()))
        elif field.name in NULLABLE_FIELDS:
            table = table.add_column(index, field, pa.nulls(table.num_rows, field.type))
    return table.replace_schema_metadata(metadata)


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
    """No null rows outside :data:`NULLABLE_FIELDS`, and no null list elements anywhere."""
    for name in table.column_names:
        column = table.column(name)
        if column.null_count and name not in NULLABLE_FIELDS:
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


def _list_parts(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column: row r holds ``values[offsets[r]:offsets[r + 1]]``
    (null rows: whatever range Arrow gives them; callers skip them)."""
    array = column.combine_chunks()
    return array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()


def turn_starts_problem(mask: Sequence[bool], turn_starts: Sequence[int]) -> str | None:
    """Why ``turn_starts`` does not fit ``mask`` (module docstring), or None if it does."""
    starts = list(turn_starts)
    if not starts:
        return "turn_starts is empty"
    if starts[0] != 0:
        return f"turn_starts[0] is {starts[0]}, must be 0"
    for k, offset in enumerate(starts):
        if k and offset <= starts[k - 1]:
            return f"turn_starts {starts[k - 1]} -> {offset} is not strictly increasing"
        if not 0 <= offset < len(mask):
            return f"turn_starts[{k}]={offset} is outside the output's {len(mask)} tokens"
        if not mask[offset]:
            return f"turn_starts[{k}]={offset} is an environment token (output_mask False)"
        if offset and mask[offset - 1]:
            return f"turn_starts[{k}]={offset} follows a model token: not the start of a turn"
    listed = set(starts)
    for p in range(1, len(mask)):
        if mask[p] and not mask[p - 1] and p not in listed:
            return f"turn_starts misses the model turn beginning at output offset {p}"
    return None


def _check_masks(table: pa.Table, source: str) -> None:
    """The ``output_mask`` / ``turn_starts`` invariants of the module docstring (after
    :func:`_check_token_rows`, so the per-token columns have the output's length)."""
    mask_null = pc.is_null(table.column("output_mask")).to_numpy(zero_copy_only=False)
    turns_null = pc.is_null(table.column("turn_starts")).to_numpy(zero_copy_only=False)
    for row in np.flatnonzero(mask_null != turns_null)[:1]:
        given, missing = ("output_mask", "turn_starts") if turns_null[row] else ("turn_starts", "output_mask")
        raise ShardValidationError(source, _row_problem(table, int(row), f"{given} is set but {missing} is null"))
    if mask_null.all():
        return
    masks, mask_offsets = _list_parts(table.column("output_mask"))
    turns, turn_offsets = _list_parts(table.column("turn_starts"))
    _, output_offsets = _list_parts(table.column("output_token_ids"))
    logprobs, logprob_offsets = _list_parts(table.column("behaviour_logprobs"))
    versions, version_offsets = _list_parts(table.column("token_versions"))
    for row in np.flatnonzero(~mask_null):
        row = int(row)
        mask = masks[mask_offsets[row] : mask_offsets[row + 1]].astype(bool)
        start, end = output_offsets[row], output_offsets[row + 1]
        if mask.size != end - start:
            raise ShardValidationError(
                source, _row_problem(table, row, f"len(output_mask)={mask.size}, len(output_token_ids)={end - start}")
            )
        if not mask.any():
            raise ShardValidationError(source, _row_problem(table, row, "output_mask holds no True (no model token)"))
        problem = turn_starts_problem(mask.tolist(), turns[turn_offsets[row] : turn_offsets[row + 1]].tolist())
        if problem is not None:
            raise ShardValidationError(source, _row_problem(table, row, problem))
        env = np.flatnonzero(~mask)
        row_logprobs = logprobs[logprob_offsets[row] : logprob_offsets[row + 1]]
        for t in env[row_logprobs[env] != 0.0][:1]:
            raise ShardValidationError(
                source,
                _row_problem(table, row, f"environment token {t} has behaviour log-prob {row_logprobs[t]}, must be 0.0"),
            )
        # env[0] >= 1: output token 0 is a model token (turn_starts[0] == 0 was checked).
        row_versions = versions[version_offsets[row] : version_offsets[row + 1]]
        for t in env[row_versions[env] != row_versions[env - 1]][:1]:
            raise ShardValidationError(
                source,
                _row_problem(
                    table,
                    row,
                    f"environment token {t} has token version {row_versions[t]}, must repeat "
                    f"{row_versions[t - 1]} of the token before it",
                ),
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
    _check_masks(table, source)
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

