"""What asynchrony bought a run: the busy times of generation and training over the RL
phase's wall time, as plain functions of measured numbers (``docs/algorithm.md``, Measures).

    overlap factor = (generation busy + training busy) / RL wall time

1.0 is running the two in turn, 2.0 a perfect overlap of two equal halves; below 1.0 the
phase had time with neither side busy. The generation busy time is measured
by the scheduler (``generation_busy_s`` of its cycle figures,
:class:`~asyncrl.tasks.system.busy_time.BusyTime`); the others come from the trainer's
step metrics here.
"""

from __future__ import annotations

from collections.abc import Mapping

TIME_KEY = "time"
"""Unix time at which a step's metrics were written (after its weights were published)."""
STEP_TIME_KEY = "step_time_s"
STEP_PART_KEYS = ("proximal_time_s", "update_time_s", "publish_time_s", "checkpoint_time_s")
"""The measured parts of a step, for step metrics without ``step_time_s``."""


def step_busy_s(metrics: Mapping[str, float]) -> float:
    """The seconds the trainer spent on one step's work: its ``step_time_s``, the whole step
    from the ledger record to the end (batch preparation, the proximal pass
    ``proximal_time_s``, the updates ``update_time_s``, the weight publish
    ``publish_time_s``, a checkpoint ``checkpoint_time_s`` where one is due), without the
    wait for the step's data; for metrics without it, the sum of those parts present."""
    if STEP_TIME_KEY in metrics:
        return float(metrics[STEP_TIME_KEY])
    return float(sum(float(metrics[key]) for key in STEP_PART_KEYS if key in metrics))


def phase_steps(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> dict[int, Mapping[str, float]]:
    """The steps trained in the RL phase that began at ``ready_at`` (Unix time at which every
    rollout server was ready): those whose metrics ``time`` >= ready_at, so a resumed run's
    earlier steps are not this phase's. A step without ``time`` (figures carried by a remote
    trainer's lineage) cannot be placed and is left out; none when ``ready_at`` <= 0 (the
    phase never began)."""
    if ready_at <= 0:
        return {}
    return {step: m for step, m in step_metrics.items() if TIME_KEY in m and float(m[TIME_KEY]) >= ready_at}


def training_busy_s(steps: Mapping[int, Mapping[str, float]]) -> float:
    """T_train = sum over ``steps`` of :func:`step_busy_s` (0.0 without steps)."""
    return float(sum(step_busy_s(m) for m in steps.values()))


def rl_phase_wall_s(steps: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """W = max over ``steps`` of their metrics ``time`` - ``ready_at``: from every rollout
    server ready (their start-up is not counted) to the last step's metrics; 0.0 without
    steps or without a start (``ready_at`` <= 0)."""
    times = [float(m[TIME_KEY]) for m in steps.values() if TIME_KEY in m]
    if not times or ready_at <= 0:
        return 0.0
    return max(0.0, max(times) - ready_at)


def overlap_figures(generation_busy_s: float, training_busy_s: float, wall_s: float) -> dict[str, float]:
    """The run's overlap figures: ``generation_busy_s`` (T_gen, seconds at least one sample
    was generating), ``training_busy_s`` (T_train, seconds the trainer worked on steps),
    ``rl_wall_s`` (W) and

        overlap_factor = (T_gen + T_train) / W

    1.0 is running the two in turn, 2.0 a perfect overlap of two equal halves; 0.0 when
    W = 0 (nothing was measured: no step in the phase). A negative input raises ValueError."""
    for name, value in (("generation_busy_s", generation_busy_s), ("training_busy_s", training_busy_s),
                        ("wall_s", wall_s)):  # fmt: skip
        if value < 0:
            raise ValueError(f"overlap_figures: {name} must be >= 0, got {value}")
    return {
        "generation_busy_s": float(generation_busy_s),
        "training_busy_s": float(training_busy_s),
        "rl_wall_s": float(wall_s),
        "overlap_factor": (generation_busy_s + training_busy_s) / wall_s if wall_s > 0 else 0.0,
    }
