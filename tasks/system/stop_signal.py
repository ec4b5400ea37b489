"""SIGTERM/SIGINT as an event a long-lived process polls: the scheduler and the evaluator
finish their current step and exit 0 when it is set."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)


class StopSignal:
    """Set once by SIGTERM/SIGINT; the handlers are installed by :meth:`install`."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            logger.info("received %s: stopping", signal.Signals(signum).name)
            self.event.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
