"""The recorder's poller: its polls run on their own thread, so a signal raised in the main
thread (a cancelled flow run's TerminationSignal) does not cut a write short."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from asyncrl.tasks.tracking.lineage_recorder import BackgroundPoller


class Interrupted(BaseException):
    """Stands for Prefect's TerminationSignal (a BaseException raised by a signal handler)."""


def test_polls_until_finished_then_once_more() -> None:
    calls: list[float] = []
    poller = BackgroundPoller(lambda: calls.append(time.monotonic()), interval_s=0.05)
    time.sleep(0.3)
    before = len(calls)
    poller.finish()
    assert before >= 3 and before + 1 <= len(calls) <= before + 2  # a poll may have been under way


def test_an_error_of_a_poll_reaches_the_caller() -> None:
    def failing() -> None:
        raise OSError("store unreachable")

    poller = BackgroundPoller(failing, interval_s=0.05)
    time.sleep(0.2)
    with pytest.raises(OSError, match="store unreachable"):
        poller.check()


def test_a_signal_in_the_main_thread_does_not_cut_a_poll_short() -> None:
    in_write, written = threading.Event(), threading.Event()

    def slow_write() -> None:
        if written.is_set():
            return
        in_write.set()
        time.sleep(0.5)  # a write in flight when the signal comes
        written.set()

    def on_alarm(signum: int, frame: object) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        poller = BackgroundPoller(slow_write, interval_s=0.05)
        assert in_write.wait(5.0)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupted):
            time.sleep(5.0)  # the main thread's wait, interrupted
        poller.stop()
        assert written.wait(5.0)  # the write finished all the same
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
