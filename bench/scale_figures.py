"""The figures of ``asyncrl bench scale`` as plain functions of measured numbers: per size the
trainer's step, the weight-sync phases, the update stall and the components' peak memory
against the model states they must hold; across sizes the exponent k of each cost against
parameters (cost ~ params^k). Formulas in the docstrings of the functions that compute them.
"""

from __future__ import annotations

import itertools
import math
import statistics
import types
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.bench.process_memory import component_peak
from asyncrl.bench.weight_sync import gb_per_s

COSTS: types.MappingProxyType[str, str] = types.MappingProxyType({
    "step_s": "trainer step (s)",
    "trainer_publish_s": "trainer publish (s)",
    "publish_s": "publish (s)",
    "fetch_s": "fetch (s)",
    "load_s": "load (s)",
    "stall_s": "update stall (s)",
    "trainer_rss_bytes": "peak RSS trainer",
    "server_rss_bytes": "peak RSS rollout server",
    "checkpoint_bytes": "checkpoint bytes",
})  # fmt: skip
"""The costs whose exponent against parameters is fitted, with their labels."""
WEIGHT_SYNC_PHASES = ("publish", "fetch", "load", "worker reload")
"""Phases of ``asyncrl bench weight-sync`` reported per size."""


def model_state_bytes(parameters: int, dtype: str) -> int:
    """What the trainer must hold for ``parameters`` at its precision (``model.dtype``):

        float32:           4 (weights) + 4 (gradients) + 8 (Adam m and v)                   = 16 B/param
        bfloat16, float16: 2 (weights) + 2 (gradients) + 4 (fp32 master) + 8 (Adam m and v) = 16 B/param

    (activations, logits and the runtime come on top)."""
    if dtype == "float32":
        per_param = 4 + 4 + 8
    elif dtype in ("bfloat16", "float16"):
        per_param = 2 + 2 + 4 + 8
    else:
        raise ValueError(f"model_state_bytes: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return parameters * per_param


def measured_steps(step_metrics: Mapping[int, Mapping[str, float]]) -> list[Mapping[str, float]]:
    """The steps the figures average over: all but the first when there are several (the
    first also allocates the optimizer's states and warms the allocator), else the one."""
    if not step_metrics:
        raise ValueError("measured_steps: no step was trained")
    ordered = [step_metrics[k] for k in sorted(step_metrics)]
    return ordered[1:] if len(ordered) > 1 else ordered


def trainer_figures(step_metrics: Mapping[int, Mapping[str, float]]) -> dict[str, float | None]:
    """The trainer's figures, over :func:`measured_steps` (T_s = proximal_time_s +
    update_time_s, the step's forward, backward and optimizer work):

        step_s            = mean T_s
        tokens_per_s      = sum sequence_tokens / sum T_s
        tokens_per_step   = mean sequence_tokens
        step_wall_s       = mean (step_time_s - checkpoint_time_s): ledger, compute and publish
        trainer_publish_s = mean publish_time_s (gather the weights, write the HF directory,
                            publish it to the store)

    and over every step: checkpoint_s = the largest checkpoint_time_s (None without one),
    micro_batch_tokens = max (sequence_tokens / micro_batches), the largest micro-batch when
    each step's samples fill one."""
    steps = measured_steps(step_metrics)
    compute = [float(m["proximal_time_s"]) + float(m["update_time_s"]) for m in steps]
    tokens = [float(m["sequence_tokens"]) for m in steps]
    every = list(step_metrics.values())
    checkpoint = max(float(m.get("checkpoint_time_s", 0.0)) for m in every)
    return {
        "steps_measured": float(len(steps)),
        "step_s": statistics.fmean(compute),
        "tokens_per_s": sum(tokens) / sum(compute) if sum(compute) > 0 else None,
        "tokens_per_step": statistics.fmean(tokens),
        "step_wall_s": statistics.fmean(float(m["step_time_s"]) - float(m.get("checkpoint_time_s", 0.0)) for m in steps),
        "trainer_publish_s": statistics.fmean(float(m["publish_time_s"]) for m in steps),
        "checkpoint_s": checkpoint if checkpoint > 0 else None,
        "micro_batch_tokens": max(float(m["sequence_tokens"]) / max(float(m["micro_batches"]), 1.0) for m in every),
    }


def stall_figures(scheduler: Mapping[str, float]) -> dict[str, float | None]:
    """stall_s = weight_sync_stall_s / weight_updates (the scheduler's figures over the run:
    seconds generation waited per weight update, pause to resume); None without an update."""
    updates = int(scheduler.get("weight_updates", 0))
    return {
        "weight_updates": float(updates),
        "stall_s": float(scheduler["weight_sync_stall_s"]) / updates if updates else None,
    }


def weight_sync_figures(seconds: Mapping[str, Sequence[float]], version_bytes: int) -> dict[str, float]:
    """Per phase of :data:`WEIGHT_SYNC_PHASES` (``worker reload`` as ``reload``):
    <phase>_s = mean seconds over the versions, <phase>_gb_s = version bytes / <phase>_s / 1e9."""
    out: dict[str, float] = {"version_bytes": float(version_bytes)}
    for phase in WEIGHT_SYNC_PHASES:
        key = "reload" if phase == "worker reload" else phase
        mean = statistics.fmean(seconds[phase])
        out[f"{key}_s"] = mean
        out[f"{key}_gb_s"] = gb_per_s(version_bytes, mean)
    return out


def memory_figures(
    peaks: Mapping[str, Mapping[str, Any]], parameters: int, dtype: str, micro_batch_tokens: float
) -> dict[str, float | None]:
    """Peak RSS of each component's largest process (``VmHWM``,
    :class:`~asyncrl.bench.process_memory.ComponentPeak`) and the trainer's against what it
    must hold, S = :func:`model_state_bytes`:

        trainer_rss_over_states = trainer peak RSS / S
        trainer_bytes_per_token = (trainer peak RSS - S) / micro_batch_tokens

    the second being what the trainer holds beyond its model states (activations, logit
    chunks, and the runtime itself, so an upper bound) per token of its largest micro-batch."""
    states = model_state_bytes(parameters, dtype)
    trainer = component_peak(peaks, "trainer")
    return {
        "model_state_bytes": float(states),
        "trainer_rss_bytes": None if trainer is None else float(trainer),
        "server_rss_bytes": _float(component_peak(peaks, "rollout-server")),
        "reward_rss_bytes": _float(component_peak(peaks, "reward-service")),
        "scheduler_rss_bytes": _float(component_peak(peaks, "scheduler")),
        "trainer_rss_over_states": None if trainer is None else trainer / states,
        "trainer_bytes_per_token": (
            None if trainer is None or not micro_batch_tokens > 0 else (trainer - states) / micro_batch_tokens
        ),
    }


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


def fit_exponent(parameters: Sequence[float], costs: Sequence[float]) -> float:
    """k of cost ~ a * params^k, by least squares of log cost on log params:

        x_i = ln params_i,  y_i = ln cost_i
        k   = sum_i (x_i - mean x)(y_i - mean y) / sum_i (x_i - mean x)^2

    With two points, k = ln(cost_2 / cost_1) / ln(params_2 / params_1). Needs at least two
    distinct parameter counts, all of them and every cost > 0."""
    if len(parameters) != len(costs) or len(parameters) < 2:
        raise ValueError(f"fit_exponent: need two or more (params, cost) pairs, got {len(parameters)} and {len(costs)}")
    if any(not p > 0 for p in parameters) or any(not c > 0 for c in costs):
        raise ValueError(f"fit_exponent: params and costs must be > 0, got {list(parameters)} and {list(costs)}")
    xs = [math.log(p) for p in parameters]
    ys = [math.log(c) for c in costs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError(f"fit_exponent: the parameter counts are all equal ({parameters[0]})")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def scaling_exponents(sizes: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each cost of :data:`COSTS`, over the sizes (``{"size", "parameters", "figures"}``,
    smallest first) that measured it (> 0): ``pairs``, the exponent between each size and the
    next (:func:`fit_exponent` of the two), and ``overall``, the fit over all of them (None
    with fewer than two)."""
    out: dict[str, dict[str, Any]] = {}
    for cost in COSTS:
        points = [(s["size"], float(s["parameters"]), s["figures"].get(cost)) for s in sizes]
        points = [(name, p, float(c)) for name, p, c in points if c is not None and c > 0]
        pairs = [
            {"from": a[0], "to": b[0], "k": fit_exponent([a[1], b[1]], [a[2], b[2]])}
            for a, b in itertools.pairwise(points)
        ]
        overall = fit_exponent([p for _, p, _ in points], [c for _, _, c in points]) if len(points) > 1 else None
        out[cost] = {"pairs": pairs, "overall": overall}
    return out
