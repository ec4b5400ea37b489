"""The train/inference mismatch canary: a run warning and a Prefect event
(``asyncrl.mismatch.canary``) when a step's mismatch figures cross their thresholds.

The figures (:mod:`asyncrl.tasks.trainer.mismatch`) compare, over the tokens sampled by the
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

from pydantic import Field

from asyncrl.configs.base import StrictModel

LOG = logging.getLogger("asyncrl.canary")
EVENT = "asyncrl.mismatch.canary"
TOKENS_METRIC = "mismatch/current_version_tokens"


class MismatchCanaryConfig(StrictModel):
    """Thresholds of the mismatch canary (``tracking.mismatch_canary``); None turns one off.

    On by default, with thresholds about ten times what a healthy run shows: float32 on CPU
    (this stack's default) differs by ~1e-6 in log-prob, bf16 vLLM against a bf16/fp32
    trainer by ~1e-3 to 1e-2 in mean |log-prob difference| and ~1e-4 to 1e-3 in k3 KL, with
    well under 1% of ratios outside [0.5, 2]. Serving weights other than the trainer's moves
    these by a policy change: far above the thresholds for a server that never loaded new
    weights after a few updates or loaded the wrong ones. A server exactly one small update
    behind can stay under them; lower the thresholds to watch for that."""

    abs_logp_diff_mean: float | None = Field(0.1, gt=0.0)
    """Alarm when ``mismatch/abs_logp_diff_mean`` (mean |log p_trainer - log p_behav|) exceeds this."""
    k3_kl: float | None = Field(0.02, gt=0.0)
    """Alarm when ``mismatch/k3_kl`` (k3 estimate of KL(pi_behav || pi_trainer), nats per token) exceeds this."""
    ratio_outside_frac: float | None = Field(0.05, gt=0.0, le=1.0)
    """Alarm when ``mismatch/ratio_outside_frac`` (share of ratios p_trainer / p_behav outside
    [0.5, 2]) exceeds this."""
    min_tokens: int = Field(32, ge=1)
    """Steps with fewer current-version tokens than this are not checked (too few to tell)."""

    def thresholds(self) -> dict[str, float]:
        """Metric name -> threshold, for the figures that are on."""
        return {
            f"mismatch/{name}": value
            for name, value in (
                ("abs_logp_diff_mean", self.abs_logp_diff_mean),
                ("k3_kl", self.k3_kl),
                ("ratio_outside_frac", self.ratio_outside_frac),
            )
            if value is not None
        }


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


def prefect_alarm(run_name: str) -> Callable[[CanaryAlarm], None]:
    """The reaction inside a flow run: a warning in the run's log and a Prefect event
    ``asyncrl.mismatch.canary`` on resource ``asyncrl.run.<run name>`` (for automations)."""

    def report(alarm: CanaryAlarm) -> None:
        from prefect import get_run_logger
        from prefect.events import emit_event

        get_run_logger().warning("%s", alarm.message())
        emit_event(
            event=EVENT,
            resource={"prefect.resource.id": f"asyncrl.run.{run_name}", "prefect.resource.name": run_name},
            payload={
                "step": alarm.step,
                "tokens": alarm.tokens,
                "crossed": {name: {"value": v, "threshold": t} for name, (v, t) in alarm.crossed.items()},
            },
        )

    return report


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
