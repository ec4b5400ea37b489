"""Adaptive staleness: the gate's effective bound e follows the off-policy drift the trainer
measures, never above the configured eta (``rollout.adaptive_staleness``).

Drift of step t at the current e (figures of :mod:`asyncrl.tasks.algo.mismatch`): over
budget when D_t(e) = max_{s in 1..e} q99_t(s) > ``max_behav_weight_p99`` (q99_t(s): the
0.99 quantile of the raw behaviour weights w = pi_prox / pi_behav of tokens of staleness s)
or ESS_t = (sum w)^2 / (n sum w^2) < ``min_ess``. The rule, once per trained step:

    e <- max(min_eta, floor(e / 2))     if step t is over budget
    e <- min(eta, e + 1)                after ``recover_steps`` steps in a row under it

A step without figures counts as under budget. The bound still holds: the gate admits group
k only while floor(k / B) <= i + e and e <= eta at every admission, so no trained sample is
staler than eta. Why these choices, logging and resume: ``docs/internals/algo.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any
from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig



LOG = logging.getLogger("asyncrl.scheduler.adaptive")
P99_PREFIX = "mismatch/behav_weight_p99/staleness_"
ESS_METRIC = "mismatch/ess"


@dataclass(frozen=True)
class DriftReading:
    """What step ``step`` measured against the bound ``eta`` it was judged at."""

    step: int
    eta: int
    behav_weight_p99: float | None
    """D_t(e): max of the per-staleness 0.99 quantiles over staleness 1..e (None: no such tokens)."""
    staleness: int | None
    """The staleness whose quantile is D_t(e)."""
    ess: float | None
    reason: str
    """Which budget was crossed ("" when none)."""

    @property
    def over_budget(self) -> bool:
        return bool(self.reason)


def read_drift(step: int, metrics: Mapping[str, Any], eta: int, config: AdaptiveStalenessConfig) -> DriftReading:
    """Judge one step's mismatch figures at the effective bound ``eta`` (module docstring)."""
    tail, worst = None, None
    for name, value in metrics.items():
        if not name.startswith(P99_PREFIX):
            continue
        suffix = name[len(P99_PREFIX) :]
        if not suffix.isdigit() or not 1 <= int(suffix) <= eta or not _finite(value):
            continue
        if tail is None or float(value) > tail:
            tail, worst = float(value), int(suffix)
    ess_value = metrics.get(ESS_METRIC)
    ess = float(ess_value) if _finite(ess_value) else None
    reasons = []
    if config.max_behav_weight_p99 is not None and tail is not None and tail > config.max_behav_weight_p99:
        reasons.append(f"behaviour-weight p99 {tail:.4g} at staleness {worst} > {config.max_behav_weight_p99:g}")
    if config.min_ess is not None and ess is not None and ess < config.min_ess:
        reasons.append(f"ESS {ess:.4g} < {config.min_ess:g}")
    return DriftReading(step, eta, tail, worst, ess, "; ".join(reasons))


@dataclass(frozen=True)
class EtaChange:
    """One move of the effective bound, made after reading ``reading``."""

    version: int
    before: int
    after: int
    reading: DriftReading

    def message(self) -> str:
        why = self.reading.reason or f"under budget through step {self.reading.step}"
        direction = "lowered" if self.after < self.before else "raised"
        return f"effective staleness bound {direction} {self.before} -> {self.after} at version {self.version} ({why})"


@dataclass(frozen=True)
class AdaptiveState:
    """The part of :class:`AdaptiveEta` a restarted scheduler goes on from."""

    eta: int
    version: int
    """The last version whose figures were read."""
    under: int
    """Steps in a row under budget since the last change."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> AdaptiveState:  # noqa: ANN401
        if not isinstance(raw, dict) or set(raw) != {"eta", "version", "under"}:
            raise ValueError(f"adaptive staleness state must be an object with eta, version, under; got {raw!r}")
        if not all(isinstance(raw[k], int) and not isinstance(raw[k], bool) and raw[k] >= 0 for k in raw):
            raise ValueError(f"adaptive staleness state: eta, version and under must be ints >= 0, got {raw!r}")
        return cls(raw["eta"], raw["version"], raw["under"])


class AdaptiveEta:
    """The effective bound e of one run (module docstring). Fed each new version's step
    figures in version order by the rollout controller, which applies :attr:`eta` to its gate."""

    def __init__(self, config: AdaptiveStalenessConfig, eta_limit: int, state: AdaptiveState | None = None) -> None:
        if eta_limit < 0:
            raise ValueError(f"eta_limit must be >= 0, got {eta_limit}")
        self.config = config
        self.eta_limit = eta_limit
        self.floor = min(config.min_eta, eta_limit)
        self.eta = eta_limit
        self.version = 0
        self.under = 0
        if state is not None:
            # a restart with a smaller configured eta (or a larger min_eta) clamps the saved e
            self.eta = max(self.floor, min(state.eta, eta_limit))
            self.version, self.under = state.version, state.under
        self.changes: list[EtaChange] = []
        self.readings = 0
        self.lowest = self.eta

    def state(self) -> AdaptiveState:
        return AdaptiveState(self.eta, self.version, self.under)

    def observe(self, version: int, step: int, metrics: Mapping[str, Any]) -> EtaChange | None:
        """Read the figures of the step that produced ``version``; the change it made, if any.
        Versions at or before the last one read are ignored (a restart reads on from its state)."""
        if version <= self.version:
            return None
        self.version = version
        reading = read_drift(step, metrics, self.eta, self.config)
        self.readings += 1
        before = self.eta
        if reading.over_budget:
            self.under = 0
            self.eta = max(self.floor, before // 2)
        else:
            self.under += 1
            if self.under >= self.config.recover_steps and before < self.eta_limit:
                self.eta = before + 1
                self.under = 0
        if self.eta == before:
            return None
        change = EtaChange(version, before, self.eta, reading)
        self.changes.append(change)
        self.lowest = min(self.lowest, self.eta)
        if change.after < before:
            LOG.warning("%s", change.message())
        else:
            LOG.info("%s", change.message())
        return change

    def summary(self) -> dict[str, float]:
        """``effective_eta`` (now), ``effective_eta_min`` (lowest reached), ``eta_changes``,
        ``drift_readings`` (steps read)."""
        return {
            "effective_eta": float(self.eta),
            "effective_eta_min": float(self.lowest),
            "eta_changes": float(len(self.changes)),
            "drift_readings": float(self.readings),
        }


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
