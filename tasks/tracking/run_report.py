"""What a finished run leaves in its MLflow run for a person to read: the reward curve, the
pass@1 curves and the staleness histogram as PNG (``plots/``), and the run's summary
(``summary.json``). Made once, when the run ends, from the run's own metric history, so no
step rewrites an artifact that grows with the run.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.configs.secrets import redact
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.lineage_recorder import EVAL_PREFIX

PLOTS_DIR = "plots"
SUMMARY_ARTIFACT = "summary.json"
REWARD_PNG = "reward.png"
PASS_AT_1_PNG = "pass_at_1.png"
STALENESS_PNG = "staleness.png"
_STALENESS_KEY = re.compile(r"^staleness/count_(\d+)$")
DURING_TRAINING_KEY = f"{EVAL_PREFIX}pass_at_1"
"""Held-out pass@1 evaluated during training (step = weight version; ``lineage_recorder``)."""


@dataclass
class RunCurves:
    """The series the plots draw: per step the mean reward and the trained pass@1 of each task;
    held-out pass@1 per evaluated weight version (overall under ``"all"``, then per task);
    held-out pass@1 evaluated during training (``eval/pass_at_1`` per weight version);
    trained samples per staleness (in updates) summed over all steps."""

    reward: dict[int, float] = field(default_factory=dict)
    train_pass_at_1: dict[str, dict[int, float]] = field(default_factory=dict)
    eval_pass_at_1: dict[str, dict[int, float]] = field(default_factory=dict)
    during_training_pass_at_1: dict[int, float] = field(default_factory=dict)
    staleness: dict[int, float] = field(default_factory=dict)


def _by_step(lineage: RunLineage, key: str) -> dict[int, float]:
    """Metric ``key`` of the run by step; a step logged twice (on the run and on its version's
    LoggedModel, or again by a resumed run) keeps its last value, so nothing counts twice."""
    history = sorted(lineage.client.get_metric_history(lineage.run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


def read_curves(lineage: RunLineage, evaluations: Mapping[int, Mapping[str, Any]]) -> RunCurves:
    """The run's curves from its metric history (one read per metric key drawn) and
    ``evaluations`` (weight version -> an evaluation result as JSON: ``pass_at_1`` and
    ``by_task``)."""
    keys = lineage.client.get_run(lineage.run_id).data.metrics.keys()
    curves = RunCurves(
        reward=_by_step(lineage, "reward_mean") if "reward_mean" in keys else {},
        during_training_pass_at_1=_by_step(lineage, DURING_TRAINING_KEY) if DURING_TRAINING_KEY in keys else {},
    )
    for key in sorted(keys):
        if key.startswith("pass_at_1/"):
            curves.train_pass_at_1[key.removeprefix("pass_at_1/")] = _by_step(lineage, key)
        elif match := _STALENESS_KEY.match(key):
            curves.staleness[int(match.group(1))] = sum(_by_step(lineage, key).values())
    for version, result in sorted(evaluations.items()):
        curves.eval_pass_at_1.setdefault("all", {})[version] = float(result["pass_at_1"])
        for name, value in dict(result.get("by_task", {})).items():
            if name.startswith("pass_at_1/"):
                curves.eval_pass_at_1.setdefault(name.removeprefix("pass_at_1/"), {})[version] = float(value)
    return curves


def write_plots(curves: RunCurves, out_dir: Path, title: str) -> list[Path]:
    """The three PNGs of ``curves`` in ``out_dir`` (matplotlib, Agg backend); an empty series
    draws an empty panel that says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(figure: Any, name: str) -> None:  # noqa: ANN401 - a matplotlib Figure
        figure.tight_layout()
        figure.savefig(out_dir / name, dpi=100)
        plt.close(figure)
        written.append(out_dir / name)

    figure, axis = plt.subplots(figsize=(7, 4))
    if curves.reward:
        steps = sorted(curves.reward)
        axis.plot(steps, [curves.reward[s] for s in steps], marker=".", label="mean reward of the step's samples")
        axis.legend(fontsize=8)
    else:
        axis.text(0.5, 0.5, "no trained step", ha="center", transform=axis.transAxes)
    axis.set(xlabel="RL step", ylabel="reward", title=f"{title}: training reward")
    axis.grid(alpha=0.3)
    save(figure, REWARD_PNG)

    figure, axis = plt.subplots(figsize=(7, 4))
    for task, series in curves.train_pass_at_1.items():
        steps = sorted(series)
        axis.plot(steps, [series[s] for s in steps], alpha=0.6, label=f"trained samples, {task} (x = step)")
    for task, series in curves.eval_pass_at_1.items():
        versions = sorted(series)
        axis.plot(versions, [series[v] for v in versions], marker="o", linestyle="--",
                  label=f"held-out, {task} (x = weight version)")  # fmt: skip
    if curves.during_training_pass_at_1:
        series = curves.during_training_pass_at_1
        versions = sorted(series)
        axis.plot(versions, [series[v] for v in versions], marker="s", linestyle=":",
                  label="held-out subset during training (x = weight version)")  # fmt: skip
    if not curves.train_pass_at_1 and not curves.eval_pass_at_1 and not curves.during_training_pass_at_1:
        axis.text(0.5, 0.5, "no pass@1 recorded", ha="center", transform=axis.transAxes)
    else:
        axis.legend(fontsize=8)
    axis.set(xlabel="RL step / weight version", ylabel="pass@1", ylim=(-0.02, 1.02), title=f"{title}: pass@1")
    axis.grid(alpha=0.3)
    save(figure, PASS_AT_1_PNG)

    figure, axis = plt.subplots(figsize=(7, 4))
    if curves.staleness:
        values = sorted(curves.staleness)
        axis.bar(values, [curves.staleness[v] for v in values])
        axis.set_xticks(values)
    else:
        axis.text(0.5, 0.5, "no trained sample", ha="center", transform=axis.transAxes)
    axis.set(xlabel="staleness (updates between sampling and training)", ylabel="trained samples",
             title=f"{title}: staleness of trained samples")  # fmt: skip
    axis.grid(alpha=0.3, axis="y")
    save(figure, STALENESS_PNG)
    return written


def log_run_report(
    lineage: RunLineage,
    title: str,
    evaluations: Mapping[int, Mapping[str, Any]] | None = None,
    summary: Mapping[str, Any] | None = None,
) -> list[str]:
    """Log the plots (``plots/*.png``) and, when given, the summary (``summary.json``, through
    the one redaction rule) to the run; the run-relative paths written."""
    curves = read_curves(lineage, evaluations or {})
    logged = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-report-") as tmp:
        plots = write_plots(curves, Path(tmp) / PLOTS_DIR, title)
        lineage.log_files(Path(tmp) / PLOTS_DIR, PLOTS_DIR)
        logged += [f"{PLOTS_DIR}/{path.name}" for path in plots]
    if summary is not None:
        lineage.log_text(json.dumps(redact(dict(summary)), indent=1), SUMMARY_ARTIFACT)
        logged.append(SUMMARY_ARTIFACT)
    return logged
