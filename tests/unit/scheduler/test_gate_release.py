"""The gate's count with dynamic filtering: released admissions no longer count, so Nr
counts only the groups that may be trained."""

from __future__ import annotations

import pytest

from asyncrl.tasks.algo.staleness_gate import StalenessGate


class Version:
    def __init__(self, version: int = 0) -> None:
        self.version = version

    def current_version(self) -> int:
        return self.version


def test_released_groups_free_their_admissions() -> None:
    gate = StalenessGate(batch_groups=2, eta=1, version_source=Version(0))
    assert [gate.try_admit() for _ in range(5)] == [True] * 4 + [False]  # (0 + 1 + 1) * 2
    gate.release()  # one of the four is filtered out: Nr counts three
    assert gate.try_admit() and not gate.try_admit()
    stats = gate.stats()
    assert (stats.admitted, stats.released, stats.capacity) == (5, 1, 4)


def test_the_rule_holds_for_the_kept_groups_whatever_is_filtered() -> None:
    """Admit and filter at random-looking points; the j-th kept group must have been admitted
    at a version i with floor(j / B) <= i + eta (the proof in the gate's docstring)."""
    b, eta = 3, 1
    source = Version(0)
    gate = StalenessGate(batch_groups=b, eta=eta, version_source=source)
    admitted_at: list[int] = []
    kept: list[int] = []
    for tick in range(200):
        if tick % 7 == 6:
            source.version += 1
        if gate.try_admit():
            admitted_at.append(source.version)
            k = len(admitted_at) - 1
            if k % 4 == 1 or k % 5 == 2:  # finishes as filtered at once
                gate.release()
            else:
                kept.append(k)
    assert len(kept) > 10
    for j, k in enumerate(kept):
        assert j // b <= admitted_at[k] + eta, (j, k, admitted_at[k])


def test_no_more_releases_than_admissions() -> None:
    gate = StalenessGate(batch_groups=2, eta=0, version_source=Version(0))
    assert gate.try_admit()
    with pytest.raises(ValueError, match="cannot release 2 more groups: 0 of 1 admitted are released"):
        gate.release(2)
    with pytest.raises(ValueError, match="release count must be an int >= 0"):
        gate.release(-1)
