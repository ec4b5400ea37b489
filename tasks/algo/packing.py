"""Dynamic micro-batching: pack variable-length sequences under a token budget.

Plain Python over sequence lengths; a packer returns micro-batches as lists of
indices into ``lengths``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

Packer = Callable[[Sequence[int], int], list[list[int]]]


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing packing of sequences into micro-batches of at most ``token_budget`` tokens.

    Sequences are taken longest first (ties: lower index first); each goes into
    the first micro-batch, in creation order, whose token sum stays <= budget,
    else opens a new one.  Indices inside a micro-batch are returned in ascending
    order (the input order, e.g. oldest first).  Every index appears exactly
    once; an empty input gives [].
    """
    lens = _check_lengths(lengths)
    budget = _check_positive("token_budget", token_budget)
    for index, length in enumerate(lens):
        if length > budget:
            raise ValueError(
                f"sequence {index} has length {length}, longer than the token budget {budget}; "
                f"raise the budget or truncate the sequence"
            )
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    batches: list[list[int]] = []
    free: list[int] = []  # free[b] = budget - tokens already in batches[b]
    for index in order:
        length = lens[index]
        for b, room in enumerate(free):
            if length <= room:
                batches[b].append(index)
                free[b] = room - length
                break
        else:
            batches.append([index])
            free.append(budget - length)
    result = [sorted(batch) for batch in batches]
    _check_packing(lens, result, budget)
    return result


def fixed_count_micro_batches(lengths: Sequence[int], count: int) -> list[list[int]]:
    """Baseline: consecutive groups of ``count`` sequences (the last may be shorter)."""
    n = len(_check_lengths(lengths))
    size = _check_positive("count", count)
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]


def packing_efficiency(lengths: Sequence[int], batches: Sequence[Sequence[int]], token_budget: int | None) -> float:
    """Real tokens over processed tokens (padding included) for micro-batches ``batches``.

        efficiency = sum_b sum_{i in b} L_i / sum_b processed(b)

    processed(b) = ``token_budget`` for a budget-packed micro-batch (it is padded
    to the budget so shapes and memory are fixed); with ``token_budget`` None
    (fixed-count baseline) each micro-batch is padded to its longest sequence:
    processed(b) = len(b) * max_{i in b} L_i.  No processed tokens gives 1.0.
    """
    lens = _check_lengths(lengths)
    if token_budget is not None:
        _check_positive("token_budget", token_budget)
    real = 0
    processed = 0
    for b, batch in enumerate(batches):
        for index in batch:
            if not 0 <= index < len(lens):
                raise ValueError(f"micro-batch {b} holds index {index}, outside 0..{len(lens) - 1}")
        batch_lens = [lens[i] for i in batch]
        tokens = sum(batch_lens)
        if token_budget is not None and tokens > token_budget:
            raise ValueError(f"micro-batch {b} holds {tokens} tokens, over the token budget {token_budget}")
        real += tokens
        if token_budget is not None:
            processed += token_budget
        elif batch_lens:
            processed += len(batch_lens) * max(batch_lens)
    return 1.0 if processed == 0 else real / processed


PACKERS: Mapping[str, Packer] = MappingProxyType({"ffd": pack_micro_batches})


def get_packer(name: str) -> Packer:
    """The packer registered under ``name`` (see ``PACKERS``)."""
    try:
        return PACKERS[name]
    except KeyError:
        raise ValueError(f"unknown packer {name!r}; allowed: {sorted(PACKERS)}") from None


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    values: list[int] = []
    for index, raw in enumerate(lengths):
        try:
            value = operator.index(raw)
        except TypeError:
            raise TypeError(f"lengths[{index}] must be an integer, got {raw!r}") from None
        if value < 1:
            raise ValueError(f"lengths[{index}] must be >= 1 token, got {value}")
        values.append(value)
    return values


def _check_positive(name: str, value: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be >= 1, got {number}")
    return number


def _check_packing(lengths: list[int], batches: list[list[int]], budget: int) -> None:
    placed = sorted(i for batch in batches for i in batch)
    if placed != list(range(len(lengths))):
        raise RuntimeError(f"packing bug: indices placed {placed} are not each of 0..{len(lengths) - 1} once")
    for b, batch in enumerate(batches):
        tokens = sum(lengths[i] for i in batch)
        if not batch or tokens > budget:
            raise RuntimeError(f"packing bug: micro-batch {b} has {len(batch)} sequences, {tokens} tokens > {budget}")
