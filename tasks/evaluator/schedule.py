"""Which weight version the evaluator takes next: the newest multiple of its period K that
is published and above the last one it took; the multiples it passes over are skipped (an
evaluator that fell behind catches up at once, and the curve keeps a point per evaluation
it could afford). Pure functions of the versions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Pick:
    target: int | None
    """The version to evaluate next; None: nothing to evaluate yet."""
    skipped: tuple[int, ...] = ()
    """Multiples of K above the last one taken and up to the newest published version that
    are not taken: older than ``target``, or no longer published; ascending."""

    @property
    def newest(self) -> int | None:
        """The newest version this pick decided on (taken or skipped): the next pick starts
        above it, since a version that is not published once it is below the newest published
        never will be."""
        decided = [*self.skipped] + ([self.target] if self.target is not None else [])
        return max(decided, default=None)


def pending_multiples(after: int, latest: int, every: int) -> list[int]:
    """The multiples m of ``every`` with after < m <= latest, newest first."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    newest = latest - latest % every
    return list(range(newest, after, -every)) if newest > after else []


def pick_version(after: int, latest: int, every: int, available: Callable[[int], bool]) -> Pick:
    """The newest pending multiple (:func:`pending_multiples`) for which ``available(v)``
    holds (published and not pruned); every other pending multiple is skipped."""
    pending = pending_multiples(after, latest, every)
    target = next((v for v in pending if available(v)), None)
    return Pick(target, tuple(sorted(v for v in pending if v != target)))
