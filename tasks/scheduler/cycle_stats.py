"""The scheduler's figures per controller cycle: one JSON line a cycle in the run's work
directory, written by the scheduler process and added up by the run when it reports
(rates recomputed over the summed time, so a restart does not skew them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CYCLE_STATS_FILE = "scheduler-stats.jsonl"
TASK_MEAN_PREFIX = "reward_mean/"
RATE_KEYS = frozenset({"gen_tokens_per_s", "streamed_tokens_per_s", "weight_sync_stall_fraction", "reward_mean"})


def append_cycle_stats(path: Path, summary: dict[str, float]) -> None:
    """One JSON line per controller cycle: the run adds them up (:func:`combine_cycle_stats`),
    so the figures survive a scheduler restart and a failed cycle is visible as a gap."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(summary) + "\n")


def combine_cycle_stats(lines: Sequence[dict[str, float]]) -> dict[str, float]:
    """The figures of all cycles: counts and seconds are summed (``generation_busy_s`` too:
    the cycles follow one another, so the sum of their busy times is still a union); rates
    are recomputed over the summed controller time E = sum(elapsed_s): gen_tokens_per_s = output_tokens / E,
    streamed_tokens_per_s = streamed_tokens / E, weight_sync_stall_fraction = weight_sync_stall_s / E, reward_mean weighted by samples,
    reward_mean/<task> = sum reward_sum/<task> / sum samples/<task>; the adaptive bound's
    ``effective_eta`` is the last cycle's and ``effective_eta_min`` the lowest of any cycle;
    ``rollout_servers`` the most servers a cycle ran on (the fleet changes between cycles)."""
    if not lines:
        return {}
    total: dict[str, float] = {}
    for line in lines:
        for key, value in line.items():
            if key == "effective_eta":
                total[key] = float(value)
            elif key == "rollout_servers":
                total[key] = max(total.get(key, 0.0), float(value))
            elif key == "effective_eta_min":
                total[key] = min(total.get(key, float(value)), float(value))
            elif key not in RATE_KEYS and not key.startswith(TASK_MEAN_PREFIX):
                total[key] = total.get(key, 0.0) + float(value)
    elapsed = max(total.get("elapsed_s", 0.0), 1e-9)
    samples = total.get("samples", 0.0)
    total["gen_tokens_per_s"] = total.get("output_tokens", 0.0) / elapsed
    total["streamed_tokens_per_s"] = total.get("streamed_tokens", 0.0) / elapsed
    total["weight_sync_stall_fraction"] = total.get("weight_sync_stall_s", 0.0) / elapsed
    total["reward_mean"] = (
        sum(float(line.get("reward_mean", 0.0)) * float(line.get("samples", 0.0)) for line in lines) / samples
        if samples else 0.0
    )  # fmt: skip
    for key in [k for k in total if k.startswith("samples/")]:
        task = key.removeprefix("samples/")
        if total[key]:
            total[f"{TASK_MEAN_PREFIX}{task}"] = total.get(f"reward_sum/{task}", 0.0) / total[key]
    total["cycles"] = float(len(lines))
    return total


def read_cycle_stats(path: Path) -> list[dict[str, float]]:
    """The cycle lines written so far (a line cut by a kill is skipped)."""
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines
