"""The train/inference mismatch canary: a run warning and a Prefect event
(``asyncrl.mismatch.canary``) when a step's mismatch figures cross their thresholds.

The figures (:mod:`asyncrl.tasks.algo.mismatch`) compare, over the tokens sampled by the
trainer's current weights, the trainer's log-probs with those the rollout server reported.
With correct weight sync they differ only by the numerics of the two engines; a server that
is labelled with a new version but holds other weights (a weight-sync bug, a half-loaded
checkpoint) moves them by the size of a policy change or more.

The check is a plain function (:func:`mismatch_crossings`); :class:`MismatchCanary` keeps which
figures are over their threshold so that each crossing fires once (the step a figure goes
over), not every step it stays over: it re-arms when the figure is back at or under.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from asyncrl.configs.canary import MismatchCanaryConfig


LOG = logging.getLogger("asyncrl.canary")
EVENT = "asyncrl.mismatch.canary"
TOKENS_METRIC = "mismatch/current_version_tokens"


def mismatch_crossings(
    metrics: Mapping[str, float], config: MismatchCanaryConfig
) -> dict[str, tuple[float, float]] | None:
    """The figures of one step's ``metrics`` above their threshold: metric -> (value,
    threshold); None when the step cannot be judged (no mismatch figures, or fewer than
    ``min_tokens`` current-version tokens). A missing or non-finite figure never crosses."""
    tokens = metrics.get(TOKENS_METRIC)
    if tokens is None or not tokens >= config.min_tokens:
        return None
    over = {}
    for name, threshold in config.thresholds().items():
        value = metrics.get(name)
        if value is not None and value > threshold:  # NaN compares False
            over[name] = (float(value), threshold)
    return over


@dataclass(frozen=True)
class CanaryAlarm:
    """A step at which mismatch figures crossed their thresholds."""

    step: int
    crossed: dict[str, tuple[float, float]]
    """Metric -> (value, threshold), the figures that went over at this step."""
    tokens: int
    """Current-version tokens the figures were measured on."""

    def message(self) -> str:
        figures = ", ".join(f"{name} = {value:.4g} > {limit:.4g}" for name, (value, limit) in self.crossed.items())
        return (
            f"train/inference mismatch at step {self.step}: {figures} over {self.tokens} tokens sampled by the "
            "trainer's current weights; the rollout servers may not hold the weights of the version they report "
            "(a weight-sync bug?)"
        )


def log_alarm(alarm: CanaryAlarm) -> None:
    """The default reaction outside Prefect: a warning log."""
    LOG.warning("%s", alarm.message())


class MismatchCanary:
    """Watches the run's step metrics; calls ``on_alarm`` once per crossing (module docstring)."""

    def __init__(self, config: MismatchCanaryConfig, on_alarm: Callable[[CanaryAlarm], None] = log_alarm) -> None:
        self.config = config
        self.on_alarm = on_alarm
        self.over: set[str] = set()
        self.last_step = 0
        self.alarms: list[CanaryAlarm] = []

    def observe(self, step: int, metrics: Mapping[str, float]) -> CanaryAlarm | None:
        """Check one step (in step order); the alarm it raised, if any."""
        self.last_step = max(self.last_step, step)
        crossed = mismatch_crossings(metrics, self.config)
        if crossed is None:
            return None
        fresh = {name: figure for name, figure in crossed.items() if name not in self.over}
        self.over = set(crossed)
        if not fresh:
            return None
        alarm = CanaryAlarm(step, fresh, int(metrics[TOKENS_METRIC]))
        self.alarms.append(alarm)
        self.on_alarm(alarm)
        return alarm

    def observe_new(self, metrics_by_step: Mapping[int, Mapping[str, float]]) -> list[CanaryAlarm]:
        """Check the steps after the last one checked, in order. ``metrics_by_step`` may be
        filled by another thread (the recorder's poller): it is copied first, in one C-level
        operation, so it cannot change size under the iteration."""
        snapshot = dict(metrics_by_step)
        alarms = []
        for step in sorted(s for s in snapshot if s > self.last_step):
            alarm = self.observe(step, snapshot[step])
            if alarm is not None:
                alarms.append(alarm)
        return alarms
