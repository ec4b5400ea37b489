"""Where a training step's shards come from: the shards the scheduler writes to the run root
(:class:`PendingShards`, a run), or the ledger of another run (:class:`LedgerReplay`, a replay:
step s trains exactly the shards that run's step s trained, read where that run keeps them).

Training is a function of (initial weights, the ledger's shards in order, trainer settings):
all the asynchrony is in which samples exist and which step took them, and both are stored.
A replay therefore reproduces a run's weights without any rollout, and writes nothing into
the run it replays.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Protocol

from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardReader
from asyncrl.tasks.trainer.feed import ShardFeed, StepInput, TrainerInputError, check_samples

logger = logging.getLogger("asyncrl.trainer")


class StepSource(Protocol):
    """The trainer's input (:class:`~asyncrl.tasks.trainer.loop.RLTrainer`)."""

    @property
    def samples_root(self) -> RunRoot:
        """The run root whose weight versions the samples name: their staleness is counted in
        the updates its lineage gives those versions."""
        ...

    def next_input(self, step: int, batch_groups: int) -> StepInput | None:
        """Step ``step``'s shards, or None while they are not there yet."""
        ...

    def consume(self, shards: Sequence[str]) -> None:
        """Rank 0, once the step's ledger entry names ``shards``."""
        ...

    def restore(self, shards: Sequence[str]) -> None:
        """A rolled-back step's ``shards``: to be trained again."""
        ...

    def forget(self, shards: Collection[str]) -> None:
        """Drop what is cached of consumed ``shards``."""
        ...

    def waiting_groups(self) -> int:
        """Prompt groups available now (for a timeout's message)."""
        ...

    def retire_recorded(self, ledger: Ledger) -> None:
        """Rank 0 at a start: shards a kept ledger entry names but that were never consumed."""
        ...


class PendingShards:
    """A run's own shards: the oldest waiting ones holding at least B groups
    (:class:`~asyncrl.tasks.trainer.feed.ShardFeed`), moved to ``consumed/`` once recorded."""

    def __init__(self, root: RunRoot, run_id: str, vocab_size: int, token_budget: int) -> None:
        self.samples_root = root
        self._reader = ShardReader(root, run_id)
        self._feed = ShardFeed(self._reader, vocab_size, token_budget)

    def next_input(self, step: int, batch_groups: int) -> StepInput | None:
        return self._feed.take(batch_groups)

    def consume(self, shards: Sequence[str]) -> None:
        self._reader.retire(shards)

    def restore(self, shards: Sequence[str]) -> None:
        self._reader.restore(shards)

    def forget(self, shards: Collection[str]) -> None:
        self._feed.forget(shards)

    def waiting_groups(self) -> int:
        return self._feed.available_groups()

    def retire_recorded(self, ledger: Ledger) -> None:
        """Move waiting shards that a kept ledger entry names to ``consumed/``: a root whose
        consumed shards were never moved (written before shards moved when consumed). On a
        root of this version there is nothing to move."""
        recorded = [info.name for info in self._reader.list_pending() if ledger.consumed_by(info.name) is not None]
        if recorded:
            logger.warning("moving %d consumed shards still in trajectories/ to consumed/", len(recorded))
            self._reader.retire(recorded)


class LedgerReplay:
    """Another run's steps, in its ledger's order: step s is the shards its entry s names, read
    (and checked against the model) from that run's root, which is never written."""

    def __init__(self, original: RunRoot, run_id: str, vocab_size: int, token_budget: int) -> None:
        self.samples_root = original  # the versions its samples name are the original's
        self._root = original
        self._ledger = Ledger(original)
        self._reader = ShardReader(original, run_id)
        self._vocab_size = vocab_size
        self._token_budget = token_budget

    def last_step(self) -> int:
        """The original run's last recorded step (0: none)."""
        return self._ledger.last_step() or 0

    def next_input(self, step: int, batch_groups: int) -> StepInput:
        """Step ``step`` of the original run; :class:`TrainerInputError` names a step its ledger
        lacks or a shard it names that is gone or fails its checks."""
        try:
            entry = self._ledger.entry(step)
        except FileNotFoundError:
            raise TrainerInputError(
                f"{self._root.display('ledger')}: the original run recorded no step {step} (its last: {self.last_step()})"
            ) from None
        groups = []
        for name in entry.shards:
            info = self._reader.locate(name)
            if info is None:
                raise TrainerInputError(
                    f"{self._root.uri}: shard {name}, trained by the original run's step {step}, is in neither "
                    "consumed/ nor trajectories/ (deleted or quarantined): the step cannot be replayed"
                )
            try:
                read = self._reader.read_groups(info)
            except ShardValidationError as exc:
                raise TrainerInputError(f"rejected trajectory shard of the original run: {exc}") from exc
            check_samples(info.relpath, read, self._vocab_size, self._token_budget)
            groups.extend(tuple(group) for group in read)
        return StepInput(shards=entry.shards, groups=tuple(groups))

    def consume(self, shards: Sequence[str]) -> None:
        return None  # the original run's shards stay where they are

    def restore(self, shards: Sequence[str]) -> None:
        return None

    def forget(self, shards: Collection[str]) -> None:
        return None

    def waiting_groups(self) -> int:
        return 0

    def retire_recorded(self, ledger: Ledger) -> None:
        return None
