"""Which prompt group k is: its id ``g{k:08d}`` (and back) and its prompt, chosen by a seeded
per-epoch permutation. Kept apart from the controller because the trainer's feed, the audit
and the benchmarks name groups the same way.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from asyncrl.tasks.data.records import PromptRecord


def group_id(index: int) -> str:
    return f"g{index:08d}"


def group_index(gid: str) -> int:
    if not (gid.startswith("g") and gid[1:].isdigit()):
        raise ValueError(f"group id {gid!r} was not written by the scheduler (expected g########)")
    return int(gid[1:])


def scheduler_group_index(gid: str) -> int | None:
    """:func:`group_index` of a scheduler group id, None for any other id (a filler's, a
    hand-written shard's)."""
    try:
        return group_index(gid)
    except ValueError:
        return None


class PromptSchedule:
    """Group k -> prompt: epoch e = k // N visits all N prompts in a permutation seeded
    by (seed, e), so the order is reproducible and each epoch sees every prompt once."""

    def __init__(self, records: Sequence[PromptRecord], seed: int) -> None:
        if not records:
            raise ValueError("the prompt dataset is empty")
        self._records = list(records)
        self._seed = seed
        self._orders: dict[int, list[int]] = {}

    def record(self, index: int) -> PromptRecord:
        epoch, position = divmod(index, len(self._records))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._records)))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all the controller needs
        return self._records[order[position]]
