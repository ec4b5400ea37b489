"""Which version the evaluator takes next: the newest published multiple of K above the
last one taken; the others are skipped, and a skipped version is never offered again."""

from __future__ import annotations

import pytest

from asyncrl.tasks.evaluator.schedule import Pick, pending_multiples, pick_version


def test_pending_multiples_are_newest_first_above_the_last_taken() -> None:
    assert pending_multiples(-1, 0, 5) == [0]
    assert pending_multiples(-1, 12, 5) == [10, 5, 0]
    assert pending_multiples(5, 12, 5) == [10]
    assert pending_multiples(10, 14, 5) == []
    assert pending_multiples(4, 9, 1) == [9, 8, 7, 6, 5]
    with pytest.raises(ValueError, match="every must be >= 1"):
        pending_multiples(-1, 3, 0)


def test_the_newest_pending_multiple_is_taken_and_the_older_ones_skipped() -> None:
    published = set(range(13))
    assert pick_version(-1, 0, 5, published.__contains__) == Pick(0, ())
    assert pick_version(0, 4, 5, published.__contains__) == Pick(None, ())
    assert pick_version(0, 17, 5, lambda v: v <= 17) == Pick(15, (5, 10))


def test_a_pruned_newest_multiple_is_skipped_and_never_offered_again() -> None:
    pick = pick_version(0, 12, 5, lambda v: v != 10)
    assert pick == Pick(5, (10,)) and pick.newest == 10
    assert pick_version(pick.newest, 14, 5, lambda v: True) == Pick(None, ())
    assert Pick(None, ()).newest is None
