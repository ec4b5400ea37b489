"""Trajectory shards: immutable Arrow IPC files under ``trajectories/``.

A :class:`ShardWriter` turns whole prompt groups into one shard per call; a
:class:`ShardReader` lists shards oldest policy first and reads them back,
moving any file that breaks the contract to ``quarantine/``.

Sequence numbers are reserved by a put-if-absent claim object
(``trajectories/_seq/{seq}``) before the shard itself is published with
put-if-absent, so concurrent writers always get distinct sequence numbers and
no name is ever reused, even after a shard is quarantined.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import pyarrow as pa

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import (
    SCHEMA_VERSION,
    Sample,
    ShardMetadata,
    groups_to_table,
    table_to_groups,
    token_version_range,
    validate_shard_metadata,
    validate_table,
)

@dataclass(frozen=True)
class ShardInfo:
    """A shard as its file name describes it."""

    name: str
    seq: int
    min_version: int
    max_version: int

    @property
    def relpath(self) -> str:
        """Path of the shard relative to the run root."""
        return paths.shard_path(self.name)

    @staticmethod
    def from_name(name: str) -> ShardInfo | None:
        """The shard a file name describes, or ``None`` for any other name."""
        parsed = paths.parse_shard_name(name)
        if parsed is None:
            return None
        return ShardInfo(name, parsed.seq, parsed.min_version, parsed.max_version)


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")


def _check_groups(groups: Sequence[Sequence[Sample]], source: str) -> None:
    """Reject an empty call, an empty group, a group mixing group_ids, or a group split in two."""
    if not groups:
        raise ShardValidationError(source, "no groups to write")
    first_index: dict[str, int] = {}
    for index, group in enumerate(groups):
        if not group:
            raise ShardValidationError(source, f"group {index} is empty")
        for sample in group:
            if not isinstance(sample, Sample):
                raise ShardValidationError(source, f"group {index} holds a {type(sample).__name__}, not a Sample")
        group_ids = sorted({sample.group_id for sample in group})
        if len(group_ids) != 1:
            raise ShardValidationError(source, f"group {index} mixes group_ids {group_ids}")
        group_id = group_ids[0]
        if group_id in first_index:
            raise ShardValidationError(
                source, f"group_id {group_id!r} is split over groups {first_index[group_id]} and {index}"
            )
        first_index[group_id] = index


def _serialize(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class ShardWriter:
    """Writes whole prompt groups of one run as new, never-overwritten shards."""

    def __init__(self, root: RunRoot, run_id: str, max_attempts: int = 1000) -> None:
        _check_run_id(run_id)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._root = root
        self._run_id = run_id
        self._max_attempts = max_attempts

    def _next_free_seq(self) -> int:
        claimed = [paths.parse_shard_seq_claim(name) for name in fs.list_dir(self._root, paths.SHARD_SEQ_DIR)]
        numbers = [n for n in claimed if n is not None]
        return max(numbers) + 1 if numbers else 0

    def _claim_seq(self) -> int:
        """Reserve a sequence number: put-if-absent of its claim (unique bytes), next number on conflict."""
        seq = self._next_free_seq()
        for _ in range(self._max_attempts):
            # The random token makes each claim's bytes unique, so put-if-absent (idempotent by
            # content) can never report two writers' claims of one number as both won.
            claim = json.dumps({"run_id": self._run_id, "claimed_at": time.time(), "token": uuid.uuid4().hex}).encode()
            try:
                fs.put_if_absent(self._root, paths.shard_seq_claim(seq), claim)
                return seq
            except FileExistsError:
                seq = max(seq + 1, self._next_free_seq())
        raise RuntimeError(f"no free shard sequence number after {self._max_attempts} attempts")

    def write_groups(self, groups: Sequence[Sequence[Sample]]) -> ShardInfo:
        """Write ``groups`` (each the complete list of samples of one group) as one new shard.

        The rows are validated (see :mod:`asyncrl.storage.schema`) before anything
        is written; the shard is serialised in memory and published with one
        put-if-absent, so readers see all of it or nothing. Returns the new shard.
        """
        source = f"new shard of run {self._run_id!r}"
        _check_groups(groups, source)
        table = groups_to_table(self._run_id, groups, source)
        num_groups = validate_table(table, source, run_id=self._run_id)
        min_version, max_version = token_version_range(table)
        for _ in range(self._max_attempts):
            seq = self._claim_seq()
            info = ShardInfo(paths.shard_name(seq, min_version, max_version), seq, min_version, max_version)
            metadata = ShardMetadata(
                schema_version=SCHEMA_VERSION,
                run_id=self._run_id,
                seq=seq,
                min_version=min_version,
                max_version=max_version,
                num_groups=num_groups,
                num_rows=table.num_rows,
            )
            data = _serialize(table.replace_schema_metadata(metadata.to_arrow()))
            try:
                fs.put_if_absent(self._root, info.relpath, data)
                return info
            except FileExistsError:
                continue  # a file written without a claim: leave it, take the next number
        raise RuntimeError(f"could not publish a shard after {self._max_attempts} attempts")


class ShardReader:
    """Lists and reads the shards of one run; bad files go to ``quarantine/``."""

    def __init__(self, root: RunRoot, run_id: str) -> None:
        _check_run_id(run_id)
        self._root = root
        self._run_id = run_id

    def list_shards(self) -> list[ShardInfo]:
        """All shards in ``trajectories/``, oldest policy first: sorted by (min_version, seq).

        Names that are not shard names are ignored.
        """
        infos = [ShardInfo.from_name(name) for name in fs.list_dir(self._root, paths.TRAJECTORIES_DIR)]
        return sorted((i for i in infos if i is not None), key=lambda i: (i.min_version, i.seq))

    def list_unconsumed(self, consumed: Collection[str]) -> list[ShardInfo]:
        """Shards whose names are not in ``consumed``, oldest policy first."""
        return [info for info in self.list_shards() if info.name not in consumed]

    def read(self, shard: ShardInfo | str) -> pa.Table:
        """The validated table of ``shard`` (a :class:`ShardInfo` or a shard file name).

        A file that is not Arrow IPC, has another schema, belongs to another run,
        or breaks a row invariant is moved to ``quarantine/`` and
        :class:`ShardValidationError` naming it is raised. A missing file raises
        :class:`FileNotFoundError`.
        """
        info = self._info(shard)
        data = fs.read_bytes(self._root, info.relpath)
        try:
            return self._decode(info, data)
        except ShardValidationError as exc:
            moved_to = self._quarantine(info)
            raise ShardValidationError(exc.source, f"{exc.problem} (moved to {moved_to})") from None

    def read_groups(self, shard: ShardInfo | str) -> list[list[Sample]]:
        """The groups of ``shard``, each the complete list of its samples in row order."""
        return table_to_groups(self.read(shard))

    def _info(self, shard: ShardInfo | str) -> ShardInfo:
        if isinstance(shard, ShardInfo):
            return shard
        info = ShardInfo.from_name(shard)
        if info is None:
            raise ValueError(f"{shard!r} is not a shard file name")
        return info

    def _decode(self, info: ShardInfo, data: bytes) -> pa.Table:
        source = self._root.display(info.relpath)
        try:
            table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ShardValidationError(source, f"not a readable Arrow IPC file: {exc}") from None
        num_groups = validate_table(table, source, run_id=self._run_id)
        validate_shard_metadata(
            table, source, self._run_id, info.seq, info.min_version, info.max_version, num_groups
        )
        return table

    def _quarantine(self, info: ShardInfo) -> str:
        """Move the shard to ``quarantine/`` (a unique suffix if that name is taken); return where."""
        target = paths.quarantine_path(info.name)
        try:
            fs.move_no_overwrite(self._root, info.relpath, target)
        except FileExistsError:
            target = paths.quarantine_path(f"{info.name}.{uuid.uuid4().hex[:8]}")
            fs.move_no_overwrite(self._root, info.relpath, target)
        return target
