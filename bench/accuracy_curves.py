"""Time-to-accuracy figures, as plain functions of measured numbers: each published version's
wall time, the seed-mean curve of held-out pass@1, its smoothing, the target, the first time a
curve reaches it and the value of a curve at a given time. Formulas in the docstrings of the
functions that compute them; :mod:`asyncrl.bench.time_to_accuracy` runs the arms.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CurvePoint:
    """One evaluated version of an arm, over its seeds: the mean and spread of its wall time
    and of its held-out pass@1."""

    version: int
    wall_s: float
    pass_at_1: float
    pass_at_1_std: float = 0.0
    wall_s_std: float = 0.0


def version_wall_times(
    step_metrics: Mapping[int, Mapping[str, float]], ready_at: float, start_version: int
) -> dict[int, float]:
    """Seconds since the RL phase began at which each version was published:

        wall(start_version) = 0;  wall(start_version + s) = time_s - ready_at

    with ``time_s`` step s's metrics time (written once its weights are published) and
    ``ready_at`` the moment every rollout server was ready (server start-up is not counted)."""
    if not ready_at:
        raise ValueError("version_wall_times: the run recorded no ready time (no rollout server became ready)")
    walls = {start_version: 0.0}
    for step, metrics in step_metrics.items():
        walls[start_version + step] = float(metrics["time"]) - ready_at
    return walls


def seed_mean_curve(per_seed: Sequence[Mapping[int, tuple[float, float]]]) -> list[CurvePoint]:
    """The arm's curve over seeds: for every version evaluated in every seed (version ->
    (wall s, pass@1) per seed), the mean and the standard deviation over seeds of both
    (standard deviation 0 with one seed). Versions line up across seeds: version v is
    step v - start in every seed, so the mean is taken at equal steps."""
    if not per_seed:
        raise ValueError("seed_mean_curve: no seed")
    versions = sorted(set.intersection(*(set(curve) for curve in per_seed)))
    points = []
    for version in versions:
        walls = [curve[version][0] for curve in per_seed]
        values = [curve[version][1] for curve in per_seed]
        points.append(CurvePoint(
            version=version, wall_s=statistics.fmean(walls), pass_at_1=statistics.fmean(values),
            pass_at_1_std=statistics.stdev(values) if len(values) > 1 else 0.0,
            wall_s_std=statistics.stdev(walls) if len(walls) > 1 else 0.0,
        ))  # fmt: skip
    return points


def centred_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred moving mean over ``window`` (odd) evaluated points, shorter at the ends:

        m_i = mean(values[max(0, i - h) .. min(n - 1, i + h)]),  h = (window - 1) / 2

    It damps the evaluation's sampling noise without shifting the curve in time."""
    if window < 1 or window % 2 == 0:
        raise ValueError(f"centred_mean: window must be an odd number >= 1, got {window}")
    half = (window - 1) // 2
    return [statistics.fmean(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def accuracy_target(start_pass_at_1: float, sync_final_pass_at_1: float, fraction: float) -> float:
    """The pass@1 every arm must reach, the synchronous run included:

        target = start + fraction * (sync_final - start)

    with ``start`` the shared warm start's pass@1 and ``sync_final`` the synchronous run's
    smoothed final pass@1 (the issue's fraction: 0.9)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"accuracy_target: fraction must be in (0, 1], got {fraction}")
    return start_pass_at_1 + fraction * (sync_final_pass_at_1 - start_pass_at_1)


def first_crossing(times: Sequence[float], values: Sequence[float], target: float) -> float | None:
    """The first time the curve (times ascending) reaches ``target``, linearly interpolated
    between the last point below it and the first at or above it:

        t* = t_(i-1) + (target - v_(i-1)) / (v_i - v_(i-1)) * (t_i - t_(i-1))

    ``times[0]`` when the first point is already there; None when no point reaches it."""
    if len(times) != len(values):
        raise ValueError(f"first_crossing: {len(times)} times for {len(values)} values")
    for i, (time, value) in enumerate(zip(times, values, strict=True)):
        if value >= target:
            if i == 0:
                return float(time)
            t0, v0 = times[i - 1], values[i - 1]
            return float(t0 + (target - v0) / (value - v0) * (time - t0))
    return None


def value_at(times: Sequence[float], values: Sequence[float], time: float) -> float | None:
    """The curve's value at ``time``, linearly interpolated between the evaluated points
    around it; None outside [times[0], times[-1]] (a curve is not extrapolated)."""
    if not times or time < times[0] or time > times[-1]:
        return None
    for i in range(1, len(times)):
        if time <= times[i]:
            t0, t1 = times[i - 1], times[i]
            share = 0.0 if t1 == t0 else (time - t0) / (t1 - t0)
            return float(values[i - 1] + share * (values[i] - values[i - 1]))
    return float(values[-1])


def generation_share(overlaps: Sequence[Mapping[str, float]]) -> float | None:
    """The share of a synchronous step that is generation, mean over runs:

        share = T_gen / (T_gen + T_train)

    with T_gen the run's generation busy time and T_train its training busy time (at eta 0
    the two alternate, so this is generation's part of the step's wall time); None without a
    run that measured both."""
    shares = [
        o["generation_busy_s"] / (o["generation_busy_s"] + o["training_busy_s"])
        for o in overlaps
        if o.get("generation_busy_s", 0.0) + o.get("training_busy_s", 0.0) > 0
    ]
    return statistics.fmean(shares) if shares else None
