"""Busy time of overlapping work: the seconds during which at least one piece of work was in
flight (the union of the pieces' intervals, not the sum of their lengths), counted as the
work starts and ends, so nothing is kept per piece."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class BusyTime:
    """Counts the pieces of work in flight and accumulates the time while the count is
    above zero: with n(t) the pieces in flight at time t,

        busy_s = integral of [n(t) > 0] dt = length of the union of the pieces' intervals

    (two pieces that run side by side count once; a gap with none in flight not at all).
    Time comes from the injected ``clock`` (seconds, never going back). A piece's start and
    end go through :meth:`start` and :meth:`finish` (or :meth:`running`), under one lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        """When the count last went from 0 to 1 (meaningful while it is above 0)."""
        self._closed_s = 0.0
        """Busy seconds of the spans already ended (the count back at 0)."""

    def start(self) -> None:
        """A piece of work began."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = self._clock()
            self._in_flight += 1

    def finish(self) -> None:
        """A piece of work ended (done, failed or cancelled)."""
        with self._lock:
            if self._in_flight == 0:
                raise RuntimeError("BusyTime.finish without a matching start")
            self._in_flight -= 1
            if self._in_flight == 0:
                self._closed_s += self._clock() - self._busy_since

    @contextmanager
    def running(self) -> Iterator[None]:
        """One piece of work in flight for the ``with`` block, however it ends."""
        self.start()
        try:
            yield
        finally:
            self.finish()

    @property
    def in_flight(self) -> int:
        """Pieces of work in flight now."""
        with self._lock:
            return self._in_flight

    def busy_s(self) -> float:
        """The busy seconds so far: the ended spans plus, while work is in flight, the open
        span up to now."""
        with self._lock:
            open_s = self._clock() - self._busy_since if self._in_flight else 0.0
            return self._closed_s + open_s
