"""``asyncrl bench time-to-accuracy``: does asynchronous RL reach the synchronous run's accuracy
sooner? Throughput (``bench e2e``) and learning at equal steps (``bench ablation``) measured
together, as AReaL, verl and PipelineRL state their speed-ups.

From one run config it warm-starts once (the pipeline's data and SFT stages), then for every
seed runs every arm of the sweep from that warm start, changing only eta, the interrupt mode
(and, for the objective comparison, the objective): the fair synchronous run (eta 0, no idle
waits) and the asynchronous arms. Each published version's wall time since the RL phase began
is recorded; held-out pass@1 of the saved versions is evaluated after all runs, so evaluation
never competes with a run for the CPUs. Figures: :mod:`asyncrl.bench.accuracy_curves`;
output: :mod:`asyncrl.bench.time_to_accuracy_report`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.bench.ablation import eval_versions, prepare_warm_start, relocated
from asyncrl.bench.accuracy_curves import (
    accuracy_target, centred_mean, first_crossing, generation_share, seed_mean_curve, value_at, version_wall_times,
)  # fmt: skip
from asyncrl.bench.sweep_checks import check_distinct_ints, check_includes_sync, check_modes
from asyncrl.bench.e2e_figures import staleness_counts
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.inference.samples import INTERRUPT_MODES

SYNC_LABEL = "sync"
EVAL_POINTS = 6
"""Evaluated versions after the start when ``eval_every`` is not given."""


@dataclass(frozen=True)
class Arm:
    """One configuration of the sweep: eta, interrupt mode and objective (eta 0 is the
    synchronous run, whose interrupt mode changes nothing)."""

    eta: int
    mode: str
    objective: str = "decoupled"

    @property
    def label(self) -> str:
        if self.eta == 0:
            return SYNC_LABEL if self.objective == "decoupled" else f"{SYNC_LABEL}-{self.objective}"
        return f"eta{self.eta}-{self.mode}" + ("" if self.objective == "decoupled" else f"-{self.objective}")


@dataclass(frozen=True)
class TimeToAccuracySettings:
    """The sweep: every eta of ``etas`` (0 first, once) in every interrupt mode of ``modes``,
    for every seed; with ``objective_etas``, decoupled and standard PPO at those etas too (in
    the first mode)."""

    etas: tuple[int, ...] = (0, 2)
    modes: tuple[str, ...] = ("keep",)
    seeds: tuple[int, ...] = (0, 1, 2)
    objective_etas: tuple[int, ...] = ()
    """Etas at which standard PPO runs beside the decoupled objective (e.g. 4, 8)."""
    eval_every: int | None = None
    """Evaluate every this many versions (and the start and the last); None: ``max_steps //``
    :data:`EVAL_POINTS`, so every run is evaluated at as many points whatever its length."""
    smooth: int = 3
    """Centred moving mean over this many evaluated versions (odd; 1: none)."""
    target_fraction: float = 0.9
    """target = start + target_fraction * (synchronous final - start)."""
    work_dir: Path | None = None
    json_path: Path | None = None
    png_path: Path | None = None

    def __post_init__(self) -> None:
        check_distinct_ints("etas", self.etas, 0)
        check_distinct_ints("objective_etas", self.objective_etas, 0, allow_empty=True)
        check_includes_sync("etas", self.etas, "the synchronous run every arm is compared with")
        if len(self.etas) < 2 and not self.objective_etas:
            raise ValueError(f"etas: need at least one asynchronous eta beside 0, got {self.etas}")
        check_modes("modes", self.modes)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds: must be distinct ints >= 0, got {self.seeds!r}")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"eval_every: must be >= 1, got {self.eval_every}")
        if self.smooth < 1 or self.smooth % 2 == 0:
            raise ValueError(f"smooth: must be an odd number >= 1, got {self.smooth}")
        if not 0.0 < self.target_fraction <= 1.0:
            raise ValueError(f"target_fraction: must be in (0, 1], got {self.target_fraction}")

    def arms(self) -> list[Arm]:
        """The synchronous run first, then each eta > 0 in each mode, then the objective
        comparison's arms not already in the sweep."""
        arms = [Arm(0, self.modes[0])] + [Arm(eta, mode) for eta in sorted(self.etas) if eta > 0 for mode in self.modes]
        for eta in sorted(self.objective_etas):
            for objective in ("decoupled", "standard"):
                arm = Arm(eta, self.modes[0], objective)
                if arm not in arms:
                    arms.append(arm)
        return arms


# ----- the summary: plain functions of the measured curves -----


def arm_curve(
    per_seed: Sequence[Mapping[int, tuple[float, float]]], smooth: int
) -> dict[str, Any]:
    """An arm's seed-mean curve and its smoothed pass@1 (:func:`centred_mean`); the start
    (the shared warm start, the same for every arm) keeps its measured value."""
    points = seed_mean_curve(per_seed)
    raw = [p.pass_at_1 for p in points]
    smoothed = [raw[0], *centred_mean(raw[1:], smooth)] if len(raw) > 1 else raw
    return {
        "versions": [p.version for p in points],
        "wall_s": [p.wall_s for p in points],
        "wall_s_std": [p.wall_s_std for p in points],
        "pass_at_1": raw,
        "pass_at_1_std": [p.pass_at_1_std for p in points],
        "pass_at_1_smoothed": smoothed,
    }


def summarize(arms: Sequence[Mapping[str, Any]], start_pass_at_1: float, settings: TimeToAccuracySettings) -> dict[str, Any]:
    """Per arm (each ``{"label", "eta", "mode", "objective", "per_seed": [{version: (wall,
    pass@1)}], ...}``): its curve, the time it first reaches the shared target, its speed-up
    over the synchronous run, pass@1 at equal steps (the last version) and at equal wall time
    (the fastest arm's last publish); and at the top the best asynchronous arm's speed-up and
    equal-steps gap in points."""
    curves = {arm["label"]: arm_curve(arm["per_seed"], settings.smooth) for arm in arms}
    if SYNC_LABEL not in curves:
        raise ValueError("summarize: the synchronous arm did not run; every figure is relative to it")
    sync = curves[SYNC_LABEL]
    sync_final = sync["pass_at_1_smoothed"][-1]
    target = accuracy_target(start_pass_at_1, sync_final, settings.target_fraction)
    equal_wall_s = min(curve["wall_s"][-1] for curve in curves.values())
    sync_time = first_crossing(sync["wall_s"], sync["pass_at_1_smoothed"], target)
    out_arms = []
    for arm in arms:
        curve = curves[arm["label"]]
        time_to_target = first_crossing(curve["wall_s"], curve["pass_at_1_smoothed"], target)
        seed_times = []
        for seed_curve in arm["per_seed"]:
            single = arm_curve([seed_curve], settings.smooth)
            seed_times.append(first_crossing(single["wall_s"], single["pass_at_1_smoothed"], target))
        speedup = (sync_time / time_to_target) if (sync_time and time_to_target) else None
        out_arms.append({
            **{k: v for k, v in arm.items() if k != "per_seed"},
            "curve": curve,
            "time_to_target_s": time_to_target,
            "time_to_target_s_per_seed": seed_times,
            "time_to_target_speedup": speedup,
            "pass_at_1_equal_steps": curve["pass_at_1_smoothed"][-1],
            "pass_at_1_equal_steps_raw": curve["pass_at_1"][-1],
            "equal_steps_gap_points": 100.0 * (curve["pass_at_1_smoothed"][-1] - sync_final),
            "pass_at_1_equal_wall": value_at(curve["wall_s"], curve["pass_at_1_smoothed"], equal_wall_s),
            "final_wall_s": curve["wall_s"][-1],
        })  # fmt: skip
    asynchronous = [a for a in out_arms if a["eta"] > 0 and a["objective"] == "decoupled"]
    reached = [a for a in asynchronous if a["time_to_target_speedup"] is not None]
    best = max(reached, key=lambda a: a["time_to_target_speedup"]) if reached else (
        max(asynchronous, key=lambda a: a["pass_at_1_equal_steps"]) if asynchronous else None
    )  # fmt: skip
    return {
        "start_pass_at_1": start_pass_at_1,
        "sync_final_pass_at_1": sync_final,
        "sync_gain_points": 100.0 * (sync_final - start_pass_at_1),
        "target_pass_at_1": target,
        "sync_time_to_target_s": sync_time,
        "equal_wall_s": equal_wall_s,
        "best_arm": None if best is None else best["label"],
        "time_to_target_speedup": None if best is None else best["time_to_target_speedup"],
        "equal_steps_gap_points": None if best is None else best["equal_steps_gap_points"],
        "arms": out_arms,
    }


# ----- the runs -----


def arm_config(base: RunConfig, work: Path, warm_start: Path, arm: Arm, seed: int) -> RunConfig:
    """``base`` with only eta, the interrupt mode, the objective and the seed changed, from
    ``warm_start``, in its own run root under ``work``, every version kept (they are
    evaluated after the runs) and no evaluation during the run."""
    raw = relocated(base, work, f"{base.name}-{arm.label}-seed{seed}")
    raw["seed"] = seed
    raw["model"]["path"] = str(warm_start)
    raw["rollout"]["eta"] = arm.eta
    raw["rollout"]["interrupt_mode"] = arm.mode
    raw["rollout"]["adaptive_staleness"] = None
    raw["trainer"]["objective"] = arm.objective
    raw["trainer"]["keep_versions"] = raw["trainer"]["max_steps"] + 1
    raw["pipeline"]["sft_steps"] = 0
    raw["pipeline"]["eval_every"] = 0
    raw["tracking"]["mlflow_uri"] = f"sqlite:///{work / 'mlflow.db'}"
    raw["tracking"]["experiment"] = f"{base.name}-time-to-accuracy"
    return RunConfig.model_validate(raw)


def clear_arm_run(config: RunConfig) -> None:
    """Remove an earlier run of this arm: its work directory, the run root inside. Every bench
    run trains anew; a finished run root would otherwise be taken for this run (with no step
    measured), and a learning check after a code change would judge the old code's run."""
    work_dir, root = config.run_work_dir.resolve(), Path(config.storage.root).resolve()
    if not root.is_relative_to(work_dir):
        raise ValueError(f"storage.root: {root} is not inside the arm's work directory {work_dir}; not removing it")
    if work_dir.exists():
        shutil.rmtree(work_dir)  # a root that cannot go must not be taken for this run


def train_arm(config: RunConfig) -> dict[str, Any]:
    """One arm's RL run (``train_run``, after :func:`clear_arm_run`) and what the benches keep
    of it: the config, its first and last version, every version's wall time since the
    servers were ready, staleness, overlap, steps and the run's wall time."""
    from asyncrl.tasks.launch.rl import train_run

    clear_arm_run(config)
    train = train_run(config)
    start = min(train.logged_models, default=0)
    return {
        "config": config,
        "start": start,
        "final": train.final_version,
        "walls": version_wall_times(train.step_metrics, train.ready_at, start),
        "staleness": staleness_counts(train.step_metrics),
        "overlap": dict(train.overlap),
        "steps": len(train.step_metrics),
        "wall_s": train.wall_s,
    }


def evaluate_arms(arms: Sequence[tuple[Mapping[str, Any], Sequence[int]]]) -> list[dict[int, float]]:
    """Held-out pass@1 of the given versions of each trained arm (:func:`train_arm`), all on
    one vLLM server (:func:`~asyncrl.tasks.pipeline.stages.evaluate_runs`). The start, the warm
    start every arm shares, is evaluated once, with the first arm; the others take its score."""
    from asyncrl.tasks.launch.context import prepare_run
    from asyncrl.tasks.pipeline.stages import evaluate_runs

    if not arms:
        return []
    start = arms[0][0]["start"]
    chosen = [list(versions) if i == 0 else [v for v in versions if v != start] for i, (_, versions) in enumerate(arms)]
    evaluated = evaluate_runs([(run["config"], prepare_run(run["config"]), v) for (run, _), v in zip(arms, chosen, strict=True)])
    scores = [{v: r.pass_at_1 for v, r in results.items()} for results in evaluated]
    if start not in scores[0]:
        raise ValueError(f"the first arm's versions must include the shared start, version {start}")
    return [found | ({start: scores[0][start]} if start in versions else {}) for found, (_, versions) in zip(scores, arms, strict=True)]


def run_sweep(
    base: RunConfig, settings: TimeToAccuracySettings, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Warm start once; every arm for every seed (seeds outermost, so a drift of the host's
    speed falls on every arm alike); then held-out pass@1 of the saved versions of every run,
    the start once. JSON (and PNG) are rewritten as results come in."""
    from asyncrl.bench.time_to_accuracy_report import log_to_mlflow, plot_curves

    say = progress or (lambda line: None)
    if base.data.eval_path is None:
        raise ValueError("data.eval_path: time to accuracy needs a held-out split; set one")
    work = settings.work_dir or Path(base.work_dir) / f"{base.name}-time-to-accuracy"
    work.mkdir(parents=True, exist_ok=True)
    warm_start = prepare_warm_start(base, work)
    say(f"warm start ready: {warm_start}")
    arms = settings.arms()
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for seed in settings.seeds:
        for arm in arms:
            run = runs[(arm.label, seed)] = train_arm(arm_config(base, work, warm_start, arm, seed))
            say(f"seed {seed} {arm.label}: {run['steps']} steps in {run['overlap']['rl_wall_s']:.0f} s, "
                f"overlap factor {run['overlap']['overlap_factor']:.2f}")
    say(f"evaluating {len(runs)} runs on one server")
    keys = list(runs)
    every = settings.eval_every or max(1, base.trainer.max_steps // EVAL_POINTS)
    evaluated = evaluate_arms([(runs[key], eval_versions(runs[key]["start"], runs[key]["final"], every)) for key in keys])
    curves: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    for (label, seed), scores in zip(keys, evaluated, strict=True):
        run = runs[(label, seed)]
        curves[(label, seed)] = {v: (run["walls"][v], scores[v]) for v in sorted(scores)}
        say(f"evaluated seed {seed} {label}: " + ", ".join(f"v{v} {100 * p:.1f}%" for v, (_, p) in curves[(label, seed)].items()))
    start_pass = evaluated[0][runs[keys[0]]["start"]]
    arm_rows = []
    for arm in arms:
        seeds = [runs[(arm.label, s)] for s in settings.seeds]
        counts: dict[int, int] = {}
        for run in seeds:
            for value, count in run["staleness"].items():
                counts[value] = counts.get(value, 0) + count
        arm_rows.append({
            "label": arm.label, "eta": arm.eta, "mode": arm.mode, "objective": arm.objective,
            "per_seed": [curves[(arm.label, s)] for s in settings.seeds],
            "steps": seeds[0]["steps"],
            "rl_wall_s_per_seed": [run["overlap"]["rl_wall_s"] for run in seeds],
            "overlap_per_seed": [run["overlap"] for run in seeds],
            "staleness_counts": dict(sorted(counts.items())),
        })  # fmt: skip
    result = {
        "config": base.name,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "steps": base.trainer.max_steps,
        "batch_groups": base.trainer.batch_groups,
        "n_samples": base.rollout.n_samples,
        "max_new_tokens": base.rollout.max_new_tokens,
        "eval_prompts": base.pipeline.eval_prompts,
        "eval_samples": base.pipeline.eval_samples,
        "eval_every": every,
        "work_dir": str(work),
        "sync_generation_share": generation_share(arm_rows[0]["overlap_per_seed"]),
        **summarize(arm_rows, start_pass, settings),
    }
    for arm, row in zip(result["arms"], arm_rows, strict=True):
        arm["per_seed_curves"] = [{str(v): list(point) for v, point in curve.items()} for curve in row["per_seed"]]
    json_path = settings.json_path or work / "time-to-accuracy.json"
    png_path = settings.png_path or work / "time-to-accuracy.png"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    plot_curves(result, png_path)
    result["mlflow_run_id"] = log_to_mlflow(result, f"sqlite:///{work / 'mlflow.db'}", f"{base.name}-time-to-accuracy",
                                            [json_path, png_path])  # fmt: skip
    json_path.write_text(json.dumps(result, indent=1))
    return result


def cmd_bench_time_to_accuracy(args: argparse.Namespace) -> int:
    import os

    from asyncrl.bench.time_to_accuracy_report import format_table
    from asyncrl.configs.loading import load_config

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    base = load_config(args.config, args.overrides)
    work = Path(args.work_dir) if args.work_dir else Path(base.work_dir) / f"{base.name}-time-to-accuracy"
    settings = TimeToAccuracySettings(
        etas=args.etas, modes=args.modes, seeds=args.seeds, objective_etas=args.objective_etas,
        eval_every=args.eval_every, smooth=args.smooth, work_dir=work,
        json_path=Path(args.json) if args.json else work / "time-to-accuracy.json",
        png_path=Path(args.png) if args.png else work / "time-to-accuracy.png",
    )  # fmt: skip
    result = run_sweep(base, settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(result))
    print(f"curves: {settings.png_path}; figures: {settings.json_path}; MLflow run {result['mlflow_run_id']}")
    return 0
