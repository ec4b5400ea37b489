"""``asyncrl bench learning``: does the run config still learn as much as it did? The check to
run before a change to the trainer, the algorithm or the scheduler lands (docs/benchmarks.md).

From one warm start (the config's data and SFT stages, cached across invocations) it runs the
config's RL ``repeats`` times with seeds seed, seed + 1, ..., evaluates held-out pass@1 of
the start once and of each run's last version, and compares the mean gain with
``--min-gain``. Run-to-run spread is reported beside the mean, because one run's gain moves
by several points on the demo.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.bench.ablation import prepare_warm_start
from asyncrl.bench.time_to_accuracy import Arm, arm_config, evaluate_arms, train_arm
from asyncrl.configs.run_config import RunConfig


def gain_summary(start_pass_at_1: float, finals: Sequence[float], min_gain_points: float | None) -> dict[str, Any]:
    """gain_i = 100 * (final_i - start) points; the check passes when mean(gain) >= min_gain
    (no check without ``min_gain_points``). Standard deviation over runs (0 for one run)."""
    if not finals:
        raise ValueError("gain_summary: no run")
    gains = [100.0 * (final - start_pass_at_1) for final in finals]
    mean = statistics.fmean(gains)
    return {
        "start_pass_at_1": start_pass_at_1,
        "final_pass_at_1": list(finals),
        "gain_points": gains,
        "gain_points_mean": mean,
        "gain_points_std": statistics.stdev(gains) if len(gains) > 1 else 0.0,
        "min_gain_points": min_gain_points,
        "passed": None if min_gain_points is None else mean >= min_gain_points,
    }


def run_learning_check(
    base: RunConfig, repeats: int, min_gain_points: float | None, work: Path, progress: Callable[[str], None]
) -> dict[str, Any]:
    """The runs and their evaluation (module docstring); the runs keep only their own figures."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    if base.data.eval_path is None:
        raise ValueError("data.eval_path: the learning check compares held-out accuracy; set a held-out split")
    work.mkdir(parents=True, exist_ok=True)
    warm_start = prepare_warm_start(base, work)
    arm = Arm(base.rollout.eta, base.rollout.interrupt_mode, base.trainer.objective)
    runs = []
    for seed in range(base.seed, base.seed + repeats):
        runs.append(train_arm(arm_config(base, work, warm_start, arm, seed)))
        progress(f"seed {seed}: {runs[-1]['steps']} steps in {runs[-1]['wall_s']:.0f} s")
    scores = evaluate_arms([(run, [run["start"], run["final"]]) for run in runs])  # one server for all
    start_pass = scores[0][runs[0]["start"]]
    finals = [found[run["final"]] for found, run in zip(scores, runs, strict=True)]
    walls = [run["wall_s"] for run in runs]
    for seed, final in zip(range(base.seed, base.seed + repeats), finals, strict=True):
        progress(f"seed {seed}: pass@1 {100 * start_pass:.1f}% -> {100 * final:.1f}%")
    return {"config": base.name, "arm": arm.label, "steps": base.trainer.max_steps, "seeds": list(range(base.seed, base.seed + repeats)),
            "eval_prompts": base.pipeline.eval_prompts, "eval_samples": base.pipeline.eval_samples, "train_wall_s": walls,
            **gain_summary(start_pass, finals, min_gain_points)}  # fmt: skip


def format_check(result: dict[str, Any]) -> str:
    gains = ", ".join(f"{g:+.1f}" for g in result["gain_points"])
    verdict = {None: "no threshold given", True: "PASSED", False: "FAILED"}[result["passed"]]
    threshold = "" if result["min_gain_points"] is None else f" (threshold {result['min_gain_points']:+.1f})"
    return (
        f"{result['config']} ({result['arm']}, {result['steps']} steps, seeds {result['seeds']}): held-out pass@1 "
        f"{100 * result['start_pass_at_1']:.1f}% at the start; gain per run {gains} points; mean "
        f"{result['gain_points_mean']:+.1f} +- {result['gain_points_std']:.1f}{threshold}: {verdict}"
    )


def cmd_bench_learning(args: argparse.Namespace) -> int:
    import os

    from asyncrl.configs.loading import load_config

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    base = load_config(args.config, args.overrides)
    work = Path(args.work_dir) if args.work_dir else Path(base.work_dir) / f"{base.name}-learning"
    result = run_learning_check(base, args.repeats, args.min_gain, work, lambda line: print(line, file=sys.stderr, flush=True))
    json_path = Path(args.json) if args.json else work / "learning.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(format_check(result))
    return 1 if result["passed"] is False else 0
