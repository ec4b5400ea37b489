"""The consumption ledger: which shards each training step used.

One JSON object per step, ``ledger/step-{step:08d}.json``, published with put-if-absent
before the step's weights are published: the audit trail of exactly-once use (a shard
named by one entry can never be named by another). On resume from a checkpoint,
:meth:`Ledger.rollback_after` drops the entries of steps the checkpoint does not contain,
so their shards are trained on again. One trainer process writes the ledger. A
:class:`Ledger` reads the entries once and then keeps a restart-safe copy in memory, so a
:meth:`Ledger.record` is one put-if-absent whatever the run's length; the readers always
read storage (for audits and tests). Details: ``docs/internals/storage.md``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot

LEDGER_FORMAT = 1


@dataclass(frozen=True)
class LedgerEntry:
    """The shards training step ``step`` consumed, and when that was recorded (unix s)."""

    step: int
    shards: tuple[str, ...]
    recorded_at: float


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def _parse_entry(raw: bytes, step: int, source: str) -> LedgerEntry:
    try:
        content = json.loads(raw)
        shards = content["shards"]
        recorded_at = float(content["recorded_at"])
        stored_step = content["step"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{source}: corrupt ledger entry ({exc})") from None
    if stored_step != step:
        raise ValueError(f"{source}: entry says step {stored_step!r}, its name says {step}")
    if not isinstance(shards, list) or not all(isinstance(name, str) for name in shards):
        raise ValueError(f"{source}: 'shards' is not a list of names: {shards!r}")
    return LedgerEntry(step=step, shards=tuple(shards), recorded_at=recorded_at)


class Ledger:
    """Records, per training step, the shard names it consumed."""

    def __init__(self, root: RunRoot) -> None:
        self._root = root
        self._consumer: dict[str, int] | None = None
        """Writer state: consumed shard -> its step (None until the first ``record``)."""
        self._last: int | None = None
        """Writer state: the highest recorded step."""

    def _writer_state(self) -> dict[str, int]:
        """The consumed names and last step, read from storage on the first call only."""
        if self._consumer is None:
            entries = self.entries()
            self._consumer = {name: entry.step for entry in entries for name in entry.shards}
            self._last = entries[-1].step if entries else None
        return self._consumer

    def consumed_by(self, name: str) -> int | None:
        """The step whose entry names shard ``name``, or None (writer state: the entries are
        read on the first call of this or :meth:`record`, then kept in memory)."""
        return self._writer_state().get(name)

    def entry(self, step: int) -> LedgerEntry:
        """The entry of ``step`` (one read); :class:`FileNotFoundError` names it if absent."""
        _check_step(step)
        relpath = paths.ledger_entry(step)
        return _parse_entry(fs.read_bytes(self._root, relpath), step, self._root.display(relpath))

    def steps(self) -> list[int]:
        """Recorded steps, ascending."""
        parsed = [paths.parse_ledger_name(name) for name in fs.list_dir(self._root, paths.LEDGER_DIR)]
        return sorted(step for step in parsed if step is not None)

    def entries(self) -> list[LedgerEntry]:
        """All entries ordered by step; ``ValueError`` names a corrupt entry file."""
        steps = self.steps()
        relpaths = {step: paths.ledger_entry(step) for step in steps}
        contents = fs.read_many(self._root, relpaths.values())
        return [
            _parse_entry(contents[relpaths[step]], step, self._root.display(relpaths[step])) for step in steps
        ]

    def consumed(self) -> set[str]:
        """Names of all shards consumed by recorded steps (reads every entry: O(steps))."""
        return {name for entry in self.entries() for name in entry.shards}

    def last_step(self) -> int | None:
        """The highest recorded step, or ``None`` if none is recorded."""
        steps = self.steps()
        return steps[-1] if steps else None

    def record(self, step: int, shards: Sequence[str]) -> LedgerEntry:
        """Record that ``step`` consumed ``shards`` (shard file names); return the entry.

        Refused with ``ValueError``: an empty or duplicated shard list, a name
        that is not a shard name, a step not above the last recorded one (or
        already recorded), and a shard already consumed (the error names the
        shard and the step that consumed it).
        """
        _check_step(step)
        names = list(shards)
        if not names:
            raise ValueError(f"step {step}: no shards to record")
        for name in names:
            if not isinstance(name, str) or paths.parse_shard_name(name) is None:
                raise ValueError(f"step {step}: {name!r} is not a shard file name")
        duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
        if duplicates:
            raise ValueError(f"step {step}: shards listed twice: {duplicates}")
        consumer = self._writer_state()
        if self._last is not None and step <= self._last:
            word = "already recorded" if step in consumer.values() else "not after"
            raise ValueError(f"step {step} is {word} (last recorded step {self._last})")
        for name in names:
            if name in consumer:
                raise ValueError(f"step {step}: shard {name} was already consumed by step {consumer[name]}")
        entry = LedgerEntry(step=step, shards=tuple(names), recorded_at=time.time())
        content = {"format": LEDGER_FORMAT, "step": step, "shards": names, "recorded_at": entry.recorded_at}
        try:
            fs.put_if_absent(self._root, paths.ledger_entry(step), json.dumps(content).encode())
        except FileExistsError:
            self._consumer = None  # another writer: read the entries again next time
            raise ValueError(f"step {step} is already recorded (written concurrently)") from None
        consumer.update((name, step) for name in names)
        self._last = step
        return entry

    def rollback_after(self, step: int, restore: Callable[[Sequence[str]], None] | None = None) -> list[int]:
        """Delete the entries of steps greater than ``step``, newest first; return them ascending.

        ``step = -1`` clears the ledger. Deleting newest first means an
        interrupted rollback still leaves a prefix of the steps recorded.
        With ``restore``, each doomed entry is read and ``restore(its shards)`` is called
        before the entry is deleted (the trainer moves them back to ``trajectories/``):
        a rollback cut by a kill leaves every still-recorded step's shards to be restored
        again by the next call, so ``restore`` must be idempotent. Work: one listing,
        and per doomed step one read (with ``restore``) and one delete.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        doomed = [s for s in self.steps() if s > step]
        for later in reversed(doomed):
            if restore is not None:
                restore(self.entry(later).shards)
            fs.delete(self._root, paths.ledger_entry(later))
        if doomed and self._consumer is not None:
            self._consumer = {name: s for name, s in self._consumer.items() if s <= step}
            self._last = max(self._consumer.values(), default=None)  # every entry names >= 1 shard
        return doomed
