"""Trajectory shards: immutable Arrow IPC files under ``trajectories/``.

A :class:`ShardWriter` turns whole prompt groups into one shard per call; a
:class:`ShardReader` lists shards oldest first and reads them back, moving any file that
breaks the contract to ``quarantine/``. Sequence numbers are reserved by a put-if-absent
claim (``trajectories/_seq/{seq}``, naming the shard and its group ids) before the shard is
published, so concurrent writers never share or reuse a name. A consumed shard moves to
``consumed/`` (and back on a ledger rollback), so ``trajectories/`` holds only the shards
still waiting and a trainer poll lists O(waiting shards) names, not O(run). Life cycle
and the requests each operation costs: ``docs/internals/storage.md``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import time
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from asyncrl.storage import fs, paths
from asyncrl.storage.admissions import Admission, admissions_metadata
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import (
    SCHEMA_VERSION,
    Sample,
    ShardMetadata,
    groups_to_table,
    table_to_groups,
    token_version_range,
    upgrade_table,
    validate_shard_metadata,
    validate_table,
)

LOG = logging.getLogger("asyncrl.storage.shards")

@dataclass(frozen=True)
class ShardInfo:
    """A shard as its file name describes it, and whether it lies in ``consumed/``."""

    name: str
    seq: int
    min_version: int
    max_version: int
    consumed: bool = False
    """True once a ledger entry consumed it: the file is then in ``consumed/``."""

    @property
    def relpath(self) -> str:
        """Path of the shard relative to the run root (``trajectories/`` or ``consumed/``)."""
        return paths.consumed_shard_path(self.name) if self.consumed else paths.shard_path(self.name)

    @staticmethod
    def from_name(name: str, consumed: bool = False) -> ShardInfo | None:
        """The shard a file name describes, or ``None`` for any other name."""
        parsed = paths.parse_shard_name(name)
        if parsed is None:
            return None
        return ShardInfo(name, parsed.seq, parsed.min_version, parsed.max_version, consumed)


@dataclass(frozen=True)
class SeqClaim:
    """A sequence-number claim: the shard it reserved and the group ids it was to hold.

    ``shard`` and ``group_ids`` are ``None`` for a claim written before claims named them.
    A claim does not mean the shard was published: its writer may have died in between.
    """

    seq: int
    shard: str | None
    group_ids: tuple[str, ...] | None


def _parse_claim(seq: int, content: dict[str, object]) -> SeqClaim:
    shard = content.get("shard")
    groups = content.get("groups")
    if isinstance(shard, str) and isinstance(groups, list) and all(isinstance(g, str) for g in groups):
        return SeqClaim(seq, shard, tuple(groups))
    return SeqClaim(seq, None, None)


def read_claim(root: RunRoot, seq: int) -> SeqClaim | None:
    """The claim of sequence number ``seq`` (one read), or ``None`` if it is not claimed."""
    content = fs.read_json_object(root, paths.shard_seq_claim(seq))
    return None if content is None else _parse_claim(seq, content)


def read_claims(root: RunRoot, start_seq: int) -> list[SeqClaim]:
    """The claims ``start_seq``, ``start_seq + 1``, ... up to the first number not claimed.

    Claimed numbers form a prefix 0..M-1 (see :meth:`ShardWriter._first_free_seq`), so
    this is every claim from ``start_seq`` on: k + 1 reads for k claims. ``ValueError``
    names a claim that is not a JSON object.
    """
    claims: list[SeqClaim] = []
    seq = start_seq
    while True:
        claim = read_claim(root, seq)
        if claim is None:
            return claims
        claims.append(claim)
        seq += 1


@dataclass(frozen=True)
class QuarantinedShard:
    """A shard moved to ``quarantine/``, with the group ids its claim names."""

    name: str
    """The shard's file name (as it was published)."""
    seq: int
    copies: tuple[str, ...]
    """Its files in ``quarantine/`` (relative paths): one, or more if it was quarantined
    again with other bytes (unique suffixes, :meth:`ShardReader.quarantine`)."""
    group_ids: tuple[str, ...] | None
    """The groups it held, from its sequence-number claim (the file itself may be unreadable);
    ``None`` if the claim names none, names another shard, or is gone."""


def quarantined_shard_names(root: RunRoot) -> dict[str, tuple[str, ...]]:
    """Shard name -> its copies in ``quarantine/`` (relative paths), by sequence number: one
    listing of ``quarantine/``; names that are not shard copies are ignored."""
    copies: dict[str, list[str]] = {}
    for name in sorted(fs.list_dir(root, paths.QUARANTINE_DIR)):
        shard = paths.parse_quarantine_name(name)
        if shard is not None:
            copies.setdefault(shard, []).append(paths.quarantine_path(name))
    return {name: tuple(copies[name]) for name in sorted(copies)}  # names order as their 8-digit seq


def quarantined_shard(root: RunRoot, name: str, copies: Sequence[str]) -> QuarantinedShard:
    """The quarantined shard ``name`` with the groups its claim names (one read)."""
    info = ShardInfo.from_name(name)
    if info is None:
        raise ValueError(f"{name!r} is not a shard file name")
    claim = read_claim(root, info.seq)
    groups = claim.group_ids if claim is not None and claim.shard == name else None
    return QuarantinedShard(name, info.seq, tuple(copies), groups)


def list_quarantined(root: RunRoot) -> list[QuarantinedShard]:
    """Every quarantined shard, by sequence number, with the groups it held: one listing of
    ``quarantine/`` and one claim read per quarantined shard (for audits; the scheduler reads
    the claims of the shards it has not seen yet only,
    :func:`asyncrl.tasks.scheduler.written_index.learn_quarantines`)."""
    return [quarantined_shard(root, name, copies) for name, copies in quarantined_shard_names(root).items()]


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
    """Writes whole prompt groups of one run as new, never-overwritten shards.

    The writer keeps the next sequence number to try in memory. Its first claim finds
    the end of the claimed numbers by a galloping search (HEADs, no listing), and after
    a lost claim it searches again from the lost number, so a writer never lists
    ``trajectories/_seq/``. Restart-safe: nothing but the claims themselves is stored,
    and a put-if-absent claim is what makes a number ours.
    """

    def __init__(self, root: RunRoot, run_id: str, max_attempts: int = 1000) -> None:
        _check_run_id(run_id)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._root = root
        self._run_id = run_id
        self._max_attempts = max_attempts
        self._next_seq: int | None = None

    def _claimed(self, seq: int) -> bool:
        return fs.exists(self._root, paths.shard_seq_claim(seq))

    def _first_free_seq(self, start: int) -> int:
        """The end of the claimed prefix at or after ``start``: some n >= start with n free and
        (n == start or n - 1 claimed).

        Galloping search: probe start, start+1, start+2, start+4, ... until a free number,
        then bisect between the last claimed and the first free probe: at most
        2 ceil(log2(g + 1)) + 1 HEADs for g claimed numbers after ``start``. Claims are only
        ever made at such an end (or, after a lost race, at the next end above), so the
        claimed numbers stay a prefix 0..M-1 and the search returns M. Were the prefix
        broken by hand, the number found is still only a candidate: the put-if-absent claim
        decides, so two writers never share a number.
        """
        if not self._claimed(start):
            return start
        low, step = start, 1  # low: claimed
        high = low + step
        while self._claimed(high):
            low, step = high, step * 2
            high = low + step
        while high - low > 1:  # low claimed, high free
            middle = (low + high) // 2
            if self._claimed(middle):
                low = middle
            else:
                high = middle
        return high

    def _claim_seq(self, min_version: int, max_version: int, group_ids: Sequence[str]) -> int:
        """Reserve a sequence number: put-if-absent of its claim (unique bytes), which names the
        shard and its group ids; on a lost race search again from the next number."""
        seq = self._first_free_seq(0) if self._next_seq is None else self._next_seq
        for _ in range(self._max_attempts):
            # The random token makes each claim's bytes unique, so put-if-absent (idempotent by
            # content) can never report two writers' claims of one number as both won.
            claim = json.dumps(
                {
                    "run_id": self._run_id,
                    "claimed_at": time.time(),
                    "token": uuid.uuid4().hex,
                    "shard": paths.shard_name(seq, min_version, max_version),
                    "groups": list(group_ids),
                }
            ).encode()
            try:
                fs.put_if_absent(self._root, paths.shard_seq_claim(seq), claim)
                self._next_seq = seq + 1
                return seq
            except FileExistsError:
                seq = self._first_free_seq(seq + 1)
        raise RuntimeError(f"no free shard sequence number after {self._max_attempts} attempts")

    def write_groups(
        self, groups: Sequence[Sequence[Sample]], admissions: Mapping[str, Admission] | None = None
    ) -> ShardInfo:
        """Write ``groups`` (each the complete list of samples of one group) as one new shard,
        with the scheduler's ``admissions`` of exactly these groups by group id, if given
        (:mod:`asyncrl.storage.admissions`).

        The rows are validated (see :mod:`asyncrl.storage.schema`) before anything
        is written; the shard is serialised in memory and published with one
        put-if-absent, so readers see all of it or nothing. Returns the new shard.
        """
        source = f"new shard of run {self._run_id!r}"
        _check_groups(groups, source)
        table = groups_to_table(self._run_id, groups, source)
        num_groups = validate_table(table, source, run_id=self._run_id)
        min_version, max_version = token_version_range(table)
        group_ids = [group[0].group_id for group in groups]
        if admissions is not None and set(admissions) != set(group_ids):
            raise ShardValidationError(
                source, f"admission records of groups {sorted(admissions)}, the shard holds {sorted(group_ids)}"
            )
        extra = {} if admissions is None else admissions_metadata(admissions)
        for _ in range(self._max_attempts):
            seq = self._claim_seq(min_version, max_version, group_ids)
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
            data = _serialize(table.replace_schema_metadata(metadata.to_arrow() | extra))
            try:
                fs.put_if_absent(self._root, info.relpath, data)
                return info
            except FileExistsError:
                continue  # a file written without a claim: leave it, take the next number
        raise RuntimeError(f"could not publish a shard after {self._max_attempts} attempts")


def _sorted(infos: Iterable[ShardInfo | None]) -> list[ShardInfo]:
    return sorted((i for i in infos if i is not None), key=lambda i: (i.min_version, i.seq))


def _move(root: RunRoot, src: str, dst: str) -> None:
    """Move object ``src`` to ``dst``, idempotently: copy (put-if-absent), then delete ``src``.

    Repeating a move that was cut anywhere completes it: a copy already at ``dst`` with the
    same bytes counts as done (put-if-absent is idempotent by content), and a ``src`` that is
    gone while ``dst`` exists means the move finished. :class:`FileExistsError` names ``dst``
    if it holds other bytes (``src`` is kept); :class:`FileNotFoundError` names both paths
    if the object is at neither.
    """
    try:
        data = fs.read_bytes(root, src)
    except FileNotFoundError:
        if fs.exists(root, dst):
            return
        raise FileNotFoundError(
            errno.ENOENT, f"no such object, and none at {root.display(dst)} either", root.display(src)
        ) from None
    fs.put_if_absent(root, dst, data)
    fs.delete(root, src, missing_ok=True)


class ShardReader:
    """Lists and reads the shards of one run; moves them to ``consumed/`` and back, and bad
    files to ``quarantine/``."""

    def __init__(self, root: RunRoot, run_id: str) -> None:
        _check_run_id(run_id)
        self._root = root
        self._run_id = run_id

    def list_pending(self) -> list[ShardInfo]:
        """The shards waiting in ``trajectories/`` (not consumed), oldest policy first: sorted by
        (min_version, seq). One listing of O(waiting shards) names; other names are ignored."""
        return _sorted(ShardInfo.from_name(name) for name in fs.list_dir(self._root, paths.TRAJECTORIES_DIR))

    def list_consumed(self) -> list[ShardInfo]:
        """The shards in ``consumed/``, oldest policy first. O(consumed shards): an audit tool."""
        return _sorted(ShardInfo.from_name(name, True) for name in fs.list_dir(self._root, paths.CONSUMED_DIR))

    def list_shards(self) -> list[ShardInfo]:
        """All shards of the run, waiting and consumed, oldest policy first: sorted by
        (min_version, seq). O(run): meant for audits and tests; the trainer polls
        :meth:`list_pending`. ``trajectories/`` is listed before and after ``consumed/``
        (moves copy before they delete, so a shard moving either way is seen once). A
        shard in both places (a cut move) is listed once, as waiting."""
        pending = {info.name: info for info in self.list_pending()}
        consumed = self.list_consumed()
        pending.update((info.name, info) for info in self.list_pending())
        return _sorted([*pending.values(), *(info for info in consumed if info.name not in pending)])

    def list_unconsumed(self, consumed: Collection[str] = ()) -> list[ShardInfo]:
        """Waiting shards (:meth:`list_pending`) whose names are not in ``consumed``."""
        return [info for info in self.list_pending() if info.name not in consumed]

    def locate(self, name: str) -> ShardInfo | None:
        """Where the shard ``name`` is: waiting (``trajectories/``), consumed (``consumed/``), or
        ``None`` if in neither (never published, or quarantined). At most 3 existence checks
        (2 for a shard that is there), right even while a move runs."""
        info = self._info(name)
        if fs.exists(self._root, info.relpath):
            return info
        consumed = ShardInfo(info.name, info.seq, info.min_version, info.max_version, True)
        if fs.exists(self._root, consumed.relpath):
            return consumed
        # Moves copy before they delete: a retire is seen above, a restore here.
        return info if fs.exists(self._root, info.relpath) else None

    def retire(self, names: Iterable[str]) -> None:
        """Move the named shards from ``trajectories/`` to ``consumed/`` (done after a ledger
        entry names them). Idempotent: a retire cut by a kill completes when repeated."""
        for name in names:
            _move(self._root, paths.shard_path(name), paths.consumed_shard_path(name))

    def restore(self, names: Iterable[str]) -> None:
        """Move the named shards from ``consumed/`` back to ``trajectories/`` (a ledger rollback:
        they are to be trained again). Idempotent like :meth:`retire`."""
        for name in names:
            _move(self._root, paths.consumed_shard_path(name), paths.shard_path(name))

    def read(self, shard: ShardInfo | str) -> pa.Table:
        """The validated table of ``shard`` (a :class:`ShardInfo` or a shard file name), read where
        it is: where the info says (a name: ``trajectories/``), else in the other place of
        ``trajectories/`` and ``consumed/`` (it moved since).

        A file that is not Arrow IPC, has another schema, belongs to another run,
        or breaks a row invariant is moved to ``quarantine/`` and
        :class:`ShardValidationError` naming it is raised. A missing file raises
        :class:`FileNotFoundError`.
        """
        info = self._info(shard)
        try:
            data = fs.read_bytes(self._root, info.relpath)
        except FileNotFoundError:
            # Consumed (or restored) since it was listed: it is in the other place.
            first, info = info, dataclasses.replace(info, consumed=not info.consumed)
            try:
                data = fs.read_bytes(self._root, info.relpath)
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT, f"no such shard, and none at {self._root.display(info.relpath)} either",
                    self._root.display(first.relpath),
                ) from None
        try:
            return self._decode(info, data)
        except ShardValidationError as exc:
            moved_to = self.quarantine(info)
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
        table = upgrade_table(table)
        num_groups = validate_table(table, source, run_id=self._run_id)
        validate_shard_metadata(
            table, source, self._run_id, info.seq, info.min_version, info.max_version, num_groups
        )
        return table

    def quarantine(self, shard: ShardInfo | str) -> str:
        """Move the shard to ``quarantine/`` (a unique suffix if that name holds other bytes);
        return the relative path it now has. The one way a shard is rejected: the reader
        does it for files that break the contract, the trainer for data its model cannot
        train on. Idempotent: a quarantine cut by a kill completes when repeated. The
        scheduler then generates the shard's groups again, once per quarantined shard
        (:func:`asyncrl.tasks.scheduler.written_index.learn_quarantines`): it finds them by
        listing ``quarantine/`` and reading the shard's claim (:func:`list_quarantined`)."""
        info = self._info(shard)
        target = paths.quarantine_path(info.name)
        try:
            _move(self._root, info.relpath, target)
        except FileExistsError:
            target = paths.quarantine_path(f"{info.name}.{uuid.uuid4().hex[:8]}")
            _move(self._root, info.relpath, target)
        LOG.warning("quarantined %s as %s", self._root.display(info.relpath), self._root.display(target))
        return target
