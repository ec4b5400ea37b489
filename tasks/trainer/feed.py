"""The trainer's input: whole trajectory shards, in the order they were written, checked before use.

A step consumes whole shards (the ledger records shard names) in sequence-number order until
they hold at least B groups. The controller writes groups in admission order and never lets a
shard straddle a batch (:mod:`asyncrl.tasks.scheduler.controller`), so step s takes exactly
the s-th admission batch and no sample is staler than the staleness bound; if shards do not line up, a step
takes more than B groups, never fewer. Consumed shards leave ``trajectories/``, so a poll
lists O(waiting shards) names. Every shard is validated by the storage reader, then against
the model (token ids below the vocabulary, sequences within the micro-batch budget); a failing
shard is quarantined and :class:`TrainerInputError` names it, nothing consumed; the scheduler
then generates its groups again, once, as later shards
(:func:`asyncrl.tasks.scheduler.written_index.learn_quarantines`). Why written order:
``docs/internals/trainer.md``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardInfo, ShardReader


class TrainerInputError(ValueError):
    """Trajectory data the trainer cannot train on; the message names shard, row, field and value."""


@dataclass(frozen=True)
class StepInput:
    """The shards one step consumes and their prompt groups, oldest first."""

    shards: tuple[str, ...]
    groups: tuple[tuple[Sample, ...], ...]

    @property
    def num_samples(self) -> int:
        return sum(len(group) for group in self.groups)


def check_samples(shard: str, groups: Sequence[Sequence[Sample]], vocab_size: int, token_budget: int) -> None:
    """Raise :class:`TrainerInputError` for a token id outside [0, vocab_size) or a sequence
    longer than ``token_budget`` (prompt + output tokens); rows counted as in the shard."""
    row = 0
    for group in groups:
        for sample in group:
            for field in ("prompt_token_ids", "output_token_ids"):
                tokens = getattr(sample, field)
                bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise TrainerInputError(
                        f"{shard}: row {row} (group_id {sample.group_id!r}): {field} holds token id {bad}, "
                        f"outside the model's vocabulary of {vocab_size} ids; is the shard from another model?"
                    )
            length = len(sample.prompt_token_ids) + len(sample.output_token_ids)
            if length > token_budget:
                raise TrainerInputError(
                    f"{shard}: row {row} (group_id {sample.group_id!r}): prompt + output is {length} tokens, "
                    f"over trainer.micro_batch_tokens={token_budget}"
                )
            row += 1


class ShardFeed:
    """Reads, checks and caches unconsumed shards; hands out the oldest ones for a step."""

    def __init__(self, reader: ShardReader, vocab_size: int, token_budget: int) -> None:
        self._reader = reader
        self._vocab_size = vocab_size
        self._token_budget = token_budget
        self._cache: dict[str, tuple[tuple[Sample, ...], ...]] = {}

    def _groups(self, info: ShardInfo) -> tuple[tuple[Sample, ...], ...]:
        cached = self._cache.get(info.name)
        if cached is None:
            try:
                groups = self._reader.read_groups(info)
            except ShardValidationError as exc:
                raise TrainerInputError(f"rejected trajectory shard: {exc}") from exc
            try:
                check_samples(info.relpath, groups, self._vocab_size, self._token_budget)
            except TrainerInputError as exc:
                moved_to = self._reader.quarantine(info)
                raise TrainerInputError(
                    f"{exc} (shard moved to {moved_to}; a restarted trainer goes on without it)"
                ) from None
            cached = tuple(tuple(group) for group in groups)
            self._cache[info.name] = cached
        return cached

    def waiting(self, consumed: Collection[str] = ()) -> list[ShardInfo]:
        """The waiting shards not named in ``consumed``, in the order they were written (sequence number)."""
        return sorted(self._reader.list_unconsumed(consumed), key=lambda info: info.seq)

    def available_groups(self, consumed: Collection[str] = ()) -> int:
        """Prompt groups in all waiting shards not named in ``consumed`` (reads and checks them)."""
        return sum(len(self._groups(info)) for info in self.waiting(consumed))

    def take(self, batch_groups: int, consumed: Collection[str] = ()) -> StepInput | None:
        """The first-written waiting shards (not named in ``consumed``) holding >= ``batch_groups``
        groups, or None if there are not enough yet. Shards are whole: a step gets exactly
        ``batch_groups`` groups from shards that line up with batches (what the rollout
        controller writes), more otherwise. Work: one listing of the waiting shards, and a read of
        each shard not seen before (checked shards are cached until :meth:`forget`)."""
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        names: list[str] = []
        groups: list[tuple[Sample, ...]] = []
        for info in self.waiting(consumed):
            names.append(info.name)
            groups.extend(self._groups(info))
            if len(groups) >= batch_groups:
                return StepInput(shards=tuple(names), groups=tuple(groups))
        return None

    def forget(self, names: Collection[str]) -> None:
        """Drop cached shards (after they are consumed)."""
        for name in names:
            self._cache.pop(name, None)
