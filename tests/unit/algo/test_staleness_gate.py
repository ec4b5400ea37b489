from __future__ import annotations

import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.tasks.algo.staleness_gate import GateState, StalenessGate, max_admissions


class VersionHolder:
    """The trainer's side of the edge: a published version number."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def current_version(self) -> int:
        return self.version


def drain(gate: StalenessGate) -> int:
    """Admit until the gate refuses; return how many were admitted."""
    count = 0
    while gate.try_admit():
        count += 1
    return count


@settings(max_examples=100, deadline=None)
@given(
    batch_groups=st.integers(1, 8),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20)), min_size=1, max_size=30),
)
def test_eta_zero_never_runs_ahead_of_version(batch_groups: int, steps: list[tuple[int, int]]) -> None:
    holder = VersionHolder()
    gate = StalenessGate(batch_groups, 0, holder)
    for bump, attempts in steps:
        holder.version += bump
        for _ in range(attempts):
            gate.try_admit()
            assert gate.stats().admitted <= (holder.version + 1) * batch_groups


@settings(max_examples=100, deadline=None)
@given(batch_groups=st.integers(1, 16), eta=st.integers(0, 4), versions=st.integers(1, 10))
def test_each_version_step_opens_exactly_b(batch_groups: int, eta: int, versions: int) -> None:
    holder = VersionHolder()
    gate = StalenessGate(batch_groups, eta, holder)
    assert drain(gate) == (eta + 1) * batch_groups
    for _ in range(versions):
        holder.version += 1
        assert drain(gate) == batch_groups


@settings(max_examples=100, deadline=None)
@given(
    batch_groups=st.integers(1, 16),
    eta=st.integers(0, 5),
    version_path=st.lists(st.integers(0, 3), min_size=1, max_size=10),
)
def test_exhausted_gate_holds_exactly_capacity(batch_groups: int, eta: int, version_path: list[int]) -> None:
    holder = VersionHolder()
    gate = StalenessGate(batch_groups, eta, holder)
    for bump in version_path:
        holder.version += bump
        drain(gate)
        stats = gate.stats()
        assert stats.admitted == (holder.version + eta + 1) * batch_groups == stats.capacity
        assert not gate.try_admit()


@settings(max_examples=200, deadline=None)
@given(
    batch_groups=st.integers(1, 10),
    eta=st.integers(0, 5),
    version=st.integers(0, 20),
    nr=st.integers(1, 400),
)
def test_capacity_matches_floor_rule(batch_groups: int, eta: int, version: int, nr: int) -> None:
    # Nr-th admission is allowed iff floor((Nr - 1) / B) <= i + eta.
    allowed = (nr - 1) // batch_groups <= version + eta
    assert allowed == (nr <= max_admissions(version, batch_groups, eta))


def test_concurrent_threads_never_exceed_capacity() -> None:
    batch_groups, eta = 7, 2
    holder = VersionHolder()
    gate = StalenessGate(batch_groups, eta, holder)
    admitted_per_thread = [0] * 8
    overshoot: list[int] = []
    start = threading.Barrier(len(admitted_per_thread) + 1)
    stop = threading.Event()

    def hammer(slot: int) -> None:
        start.wait()
        while not stop.is_set():
            if gate.try_admit():
                admitted_per_thread[slot] += 1
            stats = gate.stats()
            if stats.admitted > stats.capacity:
                overshoot.append(stats.admitted)

    threads = [threading.Thread(target=hammer, args=(slot,)) for slot in range(len(admitted_per_thread))]
    for thread in threads:
        thread.start()
    start.wait()
    for version in range(1, 6):
        time.sleep(0.02)
        holder.version = version
    deadline = time.monotonic() + 5.0
    while gate.stats().admitted < gate.capacity(5) and time.monotonic() < deadline:
        time.sleep(0.005)
    stop.set()
    for thread in threads:
        thread.join()
    assert overshoot == []
    assert sum(admitted_per_thread) == gate.stats().admitted == (5 + eta + 1) * batch_groups


class SlowVersionHolder(VersionHolder):
    """Reading the version yields the GIL, as a read from storage would."""

    def current_version(self) -> int:
        time.sleep(0)
        return self.version


def race_once(gate: StalenessGate, start: threading.Barrier, wins: list[bool]) -> None:
    start.wait()
    wins.append(gate.try_admit())


def test_check_and_increment_is_atomic_at_the_boundary() -> None:
    # Eight threads race for the last free slot, many times; with the GIL a broken
    # (unlocked) gate lets two through in about 1% of rounds, so 600 rounds catch it.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible to expose races
    try:
        for _ in range(600):
            gate = StalenessGate(1, 0, SlowVersionHolder(0))
            wins: list[bool] = []
            start = threading.Barrier(8)
            threads = [threading.Thread(target=race_once, args=(gate, start, wins)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert wins.count(True) == gate.stats().admitted == 1
    finally:
        sys.setswitchinterval(previous)


def test_wait_admit_blocks_until_version_advances() -> None:
    holder = VersionHolder()
    gate = StalenessGate(2, 0, holder)
    assert drain(gate) == 2
    assert gate.wait_admit(timeout=0.05, poll_interval=0.01) is False
    timer = threading.Timer(0.1, lambda: setattr(holder, "version", 1))
    timer.start()
    began = time.monotonic()
    assert gate.wait_admit(timeout=5.0, poll_interval=0.01) is True
    assert time.monotonic() - began >= 0.05
    timer.join()
    assert gate.stats().admitted == 3


def test_state_round_trips_through_json() -> None:
    state = GateState(admitted=37, batch_groups=4, eta=2)
    assert GateState.from_json(state.to_json()) == state


@settings(max_examples=50, deadline=None)
@given(batch_groups=st.integers(1, 8), eta=st.integers(0, 3), version=st.integers(0, 5), partial=st.integers(0, 50))
def test_restart_keeps_the_bound(batch_groups: int, eta: int, version: int, partial: int) -> None:
    holder = VersionHolder(version)
    full = StalenessGate(batch_groups, eta, holder)
    drain(full)
    restored = StalenessGate(batch_groups, eta, holder, state=GateState.from_json(full.state().to_json()))
    assert not restored.try_admit()
    assert restored.stats().admitted == full.stats().admitted

    # A partially used gate resumes with only the capacity it had left.
    part = StalenessGate(batch_groups, eta, holder)
    used = 0
    while used < partial and part.try_admit():
        used += 1
    resumed = StalenessGate(batch_groups, eta, holder, state=part.state())
    assert used + drain(resumed) == max_admissions(version, batch_groups, eta)


def test_restore_with_changed_eta_is_allowed() -> None:
    holder = VersionHolder(1)
    old = StalenessGate(3, 0, holder)
    drain(old)
    wider = StalenessGate(3, 1, holder, state=old.state())
    assert drain(wider) == 3
    assert wider.state() == GateState(admitted=9, batch_groups=3, eta=1)


def test_restore_with_changed_batch_groups_raises() -> None:
    saved = GateState(admitted=10, batch_groups=4, eta=1)
    with pytest.raises(ValueError, match=r"batch_groups=4.*batch_groups=8"):
        StalenessGate(8, 1, VersionHolder(), state=saved)


@pytest.mark.parametrize(
    ("batch_groups", "eta", "needle"), [(0, 1, "batch_groups"), (-2, 0, "batch_groups"), (4, -1, "eta")]
)
def test_bad_config_raises(batch_groups: int, eta: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        StalenessGate(batch_groups, eta, VersionHolder())
    with pytest.raises(ValueError, match=needle):
        max_admissions(0, batch_groups, eta)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"admitted": -1, "batch_groups": 2, "eta": 0}', "admitted"),
        ('{"admitted": 3, "batch_groups": 2}', "missing"),
        ('{"admitted": 3, "batch_groups": 0, "eta": 0}', "batch_groups"),
        ('{"admitted": "3", "batch_groups": 2, "eta": 0}', "admitted"),
        ("[1, 2]", "object"),
        ("not json", "valid JSON"),
    ],
)
def test_bad_state_json_raises(text: str, needle: str) -> None:
    with pytest.raises((ValueError, TypeError), match=needle):
        GateState.from_json(text)


def test_negative_version_from_source_raises() -> None:
    gate = StalenessGate(2, 0, VersionHolder(-1))
    with pytest.raises(ValueError, match="version"):
        gate.try_admit()
