"""The benches' sweep settings (ablation, e2e, time to accuracy) checked one way: the
comma-separated lists their command lines take, and checks whose errors name the setting."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from asyncrl.tasks.inference.samples import INTERRUPT_MODES


def parse_int_list(text: str) -> tuple[int, ...]:
    """``"0,2,4"`` -> ``(0, 2, 4)``; anything else is an argparse error that quotes the text."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def check_distinct_ints(name: str, values: Sequence[int], minimum: int, *, allow_empty: bool = False, why: str = "") -> None:
    """``values`` are distinct ints (not bools) >= ``minimum``, and not empty unless allowed."""
    if (not values and not allow_empty) or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise ValueError(f"{name}: must be ints >= {minimum}{why}, got {values!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: a value repeats: {values}")


def check_includes_sync(name: str, etas: Sequence[int], role: str) -> None:
    """eta 0, the synchronous run, is in ``etas``; ``role`` says what it is compared for."""
    if 0 not in etas:
        raise ValueError(f"{name}: must include 0, {role}; got {etas}")


def check_modes(name: str, modes: Sequence[str]) -> None:
    """``modes`` are distinct interrupt modes, at least one."""
    if not modes or any(m not in INTERRUPT_MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"{name}: must be distinct values of {list(INTERRUPT_MODES)}, got {modes!r}")
