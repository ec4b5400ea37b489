"""The end-to-end benchmark's figures, as plain functions of measured numbers: the RL-phase
wall time and its parts, trained and wasted tokens, staleness counts, packing, the ideal
overlap bound, each run's own limit and the comparison of every run with eta = 0. Formulas
in the docstrings of the functions that compute them.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.algo.overlap import rl_phase_wall_s, training_busy_s


if TYPE_CHECKING:
    pass


STALENESS_COUNT_PREFIX = "staleness/count_"


def solution_budgets(solution_tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """Per-prompt output budgets that follow the reference solutions' lengths L_i:

        budget_i = max(1, ceil(max_new_tokens * L_i / max_j L_j))

    so the longest solution gets ``max_new_tokens`` and the budgets keep the task's tail."""
    if not solution_tokens:
        return []
    longest = max(max(solution_tokens), 1)
    return [max(1, math.ceil(max_new_tokens * length / longest)) for length in solution_tokens]


def rl_wall_s(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """W of :func:`rl_phase_wall_s` (the last step's metrics ``time`` - ``ready_at``, every
    rollout server healthy); a run without a trained step is an error here."""
    if not step_metrics:
        raise ValueError("rl_wall_s: no step was trained")
    return rl_phase_wall_s(step_metrics, ready_at)


def trained_tokens(step_metrics: Mapping[int, Mapping[str, float]]) -> int:
    """Sum over steps of ``sequence_tokens``: prompt + output tokens of every trained sample."""
    return int(sum(m["sequence_tokens"] for m in step_metrics.values()))


def training_only_s(step_metrics: Mapping[int, Mapping[str, float]]) -> float:
    """Sum over steps of ``step_time_s`` (ledger record, RL step, weight publish): the time
    the trainer computed, without its waits for data."""
    return training_busy_s(step_metrics)


def first_batch_wait_s(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """The pipeline's fill: how long the trainer waited for its first batch,

        first_batch_wait_s = (time - step_time_s of the lowest-numbered step) - ready_at

    (a step's ``time`` is recorded when it ends, so ``time - step_time_s`` is when it began).
    At eta = 0 it is the first batch's generation; at eta > 0 the first batch is generated
    beside every group the staleness rule admitted with it."""
    if not step_metrics:
        raise ValueError("first_batch_wait_s: no step was trained")
    first = step_metrics[min(step_metrics)]
    return float(first["time"]) - float(first["step_time_s"]) - ready_at


def trainer_idle_s(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """The trainer's waits for data after its first batch, so that wall = fill + steps + idle:

        trainer_idle_s = rl_wall_s - first_batch_wait_s - training_only_s

    At eta = 0 it is the generation of every later batch; at eta > 0 the time the rollout
    did not keep up with the trainer."""
    return rl_wall_s(step_metrics, ready_at) - first_batch_wait_s(step_metrics, ready_at) - training_only_s(step_metrics)


def staleness_counts(step_metrics: Mapping[int, Mapping[str, float]]) -> dict[int, int]:
    """Samples per staleness value s (trainer version - oldest token version) over all steps:
    the sum of each step's ``staleness/count_<s>`` (samples dropped as too stale included)."""
    counts: Counter[int] = Counter()
    for metrics in step_metrics.values():
        for key, value in metrics.items():
            if key.startswith(STALENESS_COUNT_PREFIX):
                counts[int(key[len(STALENESS_COUNT_PREFIX) :])] += int(value)
    return dict(sorted(counts.items()))


def wasted_tokens(step_metrics: Mapping[int, Mapping[str, float]]) -> int:
    """Tokens generated, written and then thrown away by the trainer: its ``wasted_tokens``
    (samples dropped as staler than ``trainer.max_staleness``) summed over steps; 0 when every
    sample stays within the bound. What the scheduler generated but never wrote (groups cut
    or left unwritten by a stop, the end of the run included) is its own ``wasted_tokens``,
    reported as ``cut_tokens``; groups left out by dynamic filtering are a choice, counted
    apart (``filtered_groups``)."""
    return int(sum(float(m.get("wasted_tokens", 0.0)) for m in step_metrics.values()))


def mean_packing_efficiency(step_metrics: Mapping[int, Mapping[str, float]]) -> float:
    """Mean over steps of the step's packing efficiency (real tokens / token budget of its micro-batches)."""
    return statistics.fmean(m["packing_efficiency"] for m in step_metrics.values())


def overlap_bound(t_gen: float, t_train: float) -> float:
    """Ideal speed-up of perfect overlap: (T_gen + T_train) / max(T_gen, T_train), between
    1 (one side takes no time) and 2 (both take the same)."""
    if t_gen < 0 or t_train < 0 or max(t_gen, t_train) == 0:
        raise ValueError(f"overlap_bound: need times >= 0, not both 0; got T_gen={t_gen}, T_train={t_train}")
    return (t_gen + t_train) / max(t_gen, t_train)


def run_figures(
    eta: int,
    mode: str,
    step_metrics: Mapping[int, Mapping[str, float]],
    scheduler: Mapping[str, float],
    ready_at: float,
    standalone_tokens_per_s: float,
) -> dict[str, Any]:
    """One configuration's own figures:

        wall_s                     = W (:func:`rl_wall_s`)
        first_batch_wait_s         = :func:`first_batch_wait_s` (the pipeline's fill)
        trainer_idle_s             = :func:`trainer_idle_s` (W = fill + T_train + idle)
        trained_tokens_per_s       = trained tokens (:func:`trained_tokens`) / W
        gen_tokens_per_s           = output tokens of the samples the scheduler finished /
                                     the scheduler's lifetime (ControllerStats.summary)
        streamed_tokens_per_s      = output tokens the servers streamed (groups cut by the
                                     end of the run included) / the scheduler's lifetime
        rollout_utilisation        = streamed_tokens_per_s / the standalone tokens/s at the
                                     run's concurrency: how busy the run kept the server
        weight_sync_stall_fraction = seconds generation was paused for weight updates / scheduler lifetime
        packing_efficiency         = :func:`mean_packing_efficiency`
        reward_wait_per_step_s     = seconds groups waited for their rewards (summed over
                                     groups, ``reward_wait_s``) / steps; they overlap with
                                     generation, so this is the reward service's load, not a stall
        staleness_max, staleness_counts (:func:`staleness_counts`), dropped_stale = sum of ``dropped_stale``
        wasted_tokens              = :func:`wasted_tokens`; cut_tokens = the scheduler's
                                     ``wasted_tokens``; filtered_groups = the scheduler's
                                     ``filtered_groups`` (dynamic filtering)
    """
    missing = sorted({"gen_tokens_per_s", "weight_sync_stall_fraction", "weight_updates"} - set(scheduler))
    if missing:  # a scheduler that recorded nothing must not read as one that generated nothing
        raise ValueError(f"the scheduler's figures lack {missing}: it recorded no controller cycle (see its log)")
    wall = rl_wall_s(step_metrics, ready_at)
    tokens = trained_tokens(step_metrics)
    counts = staleness_counts(step_metrics)
    gen = float(scheduler["gen_tokens_per_s"])
    streamed = float(scheduler.get("streamed_tokens_per_s", gen))
    return {
        "eta": eta,
        "mode": mode,
        "steps": len(step_metrics),
        "wall_s": wall,
        "first_batch_wait_s": first_batch_wait_s(step_metrics, ready_at),
        "trainer_idle_s": trainer_idle_s(step_metrics, ready_at),
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens / wall,
        "gen_tokens_per_s": gen,
        "streamed_tokens_per_s": streamed,
        "standalone_tokens_per_s": standalone_tokens_per_s,
        "rollout_utilisation": streamed / standalone_tokens_per_s,
        "weight_sync_stall_fraction": float(scheduler["weight_sync_stall_fraction"]),
        "weight_updates": int(scheduler["weight_updates"]),
        "packing_efficiency": mean_packing_efficiency(step_metrics),
        "staleness_max": max(counts, default=0),
        "staleness_counts": counts,
        "dropped_stale": int(sum(m.get("dropped_stale", 0.0) for m in step_metrics.values())),
        "wasted_tokens": wasted_tokens(step_metrics),
        "cut_tokens": int(scheduler.get("wasted_tokens", 0.0)),
        "filtered_groups": int(scheduler.get("filtered_groups", 0.0)),
        "training_only_s": training_only_s(step_metrics),
        "reward_wait_per_step_s": float(scheduler.get("reward_wait_s", 0.0)) / max(len(step_metrics), 1),
    }


def run_limit_s(eta: int, t_gen: float, t_train: float) -> float:
    """The shortest wall time a configuration can reach, its own limit:

        synchronous (eta = 0): T_gen + T_train (generation and training take turns)
        asynchronous (eta > 0): max(T_gen(c), T_train) (perfect overlap)

    with T_gen the server alone generating the workload as the configuration does: batch
    by batch at eta = 0, with up to c = (eta + 1) * B * n samples in flight at eta > 0
    (more in flight, more tokens/s: a limit taken at eta 0's concurrency would not be one)."""
    return t_gen + t_train if eta == 0 else max(t_gen, t_train)


def compare_runs(runs: Sequence[Mapping[str, Any]], t_gen: float) -> dict[str, Any]:
    """Figures across runs, against the eta = 0 run (the first without ``error``):

        T_train                  = training_only_s of the eta = 0 run
        ideal_sync_s             = T_gen + T_train (T_gen batch by batch)
        bound                    = overlap_bound(T_gen, T_train) (the most overlap can gain)
        limit_s                  = run_limit_s(eta, T_gen of the run, T_train of the run):
                                   the run's ``t_gen_s`` (standalone at its concurrency) if
                                   set, and its own step times (an asynchronous run may train
                                   fewer tokens: samples over the staleness bound are dropped)
        efficiency               = limit_s / W (1 = the run reaches its own limit)
        speedup                  = W(eta = 0) / W (over this sweep's synchronous run)
        speedup_over_ideal_sync  = ideal_sync_s / W (over a synchronous run without idle time)

    Returns {"t_train_s", "ideal_sync_s", "overlap_bound", "runs": copies of ``runs`` with
    those figures added}; all None while no eta = 0 run succeeded."""
    baseline = next((r for r in runs if r["eta"] == 0 and "error" not in r), None)
    t_train = None if baseline is None else float(baseline["training_only_s"])
    bound = None if t_train is None else overlap_bound(t_gen, t_train)
    compared = []
    for run in runs:
        row = dict(run)
        if baseline is not None and t_train is not None and "error" not in run:
            row["limit_s"] = run_limit_s(int(run["eta"]), float(run.get("t_gen_s", t_gen)), float(run["training_only_s"]))
            row["efficiency"] = row["limit_s"] / run["wall_s"]
            row["speedup"] = baseline["wall_s"] / run["wall_s"]
            row["speedup_over_ideal_sync"] = (t_gen + t_train) / run["wall_s"]
        compared.append(row)
    return {
        "t_train_s": t_train,
        "ideal_sync_s": None if t_train is None else t_gen + t_train,
        "overlap_bound": bound,
        "runs": compared,
    }
