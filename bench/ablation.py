"""``asyncrl bench ablation``: held-out accuracy against staleness, decoupled vs standard PPO.

The paper's algorithmic claim (AReaL, arXiv 2505.24298) is that standard PPO degrades as
the staleness bound eta grows while the decoupled objective stays near eta = 0; this bench
checks it on our own system. From one run config it warm-starts once (SFT), then runs the
real RL run (:func:`~asyncrl.tasks.launch.rl.train_run`) for every eta and objective (and,
for ``adaptive_etas``, with :mod:`~asyncrl.tasks.algo.adaptive_eta`) changing nothing else,
evaluates held-out pass@1 along the way, and writes a table, JSON and a two-panel PNG.
The staleness the runs actually reach is reported next to the bound (a bound is only a
ceiling). Step by step: ``docs/internals/bench.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.trainer import TrainerConfig
from asyncrl.bench.sweep_checks import check_distinct_ints
from asyncrl.bench.e2e_report import format_staleness
from asyncrl.bench.e2e_figures import staleness_counts, wasted_tokens

Objective = str
OBJECTIVES: tuple[str, ...] = get_args(TrainerConfig.model_fields["objective"].annotation)


@dataclass(frozen=True)
class AblationSettings:
    """The sweep: every eta in ``etas`` with every objective in ``objectives``."""

    etas: tuple[int, ...] = (0, 4, 8)
    objectives: tuple[Objective, ...] = OBJECTIVES
    adaptive_etas: tuple[int, ...] = ()
    """Bounds run again with adaptive staleness (each with every objective)."""
    eval_every: int = 10
    """Evaluate every this many versions (and the first and last); 0: first and last only."""
    smooth: int = 5
    """Reward curve: moving mean over this many steps."""
    work_dir: Path | None = None
    """Run roots, MLflow database, logs; None = ``<config.work_dir>/<config.name>-ablation``."""
    json_path: Path | None = None
    png_path: Path | None = None

    def __post_init__(self) -> None:
        check_distinct_ints("etas", self.etas, 0)
        check_distinct_ints("adaptive_etas", self.adaptive_etas, 1, allow_empty=True, why=" (eta 0 has nothing to adapt)")
        bad = [o for o in self.objectives if o not in OBJECTIVES]
        if not self.objectives or bad or len(set(self.objectives)) != len(self.objectives):
            raise ValueError(f"objectives: must be distinct values of {list(OBJECTIVES)}, got {self.objectives!r}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0, got {self.eval_every}")
        if self.smooth < 1:
            raise ValueError(f"smooth: must be >= 1, got {self.smooth}")

    def sweep(self) -> list[tuple[int, Objective, bool]]:
        """(eta, objective, adaptive) of every run, fixed bounds first."""
        fixed = [(eta, objective, False) for eta in self.etas for objective in self.objectives]
        return fixed + [(eta, objective, True) for eta in self.adaptive_etas for objective in self.objectives]


# ----- plain functions of measured numbers -----


def eval_versions(first: int, last: int, every: int) -> list[int]:
    """Versions to evaluate: ``first``, every ``every``-th version after it, and ``last``
    (``first`` and ``last`` only when ``every`` is 0)."""
    if last < first:
        raise ValueError(f"eval_versions: last version {last} is before the first {first}")
    middle = range(first + every, last, every) if every > 0 else range(0)
    return sorted({first, *middle, last})


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    """m_i = mean(values[max(0, i - window + 1) .. i]): trailing mean, shorter at the start."""
    if window < 1:
        raise ValueError(f"moving_mean: window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_summary(
    eta: int,
    objective: str,
    step_metrics: Mapping[int, Mapping[str, float]],
    pass_at_1: Mapping[int, float],
    start_version: int,
    scheduler: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One configuration: final pass@1 (at the last evaluated version) and its change from
    the starting model, the pass@1 curve by step (step = version - start_version), the
    training reward by step, the staleness reached, the samples dropped as too stale and the
    tokens wasted (:func:`asyncrl.bench.e2e_figures.wasted_tokens`), and from the scheduler's figures
    the tokens cut by stops, the groups dynamic filtering left out and, with adaptive
    staleness, the lowest effective bound and the number of changes."""
    steps = sorted(step_metrics)
    versions = sorted(pass_at_1)
    counts = staleness_counts(step_metrics)
    return {
        "eta": eta,
        "objective": objective,
        "steps": len(steps),
        "pass_at_1_start": pass_at_1[versions[0]],
        "pass_at_1_final": pass_at_1[versions[-1]],
        "pass_at_1_change": pass_at_1[versions[-1]] - pass_at_1[versions[0]],
        "pass_at_1_curve": [[v - start_version, pass_at_1[v]] for v in versions],
        "reward_curve": [[s, float(step_metrics[s]["reward_mean"])] for s in steps],
        "staleness_max": max(counts, default=0),
        "staleness_mean": sum(s * c for s, c in counts.items()) / max(sum(counts.values()), 1),
        "staleness_counts": counts,
        "dropped_stale": int(sum(m.get("dropped_stale", 0.0) for m in step_metrics.values())),
        "wasted_tokens": wasted_tokens(step_metrics),
        "cut_tokens": int((scheduler or {}).get("wasted_tokens", 0.0)),
        "filtered_groups": int((scheduler or {}).get("filtered_groups", 0.0)),
        "clip_fraction_mean": sum(float(step_metrics[s].get("clip_fraction", 0.0)) for s in steps) / max(len(steps), 1),
        "adaptive": "effective_eta_min" in (scheduler or {}),
        "effective_eta_min": int((scheduler or {}).get("effective_eta_min", eta)),
        "eta_changes": int((scheduler or {}).get("eta_changes", 0.0)),
    }


# ----- the runs -----


def variant_config(
    base: RunConfig, work: Path, warm_start: Path, eta: int, objective: str, adaptive: bool = False
) -> RunConfig:
    """``base`` with only eta, the objective and adaptive staleness changed (on: the base's
    settings, else the defaults; off: none), starting from ``warm_start``, in its own run
    root and scratch directory under ``work`` (no SFT, the inputs already exist)."""
    from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig

    raw = relocated(base, work, f"{base.name}-eta{eta}{'-adaptive' if adaptive else ''}-{objective}")
    raw["model"]["path"] = str(warm_start)
    raw["rollout"]["eta"] = eta
    raw["rollout"]["adaptive_staleness"] = (
        (base.rollout.adaptive_staleness or AdaptiveStalenessConfig()).model_dump() if adaptive else None
    )
    raw["trainer"]["objective"] = objective
    raw["pipeline"]["sft_steps"] = 0
    # every version stays in the store: the sweep evaluates every eval_every-th one afterwards
    raw["trainer"]["keep_versions"] = raw["trainer"]["max_steps"] + 1
    raw["tracking"]["mlflow_uri"] = f"sqlite:///{work / 'mlflow.db'}"
    raw["tracking"]["experiment"] = f"{base.name}-ablation"
    return RunConfig.model_validate(raw)


def relocated(base: RunConfig, work: Path, name: str) -> dict[str, Any]:
    """``base`` as a dict, renamed ``name``, with its scratch directory and run root under
    ``work/runs`` (``work/runs/<name>`` and ``work/runs/<name>/store``)."""
    raw = base.model_dump()
    raw["name"] = name
    raw["work_dir"] = str(work / "runs")
    raw["storage"]["root"] = str(work / "runs" / name / "store")
    return raw


RL_ONLY_ROLLOUT = ("eta", "interrupt_mode", "adaptive_staleness", "dynamic_filter")
RL_ONLY_TRAINER = ("batch_groups", "mini_batches", "max_steps", "objective", "eps_clip", "eps_clip_high",
                   "behav_weight_cap", "behav_cap_mode", "behav_weight_floor", "behav_weight_level", "advantage",
                   "negative_advantage_scale", "kl_coef", "max_staleness", "checkpoint_every", "keep_versions")  # fmt: skip
"""Settings RL reads and SFT does not: the warm start's run root holds their defaults."""


def warm_start_config(base: RunConfig, work: Path) -> RunConfig:
    """``base``'s SFT run under ``work`` (``<name>-ablation-base``) with the RL-only settings
    (:data:`RL_ONLY_ROLLOUT`, :data:`RL_ONLY_TRAINER`, and ``trainer.optimizer`` when
    ``pipeline.sft_optimizer`` is set) at their defaults. A run root refuses another run's
    trajectory settings, so arms and sweeps that change only RL settings share one warm
    start instead of being refused."""
    from asyncrl.configs.rollout import RolloutConfig

    raw = relocated(base, work, f"{base.name}-ablation-base")
    for section, model, keys in (("rollout", RolloutConfig, RL_ONLY_ROLLOUT), ("trainer", TrainerConfig, RL_ONLY_TRAINER)):
        for key in keys:
            raw[section][key] = model.model_fields[key].get_default(call_default_factory=True)
    if base.pipeline.sft_optimizer is not None:
        raw["trainer"]["optimizer"] = TrainerConfig.model_fields["optimizer"].get_default(call_default_factory=True)
    return RunConfig.model_validate(raw)


def prepare_warm_start(base: RunConfig, work: Path) -> Path:
    """The pipeline's inputs and SFT stage in the base run (:func:`warm_start_config`; skipped
    when already done); returns a local directory with the warm-start weights
    (``base.model.path`` without SFT)."""
    from asyncrl.tasks.pipeline.stages import prepare_inputs, run_sft
    from asyncrl.tasks.launch.context import prepare_run
    from asyncrl.tasks.model.weight_fetch import model_weights

    prepare_inputs(base)
    warm_config = warm_start_config(base, work)
    paths = prepare_run(warm_config)
    version = run_sft(warm_config, paths) if warm_config.pipeline.sft_steps else None
    return model_weights(paths.root, base.model.path, version, work / "warm-start-cache")


def run_ablation(base: RunConfig, settings: AblationSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Warm start once, then every (eta, objective) of the sweep; a configuration that fails
    is recorded with its ``error`` and the sweep goes on. JSON and PNG are rewritten after
    every configuration, so a long sweep keeps what it measured."""
    from asyncrl.tasks.pipeline.stages import evaluate_versions
    from asyncrl.tasks.launch.context import prepare_run
    from asyncrl.tasks.launch.rl import train_run

    say = progress or (lambda line: None)
    if base.data.eval_path is None:
        raise ValueError("data.eval_path: the ablation compares held-out accuracy; set a held-out split")
    work = settings.work_dir or Path(base.work_dir) / f"{base.name}-ablation"
    work.mkdir(parents=True, exist_ok=True)
    warm_start = prepare_warm_start(base, work)
    say(f"warm start ready: {warm_start}")
    result: dict[str, Any] = {
        "config": base.name,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "steps": base.trainer.max_steps,
        "batch_groups": base.trainer.batch_groups,
        "n_samples": base.rollout.n_samples,
        "eval_prompts": base.pipeline.eval_prompts,
        "eval_samples": base.pipeline.eval_samples,
        "work_dir": str(work),
        "runs": [],
    }
    sweep = settings.sweep()
    for index, (eta, objective, adaptive) in enumerate(sweep, start=1):
        config = variant_config(base, work, warm_start, eta, objective, adaptive)
        try:
            train = train_run(config)
            start = min(train.logged_models, default=0)
            versions = eval_versions(start, train.final_version, settings.eval_every)
            evaluated = evaluate_versions(config, prepare_run(config), versions)
            run = run_summary(
                eta, objective, train.step_metrics, {v: r.pass_at_1 for v, r in evaluated.items()}, start,
                train.scheduler,
            )
            run["train_wall_s"] = train.wall_s
            # per task (a mixed config): pass@1/pass@k of the starting and the final version
            run["by_task_start"] = evaluated[min(evaluated)].by_task
            run["by_task_final"] = evaluated[max(evaluated)].by_task
        except Exception as exc:  # noqa: BLE001 - recorded; the other configurations still run
            run = {"eta": eta, "objective": objective, "adaptive": adaptive, "error": f"{type(exc).__name__}: {exc}"[:4000]}
        result["runs"].append(run)
        if settings.json_path is not None:
            settings.json_path.write_text(json.dumps(result, indent=1))
        if settings.png_path is not None:
            plot_curves(result, settings.png_path, settings.smooth)
        say(
            f"[{index}/{len(sweep)}] eta={eta}{' adaptive' if adaptive else ''} {objective}: "
            + (run.get("error") or f"pass@1 {run['pass_at_1_start']:.3f} -> {run['pass_at_1_final']:.3f}")
        )
    return result


# ----- output -----


def format_table(result: Mapping[str, Any]) -> str:
    lines = [
        f"{result['config']}: {result['steps']} steps of {result['batch_groups']} groups x {result['n_samples']} "
        f"samples; pass@1 over {result['eval_prompts']} held-out prompts x {result['eval_samples']} samples",
        "",
        "| eta | objective | pass@1 start | pass@1 final | change | RL wall s | staleness max | staleness mean "
        "| staleness (value:samples) | dropped | clip frac. | wasted tok. | filtered groups |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {bound_label(r)} | {r['objective']} | failed: {r['error'].splitlines()[0][:80]} |" + " |" * 10)
            continue
        wall = r.get("train_wall_s")
        lines.append(
            f"| {bound_label(r)} | {r['objective']} | {r['pass_at_1_start']:.3f} | {r['pass_at_1_final']:.3f} | "
            f"{r['pass_at_1_change']:+.3f} | {'n/a' if wall is None else f'{wall:.0f}'} | {r['staleness_max']} | "
            f"{r['staleness_mean']:.2f} | {format_staleness(r['staleness_counts'])} | {r['dropped_stale']} | "
            f"{r['clip_fraction_mean']:.3f} | {r.get('wasted_tokens', 'n/a')} | {r.get('filtered_groups', 'n/a')} |"
        )
    lines.extend(_per_task_lines(result["runs"]))
    return "\n".join(lines)


def bound_label(run: Mapping[str, Any]) -> str:
    """``8``, or for an adaptive run ``8 adaptive (min 2, 5 changes)``: the lowest effective
    bound it reached and how often the bound moved."""
    if not run.get("adaptive"):
        return str(run["eta"])
    if "effective_eta_min" not in run:
        return f"{run['eta']} adaptive"
    return f"{run['eta']} adaptive (min {run['effective_eta_min']}, {run['eta_changes']} changes)"


def _per_task_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """For a run over several tasks: each run's pass@1 per task, start -> final."""
    tasks = sorted({name.split("/", 1)[1] for r in runs for name in r.get("by_task_final", {}) if name.startswith("pass_at_1/")})
    if len(tasks) < 2:
        return []
    lines = ["", "pass@1 per task, start -> final:"]
    for r in runs:
        if "error" in r:
            continue
        start, final = r.get("by_task_start", {}), r.get("by_task_final", {})
        parts = [
            f"{task} {start.get(f'pass_at_1/{task}', float('nan')):.3f} -> {final.get(f'pass_at_1/{task}', float('nan')):.3f}"
            for task in tasks
        ]
        lines.append(f"- eta {bound_label(r)} {r['objective']}: " + ", ".join(parts))
    return lines


def plot_curves(result: Mapping[str, Any], path: Path, smooth: int) -> Path:
    """Two panels: held-out pass@1 by step, training reward (moving mean) by step; colour =
    eta, line style = objective (solid decoupled, dashed standard; dotted markers: adaptive)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "error" not in r]
    etas = sorted({r["eta"] for r in runs})
    colours = {eta: plt.get_cmap("viridis")(i / max(len(etas) - 1, 1)) for i, eta in enumerate(etas)}
    styles = {"decoupled": "-", "standard": "--"}
    figure, (accuracy, reward) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        adaptive = bool(r.get("adaptive"))
        label = f"eta={r['eta']}{' adaptive' if adaptive else ''} {r['objective']}"
        style = ":" if adaptive else styles[r["objective"]]
        kwargs = {"color": colours[r["eta"]], "linestyle": style, "label": label}
        steps, values = zip(*r["pass_at_1_curve"], strict=True)
        accuracy.plot(steps, values, marker="o", **kwargs)
        steps, rewards = zip(*r["reward_curve"], strict=True)
        reward.plot(steps, moving_mean(rewards, smooth), **kwargs)
    accuracy.set(xlabel="step", ylabel="held-out pass@1", title="Held-out accuracy")
    reward.set(xlabel="step", ylabel=f"training reward (mean of {smooth} steps)", title="Training reward")
    for axis in (accuracy, reward):
        axis.grid(alpha=0.3)
    accuracy.legend(fontsize=8)
    figure.suptitle(f"Staleness ablation: {result['config']}, decoupled vs standard PPO")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def cmd_bench_ablation(args: argparse.Namespace) -> int:
    import os

    from asyncrl.configs.loading import load_config

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    base = load_config(args.config, args.overrides)
    work = Path(args.work_dir) if args.work_dir else Path(base.work_dir) / f"{base.name}-ablation"
    settings = AblationSettings(
        etas=args.etas,
        objectives=args.objectives,
        adaptive_etas=args.adaptive,
        eval_every=args.eval_every,
        smooth=args.smooth,
        work_dir=work,
        json_path=Path(args.json) if args.json else work / "ablation.json",
        png_path=Path(args.png) if args.png else work / "ablation.png",
    )
    result = run_ablation(base, settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(result))
    print(f"curves: {settings.png_path}; figures: {settings.json_path}")
    return 1 if any("error" in r for r in result["runs"]) else 0
