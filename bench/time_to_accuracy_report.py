"""The time-to-accuracy bench's output: a markdown table, a PNG of held-out pass@1 against wall
seconds (and against steps), and the same figures in an MLflow run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.bench.e2e_report import format_staleness


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "not reached" if value is None else format(value * scale, spec)


def format_table(result: Mapping[str, Any]) -> str:
    """One line per arm: time to target, speed-up, pass@1 at equal steps and equal wall time,
    RL wall time, staleness; then the headline."""
    lines = [
        f"{result['config']}: {result['steps']} steps of {result['batch_groups']} groups x {result['n_samples']} samples, "
        f"outputs up to {result['max_new_tokens']} tokens; seeds {result['settings']['seeds']}; pass@1 over "
        f"{result['eval_prompts']} held-out prompts x {result['eval_samples']} samples, centred mean over "
        f"{result['settings']['smooth']} evaluated versions",
        f"start {100 * result['start_pass_at_1']:.1f}%, synchronous final {100 * result['sync_final_pass_at_1']:.1f}% "
        f"({result['sync_gain_points']:+.1f} points); target {100 * result['target_pass_at_1']:.1f}% "
        f"(start + {result['settings']['target_fraction']:.0%} of the synchronous gain); generation "
        f"{_num(result.get('sync_generation_share'), '.0%')} of the synchronous run's busy time",
        "",
        "| arm | time to target (s) | per seed (s) | speed-up | pass@1 equal steps | gap (points) "
        f"| pass@1 at {result['equal_wall_s']:.0f} s | RL wall (s) | overlap | staleness (value:samples) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in result["arms"]:
        seeds = ", ".join("-" if t is None else f"{t:.0f}" for t in arm["time_to_target_s_per_seed"])
        walls = arm.get("rl_wall_s_per_seed") or []
        overlaps = [o.get("overlap_factor") for o in arm.get("overlap_per_seed") or [] if o.get("overlap_factor")]
        lines.append(
            f"| {arm['label']} | {_num(arm['time_to_target_s'], '.0f')} | {seeds} | "
            f"{_num(arm['time_to_target_speedup'], '.2f')} | {100 * arm['pass_at_1_equal_steps']:.1f}% | "
            f"{arm['equal_steps_gap_points']:+.1f} | {_num(arm['pass_at_1_equal_wall'], '.1f', 100.0)}"
            f"{'' if arm['pass_at_1_equal_wall'] is None else '%'} | "
            f"{'/'.join(f'{w:.0f}' for w in walls)} | "
            f"{'/'.join(f'{o:.2f}' for o in overlaps) or 'n/a'} | {format_staleness(arm['staleness_counts'])} |"
        )
    lines += [
        "",
        f"best asynchronous arm: {result['best_arm']}; time_to_target_speedup "
        f"{_num(result['time_to_target_speedup'], '.2f')}; equal_steps_gap_points "
        f"{_num(result['equal_steps_gap_points'], '+.1f')}",
    ]
    return "\n".join(lines)


def plot_curves(result: Mapping[str, Any], path: Path) -> Path:
    """Two panels: held-out pass@1 against wall seconds since the RL phase began, and against
    steps; one curve per arm (mean over seeds, band = one standard deviation), the target as a
    dashed line, each arm's time to target as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms: Sequence[Mapping[str, Any]] = result["arms"]
    colours = plt.get_cmap("tab10")
    figure, (by_wall, by_step) = plt.subplots(1, 2, figsize=(12, 4.6))
    for index, arm in enumerate(arms):
        curve = arm["curve"]
        colour = "black" if arm["eta"] == 0 else colours(index % 10)
        style = "--" if arm["objective"] == "standard" else "-"
        low = [m - s for m, s in zip(curve["pass_at_1_smoothed"], curve["pass_at_1_std"], strict=True)]
        high = [m + s for m, s in zip(curve["pass_at_1_smoothed"], curve["pass_at_1_std"], strict=True)]
        steps = [v - curve["versions"][0] for v in curve["versions"]]
        for axis, xs in ((by_wall, curve["wall_s"]), (by_step, steps)):
            axis.plot(xs, curve["pass_at_1_smoothed"], style, color=colour, marker="o", markersize=3, label=arm["label"])
            axis.fill_between(xs, low, high, color=colour, alpha=0.12)
        if arm["time_to_target_s"] is not None:
            by_wall.plot([arm["time_to_target_s"]], [result["target_pass_at_1"]], "x", color=colour, markersize=10)
    for axis in (by_wall, by_step):
        axis.axhline(result["target_pass_at_1"], color="grey", linestyle=":", label="target")
        axis.grid(alpha=0.3)
    by_wall.set(xlabel="wall seconds since the RL phase began", ylabel="held-out pass@1 (mean over seeds, smoothed)",
                title="Time to accuracy")  # fmt: skip
    by_step.set(xlabel="step", ylabel="held-out pass@1", title="Accuracy at equal steps")
    by_wall.legend(fontsize=8)
    speedup = result.get("time_to_target_speedup")
    figure.suptitle(
        f"{result['config']}: best asynchronous arm {result['best_arm']}, "
        + ("target not reached" if speedup is None else f"{speedup:.2f}x sooner than synchronous")
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def mlflow_metrics(result: Mapping[str, Any]) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) pairs: each arm's smoothed pass@1 at step = version and at step =
    whole wall seconds (``pass_at_1_by_wall_s/<arm>``), and at step 0 the headline and every
    arm's time to target and speed-up (an arm that never reached the target has none)."""
    batches: list[tuple[int, dict[str, float]]] = []
    summary: dict[str, float] = {}
    for key in ("time_to_target_speedup", "equal_steps_gap_points", "target_pass_at_1", "start_pass_at_1",
                "sync_final_pass_at_1"):  # fmt: skip
        if result.get(key) is not None:
            summary[key] = float(result[key])
    for arm in result["arms"]:
        curve, label = arm["curve"], arm["label"]
        for version, wall, value in zip(curve["versions"], curve["wall_s"], curve["pass_at_1_smoothed"], strict=True):
            batches.append((version - curve["versions"][0], {f"pass_at_1/{label}": value}))
            batches.append((int(round(wall)), {f"pass_at_1_by_wall_s/{label}": value}))
        for key in ("time_to_target_s", "time_to_target_speedup", "equal_steps_gap_points", "pass_at_1_equal_steps"):
            if arm.get(key) is not None:
                summary[f"{key}/{label}"] = float(arm[key])
    return [(0, summary), *batches]


def log_to_mlflow(result: Mapping[str, Any], tracking_uri: str, experiment: str, files: Sequence[Path]) -> str:
    """One MLflow run named ``time-to-accuracy`` with :func:`mlflow_metrics`, the bench's
    settings as params and ``files`` (the JSON and PNG) as artifacts; returns its run id."""
    import shutil
    import tempfile

    from asyncrl.tasks.tracking.mlflow_run import RunLineage

    lineage = RunLineage.start(tracking_uri, experiment, "time-to-accuracy", dict(result["settings"]),
                               tags={"asyncrl.bench": "time-to-accuracy"})  # fmt: skip
    try:
        for step, metrics in mlflow_metrics(result):
            lineage.log_metrics(step, metrics)
        with tempfile.TemporaryDirectory() as folder:
            for file in files:
                shutil.copy(file, Path(folder) / Path(file).name)
            lineage.log_files(Path(folder), "time-to-accuracy")
    except BaseException:
        lineage.end("FAILED")
        raise
    lineage.end()
    return lineage.run_id
