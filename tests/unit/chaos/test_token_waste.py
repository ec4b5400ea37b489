"""The waste audit's token count and bound: the formula of asyncrl.chaos.token_waste, what
the journal changes, and the two ways a count breaks its contract."""

from __future__ import annotations

import pytest

from asyncrl.chaos.token_waste import regeneration_bound, token_waste


def test_the_bound_is_what_each_kind_of_kill_may_lose() -> None:
    # eta 1, 2 groups of 2 samples a step: at most 8 samples in flight, answers of up to 300 tokens
    journaled = regeneration_bound(["scheduler", "rollout", "trainer", "reward", "scheduler"], 1, 2, 2, 300, 64)
    assert journaled == {"scheduler": 2 * 8 * 128, "rollout": 8 * 300, "trainer": 0, "reward": 0}
    unjournaled = regeneration_bound(["scheduler"], 1, 2, 2, 300, 0)
    assert unjournaled == {"scheduler": 8 * 300}
    assert regeneration_bound(["scheduler"], 1, 2, 2, 100, 64) == {"scheduler": 8 * 100}  # short answers: all of them
    assert regeneration_bound([], 1, 2, 2, 300, 64) == {}
    with pytest.raises(ValueError, match="no regeneration bound for a kill of 'node'"):
        regeneration_bound(["node"], 1, 2, 2, 300, 64)


def test_tokens_received_and_not_kept_are_regenerated_and_checked_against_the_bound() -> None:
    bound = {"scheduler": 1000}
    within = token_waste({"delivered-1-1.count": 5000, "delivered-2-2.count": 700}, 5200, 100, bound)
    assert (within.received, within.kept, within.regenerated, within.bound) == (5700, 5300, 400, 1000)
    assert within.problems() == []
    over = token_waste({"a": 7000}, 5200, 100, bound)
    assert over.regenerated == 1700
    assert "1700 tokens were generated again after the kills, over the bound of 1000" in over.problems()[0]
    missing = token_waste({"a": 5000}, 5200, 100, bound)
    assert "fewer than the 5300 kept: a count is missing" in missing.problems()[0]
