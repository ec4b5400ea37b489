from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.tasks.algo.packing import (
    PACKERS,
    fixed_count_micro_batches,
    get_packer,
    pack_micro_batches,
    packing_efficiency,
)


@st.composite
def lengths_and_budget(draw: st.DrawFn) -> tuple[list[int], int]:
    budget = draw(st.integers(1, 512))
    lengths = draw(st.lists(st.integers(1, budget), max_size=200))
    return lengths, budget


@settings(max_examples=200, deadline=None)
@given(case=lengths_and_budget())
def test_ffd_invariants(case: tuple[list[int], int]) -> None:
    lengths, budget = case
    batches = pack_micro_batches(lengths, budget)
    placed = sorted(i for batch in batches for i in batch)
    assert placed == list(range(len(lengths)))
    assert all(batch and sum(lengths[i] for i in batch) <= budget for batch in batches)
    assert all(batch == sorted(batch) for batch in batches)
    assert len(batches) >= math.ceil(sum(lengths) / budget)
    # First fit: the sequence that opened a later micro-batch did not fit in any earlier one
    # then, so any two micro-batches together hold more than the budget.
    loads = [sum(lengths[i] for i in batch) for batch in batches]
    assert all(loads[a] + loads[b] > budget for a in range(len(loads)) for b in range(a + 1, len(loads)))
    # Decreasing order: each micro-batch is opened by its longest sequence, longest first.
    openers = [max(lengths[i] for i in batch) for batch in batches]
    assert openers == sorted(openers, reverse=True)


def test_decreasing_order_beats_input_order() -> None:
    # First fit in input order needs 4 micro-batches ([3,3,3], [7], [7], [7]); FFD needs 3.
    batches = pack_micro_batches([3, 3, 3, 7, 7, 7], 10)
    assert batches == [[0, 3], [1, 4], [2, 5]]


@settings(max_examples=100, deadline=None)
@given(case=lengths_and_budget())
def test_ffd_is_deterministic_and_accepts_numpy(case: tuple[list[int], int]) -> None:
    lengths, budget = case
    assert pack_micro_batches(np.array(lengths, dtype=np.int64), np.int64(budget)) == pack_micro_batches(
        lengths, budget
    )


def test_empty_input() -> None:
    assert pack_micro_batches([], 10) == []
    assert fixed_count_micro_batches([], 4) == []
    assert packing_efficiency([], [], 10) == 1.0


def test_overlong_sequence_names_index_length_budget() -> None:
    with pytest.raises(ValueError, match=r"sequence 2 has length 40.*budget 32"):
        pack_micro_batches([5, 8, 40, 1], 32)


@pytest.mark.parametrize(
    ("lengths", "budget", "error", "needle"),
    [
        ([3, 0], 8, ValueError, r"lengths\[1\] must be >= 1"),
        ([3, -4], 8, ValueError, r"lengths\[1\]"),
        ([3, 2.5], 8, TypeError, r"lengths\[1\] must be an integer"),
        ([3], 0, ValueError, "token_budget must be >= 1"),
    ],
)
def test_bad_input_raises(lengths: list[int], budget: int, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        pack_micro_batches(lengths, budget)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), max_size=50), count=st.integers(1, 10))
def test_fixed_count_groups_consecutive(lengths: list[int], count: int) -> None:
    batches = fixed_count_micro_batches(lengths, count)
    assert [i for batch in batches for i in batch] == list(range(len(lengths)))
    assert all(len(batch) == count for batch in batches[:-1])
    assert all(0 < len(batch) <= count for batch in batches)


def test_fixed_count_rejects_bad_count() -> None:
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        fixed_count_micro_batches([1, 2], 0)


def test_efficiency_definitions_on_a_small_case() -> None:
    lengths = [4, 2, 6, 8]
    # Budget-packed: each micro-batch costs the whole budget.
    assert packing_efficiency(lengths, [[0, 1], [2], [3]], 10) == pytest.approx(20 / 30)
    # Fixed count: each micro-batch is padded to its longest sequence.
    assert packing_efficiency(lengths, [[0, 1], [2, 3]], None) == pytest.approx(20 / (2 * 4 + 2 * 8))


def test_efficiency_rejects_inconsistent_batches() -> None:
    with pytest.raises(ValueError, match="micro-batch 1 holds index 7"):
        packing_efficiency([1, 2], [[0], [7]], None)
    with pytest.raises(ValueError, match="micro-batch 0 holds 12 tokens, over the token budget 10"):
        packing_efficiency([5, 7], [[0, 1]], 10)


@settings(max_examples=100, deadline=None)
@given(case=lengths_and_budget())
def test_efficiency_is_a_fraction(case: tuple[list[int], int]) -> None:
    lengths, budget = case
    for batches, bound in (
        (pack_micro_batches(lengths, budget), budget),
        (fixed_count_micro_batches(lengths, 4), None),
    ):
        assert 0.0 < packing_efficiency(lengths, batches, bound) <= 1.0


def test_long_tailed_lengths_pack_tightly() -> None:
    rng = np.random.default_rng(20250530)
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=1.0, size=1024), 16, 1024).astype(int).tolist()
    budget = 4096
    ffd = pack_micro_batches(lengths, budget)
    ffd_eff = packing_efficiency(lengths, ffd, budget)
    fixed_eff = packing_efficiency(lengths, fixed_count_micro_batches(lengths, 8), None)
    assert ffd_eff >= 0.95
    assert fixed_eff <= ffd_eff - 0.2


def test_registry() -> None:
    assert get_packer("ffd") is pack_micro_batches
    assert set(PACKERS) == {"ffd"}
    with pytest.raises(ValueError, match=r"unknown packer 'best'.*\['ffd'\]"):
        get_packer("best")
    with pytest.raises(TypeError):
        PACKERS["x"] = pack_micro_batches  # type: ignore[index]
