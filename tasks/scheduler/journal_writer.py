"""The scheduler's journal writer: puts the rollout client's book of in-flight samples
(:class:`~asyncrl.tasks.inference.sample_journal.SampleJournal`) in the run root
(:mod:`asyncrl.storage.journal`) whenever some sample holds ``rollout.journal_tokens``
tokens not yet journaled, or ``rollout.journal_seconds`` after the last write if any does;
and, when a scheduler starts, hands the book the journaled samples of the groups it
dispatches again. In an agent run the recording endpoint's completed turns
(:class:`~asyncrl.tasks.inference.turn_journal.TurnJournal`) go in the same object, due by
the same rule on their tokens, and are handed back the same way.

What a kill costs: a sample in flight loses the tokens it received since the last write
(fewer than ``journal_tokens`` when the writes keep up, plus those the write in progress
did not hold) and those its server had generated but not yet streamed (the client's
``stream_interval``). One object replaced per write, as large as the samples in flight:
storage does not grow with the run, and the write runs off the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

from asyncrl.configs.rollout import RolloutConfig
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.journal import JournaledSample, JournaledTurn, read_journal_contents, write_journal
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.turn_journal import TurnJournal

POLL_SECONDS = 0.1
"""How often the writer looks whether a write is due."""


class JournalWriter:
    """Journals ``book`` (and ``turns``) to ``root`` by ``rollout.journal_tokens`` / ``journal_seconds``."""

    def __init__(
        self, root: RunRoot, book: SampleJournal, rollout: RolloutConfig, turns: TurnJournal | None = None
    ) -> None:
        self.root = root
        self.book = book
        self.turns = turns
        self.every_tokens = rollout.journal_tokens
        self.every_seconds = rollout.journal_seconds
        self._last_write = time.monotonic()
        self._put_lock = threading.Lock()
        """One put at a time, in snapshot order (a cancelled wait leaves its put running)."""
        self.writes = 0
        self.bytes_written = 0
        self.last_bytes = 0
        self.write_s = 0.0
        self.snapshot_s = 0.0

    async def resume(self, groups: set[str]) -> int:
        """Load the journaled samples and turns of ``groups`` (the unwritten groups dispatched
        again) into the books; returns how many samples and turns they hold for them."""
        saved = await asyncio.to_thread(read_journal_contents, self.root)
        chosen = {key: samples for key, samples in saved.samples.items() if key in groups}
        self.book.load(chosen)
        turns = {key: group_turns for key, group_turns in saved.turns.items() if key in groups}
        if self.turns is not None:
            self.turns.load(turns)
        return sum(len(samples) for samples in chosen.values()) + sum(len(t) for t in turns.values())

    def forget(self, groups: Iterable[str]) -> None:
        """These groups are in a shard or left out: no longer journaled."""
        groups = list(groups)
        self.book.forget(groups)
        if self.turns is not None:
            self.turns.forget(groups)

    def due(self) -> bool:
        """A write is due: some sample holds ``every_tokens`` unjournaled tokens, or any does
        and ``every_seconds`` have passed since the last write."""
        behind = max(self.book.unjournaled_tokens(), self.turns.unjournaled_tokens() if self.turns else 0)
        if behind <= 0:
            return False
        return behind >= self.every_tokens or time.monotonic() - self._last_write >= self.every_seconds

    async def run(self, stop: asyncio.Event) -> None:
        """Write whenever due until ``stop``."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), POLL_SECONDS)
            except TimeoutError:
                pass
            if not stop.is_set() and self.due():
                await self.write()

    async def write(self) -> None:
        """Snapshot the book now (on the event loop: consistent) and put it (in a thread)."""
        started = time.monotonic()
        samples = self.book.snapshot()
        turns = self.turns.snapshot() if self.turns is not None else []
        self.snapshot_s += time.monotonic() - started
        self._last_write = time.monotonic()
        await asyncio.to_thread(self._put, samples, turns)

    def _put(self, samples: list[JournaledSample], turns: list[JournaledTurn]) -> None:
        with self._put_lock:
            started = time.monotonic()
            size = write_journal(self.root, samples, turns)
            self.write_s += time.monotonic() - started
            self.writes += 1
            self.bytes_written += size
            self.last_bytes = size

    def figures(self) -> dict[str, float]:
        """The journal's work and what it saved, for the controller's summary."""
        counts = self.book.counts
        return {
            "journal_writes": float(self.writes),
            "journal_bytes": float(self.bytes_written),
            "journal_last_bytes": float(self.last_bytes),
            "journal_write_s": self.write_s,
            "journal_snapshot_s": self.snapshot_s,
            "journal_resumed_samples": float(counts.resumed_samples),
            "journal_resumed_tokens": float(counts.resumed_tokens),
            "journal_finished_resumed": float(counts.finished_resumed),
            "journal_mismatched_groups": float(counts.mismatched),
            **({
                "journal_replayed_turns": float(self.turns.counts.replayed_turns),
                "journal_replayed_turn_tokens": float(self.turns.counts.replayed_tokens),
                "journal_diverged_episodes": float(self.turns.counts.diverged),
            } if self.turns is not None else {}),
        }  # fmt: skip
