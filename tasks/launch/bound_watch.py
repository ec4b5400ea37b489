"""The run's view of adaptive staleness: the scheduler's effective bound, read from the run
root while the run goes on, reported where users look.

The scheduler (perhaps on another machine) moves the bound and saves it in its state file
(:mod:`asyncrl.tasks.algo.adaptive_eta`); the flow reads that file every few seconds,
and on each change logs a run warning or note (lowered / raised, at which version) and the
MLflow metric ``scheduler/effective_eta`` at step = the version the scheduler had read. The
state file is one small object: reading it costs the same at step 10 and step 10,000.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.scheduler.gate_state import load_adaptive_state

LOG = logging.getLogger("asyncrl.run.staleness")
METRIC = "scheduler/effective_eta"


class EffectiveBoundWatch:
    """Calls ``log_metric(step, value)`` and logs a line for every change of the effective
    bound it sees (module docstring); :meth:`check` reads at most every ``every_s`` seconds."""

    def __init__(
        self,
        root: RunRoot,
        eta: int,
        log_metric: Callable[[int, float], None],
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = LOG,
        every_s: float = 5.0,
    ) -> None:
        self.root = root
        self.eta = eta
        self.log_metric = log_metric
        self.logger = logger
        self.every_s = every_s
        self.changes: list[tuple[int, int, int]] = []
        """(version, before, after) of each change seen."""
        self._next_read = 0.0

    def check(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_read:
            return
        self._next_read = now + self.every_s
        try:
            state = load_adaptive_state(self.root)
        except (OSError, ValueError) as exc:  # a report, not the run: say so and go on
            self.logger.warning("could not read the scheduler's effective staleness bound: %s", exc)
            return
        if state is None or state.eta == self.eta:
            return
        before, self.eta = self.eta, state.eta
        self.changes.append((state.version, before, state.eta))
        self.log_metric(state.version, float(state.eta))
        move = "lowered" if state.eta < before else "raised"
        self.logger.log(
            logging.WARNING if state.eta < before else logging.INFO,
            "adaptive staleness: effective bound %s %d -> %d (scheduler at version %d; see the scheduler log for the drift figures)",
            move, before, state.eta, state.version,
        )  # fmt: skip
