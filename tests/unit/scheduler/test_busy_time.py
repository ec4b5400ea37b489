"""Generation busy time is the union of the samples' in-flight intervals, not their sum:
time counts while at least one sample is in flight, once however many are."""

from __future__ import annotations

import pytest

from asyncrl.tasks.system.busy_time import BusyTime


class FakeClock:
    """Seconds set by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_work_counts_once_and_gaps_not_at_all() -> None:
    clock = FakeClock()
    busy = BusyTime(clock)
    busy.start()  # a: [100, 104]
    clock.now = 102.0
    busy.start()  # b: [102, 107], overlaps a
    clock.now = 104.0
    busy.finish()
    clock.now = 107.0
    busy.finish()
    clock.now = 110.0  # idle [107, 110]
    busy.start()  # c: [110, 111]
    clock.now = 111.0
    busy.finish()
    clock.now = 120.0
    assert busy.busy_s() == pytest.approx(7.0 + 1.0)  # the union; the sum would be 4 + 5 + 1 = 10
    assert busy.in_flight == 0


def test_an_open_span_counts_up_to_now() -> None:
    clock = FakeClock()
    busy = BusyTime(clock)
    assert busy.busy_s() == 0.0
    busy.start()
    clock.now = 103.5
    assert busy.busy_s() == pytest.approx(3.5) and busy.in_flight == 1
    clock.now = 105.0
    assert busy.busy_s() == pytest.approx(5.0)


def test_running_finishes_the_work_however_it_ends() -> None:
    clock = FakeClock()
    busy = BusyTime(clock)
    with pytest.raises(ConnectionError), busy.running():
        clock.now = 102.0
        raise ConnectionError("server went away")
    clock.now = 150.0
    assert busy.busy_s() == pytest.approx(2.0) and busy.in_flight == 0


def test_a_finish_without_a_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="without a matching start"):
        BusyTime(FakeClock()).finish()
