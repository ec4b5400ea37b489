"""What a run shows in the Prefect UI: a progress artifact updated per trained step, and a
markdown report (reward curve, throughput and the held-out pass@1 evaluated during
training) when training ends.

Both need a flow-run context; the plain-Python runners (``train_run``)
take the progress callback from here only when a flow calls them.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from asyncrl.tasks.pipeline.progress import read_progress

if TYPE_CHECKING:
    from asyncrl.storage.evaluations import EvalResult

SPARK_LEVELS = "▁▂▃▄▅▆▇█"
CURVE_ROWS = 25
"""Most steps listed in the report's table (evenly spaced, first and last always in)."""


def artifact_key(run_name: str, suffix: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from the run name."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run"
    return f"{base}-{suffix}"


@contextmanager
def stage_progress_artifact(work_dir: Path, run_name: str, stage: str, every_s: float = 2.0) -> Iterator[None]:
    """While the block runs a pipeline stage inside a task or flow run, mirror the stage's entry
    of ``progress.json`` (:class:`~asyncrl.tasks.pipeline.progress.StageProgress`) into the
    progress artifact ``<run>-<stage>-progress``: every ``every_s`` seconds when it moved, and
    once at the end, so the stage itself knows nothing of Prefect."""
    artifact_id = create_progress_artifact(
        progress=0.0, key=artifact_key(run_name, f"{stage}-progress"), description=f"{stage} of run {run_name}"
    )
    done = threading.Event()

    def percent() -> float | None:
        state = read_progress(work_dir).get(stage)
        return None if state is None else state.percent

    def mirror() -> None:
        shown = 0.0
        while not done.wait(every_s):
            now = percent()
            if now is not None and now != shown:
                update_progress_artifact(artifact_id, progress=now)
                shown = now

    thread = threading.Thread(target=mirror, name=f"{stage}-progress-artifact", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        final = percent()
        if final is not None:
            update_progress_artifact(artifact_id, progress=final)


class StepProgressArtifact:
    """A Prefect progress artifact of the RL steps; call it with ``(step, total)``.

    progress = 100 * step / total (percent).
    """

    def __init__(self, run_name: str, total_steps: int) -> None:
        self.total_steps = total_steps
        self.artifact_id = create_progress_artifact(
            progress=0.0,
            key=artifact_key(run_name, "rl-progress"),
            description=f"RL steps of run {run_name} (of {total_steps})",
        )

    def __call__(self, step: int, total: int) -> None:
        update_progress_artifact(self.artifact_id, progress=min(100.0, 100.0 * step / max(total, 1)))


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the series' min and max
    (level = round((v - min) / (max - min) * 7)); NaN shows as a space."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = high - low
    top = len(SPARK_LEVELS) - 1
    return "".join(
        " " if not math.isfinite(v) else SPARK_LEVELS[0 if span == 0 else round((v - low) / span * top)]
        for v in values
    )


def _sampled_steps(steps: list[int], rows: int) -> list[int]:
    if len(steps) <= rows:
        return steps
    picks = {steps[round(i * (len(steps) - 1) / (rows - 1))] for i in range(rows)}
    return sorted(picks)


def _per_task_training_rows(
    steps: list[int],
    step_metrics: Mapping[int, Mapping[str, float]],
    rollout: Mapping[str, float],
    fmt: Callable[[Any, str], str],
) -> list[str]:
    """Per task: trained pass@1 of the first and last step that saw it, and the rollout's mean reward."""
    tasks = sorted({name.split("/", 1)[1] for s in steps for name in step_metrics[s] if name.startswith("pass_at_1/")})
    rows = []
    for task in tasks:
        seen = [s for s in steps if f"pass_at_1/{task}" in step_metrics[s]]
        first, last = step_metrics[seen[0]][f"pass_at_1/{task}"], step_metrics[seen[-1]][f"pass_at_1/{task}"]
        rows.append(
            f"| {task}: pass@1 first -> last step; rollout mean reward | {fmt(first, '.3f')} -> {fmt(last, '.3f')}; "
            f"{fmt(rollout.get(f'reward_mean/{task}'), '.3f')} |"
        )
    return rows


MISMATCH_FIGURES = (
    ("mismatch/abs_logp_diff_mean", "mean abs log-prob difference", ".2e"),
    ("mismatch/k3_kl", "k3 KL", ".2e"),
    ("mismatch/ratio_outside_frac", "ratios outside [0.5, 2]", ".3f"),
)


def _mismatch_rows(
    steps: list[int], step_metrics: Mapping[int, Mapping[str, float]], fmt: Callable[[Any, str], str]
) -> list[str]:
    """Train/inference mismatch (``mismatch/*``, :mod:`asyncrl.tasks.algo.mismatch`): each
    figure's worst step (the one the mismatch canary would have flagged first), the lowest
    importance-weight ESS, and per staleness the largest behaviour-weight p99 over steps."""

    def worst(name: str, highest: bool = True) -> tuple[int, float] | None:
        seen = [(s, float(step_metrics[s][name])) for s in steps
                if step_metrics[s].get(name) is not None and math.isfinite(float(step_metrics[s][name]))]  # fmt: skip
        if not seen:
            return None
        return max(seen, key=lambda x: x[1]) if highest else min(seen, key=lambda x: x[1])

    parts = []
    for name, label, spec in MISMATCH_FIGURES:
        found = worst(name)
        parts.append(f"{label} {fmt(found[1], spec)} (step {found[0]})" if found else f"{label} n/a")
    rows = [f"| train/inference mismatch, current-version tokens, worst step | {'; '.join(parts)} |"]
    ess = worst("mismatch/ess", highest=False)
    ess_text = f"{fmt(ess[1], '.3f')} (step {ess[0]})" if ess else "n/a"
    rows.append(f"| importance-weight ESS, lowest step | {ess_text} |")
    prefix = "mismatch/behav_weight_p99/staleness_"
    stalenesses = sorted({int(n[len(prefix):]) for s in steps for n in step_metrics[s] if n.startswith(prefix)})
    tails = []
    for staleness in stalenesses:
        found = worst(f"{prefix}{staleness}")
        if found:
            tails.append(f"staleness {staleness}: {fmt(found[1], '.3f')}")
    rows.append(f"| behaviour-weight p99, highest step, per staleness | {'; '.join(tails) or 'n/a'} |")
    return rows


def _training_eval_lines(evaluations: Mapping[int, EvalResult], failure: str | None) -> list[str]:
    """Evaluation during training: the pass@1 curve as a sparkline and a table of weight
    version -> held-out pass@1 (overall, then per task when there are several), at most
    ``CURVE_ROWS`` versions (evenly spaced, first and last always in); a failed evaluator's reason."""
    if not evaluations and failure is None:
        return []
    versions = sorted(evaluations)
    lines = ["", "## Held-out pass@1 during training", ""]
    if failure is not None:
        lines += [f"The evaluator failed and the run went on without it: {failure}", ""]
    if not versions:
        return lines
    first = evaluations[versions[0]]
    tasks = sorted({name for r in evaluations.values() for name in r.by_task if name.startswith("pass_at_1/")})
    tasks = tasks if len(tasks) > 1 else []
    lines += [
        f"{len(versions)} versions, {first.prompts} held-out prompts x {first.samples_per_prompt} samples each: "
        f"`{sparkline([evaluations[v].pass_at_1 for v in versions])}`",
        "",
        "| weight version | held-out pass@1 |" + "".join(f" {name.replace('pass_at_1/', '')} |" for name in tasks),
        "| ---: | ---: |" + " ---: |" * len(tasks),
    ]
    for version in _sampled_steps(versions, CURVE_ROWS):
        result = evaluations[version]
        by_task = "".join(
            f" {100 * result.by_task[name]:.1f}% |" if name in result.by_task else " n/a |" for name in tasks
        )
        lines.append(f"| {version} | {100 * result.pass_at_1:.1f}% |{by_task}")
    return lines


def training_report_markdown(
    run_name: str,
    step_metrics: Mapping[int, Mapping[str, float]],
    rollout: Mapping[str, float],
    wall_s: float,
    final_version: int,
    evaluations: Mapping[int, EvalResult] | None = None,
    evaluation_failure: str | None = None,
    overlap: Mapping[str, float] | None = None,
) -> str:
    """The reward curve (``reward_mean`` per step), throughput, the overlap of generation and
    training (:func:`_overlap_rows`), train/inference mismatch (:func:`_mismatch_rows`) of a
    finished run, and the held-out pass@1 evaluated during training (:func:`_training_eval_lines`).

    Trained tokens/s per step = sequence tokens / (proximal + update time) (the trainer's
    ``tokens_per_s``); the run figure is the mean over steps.
    """
    steps = sorted(step_metrics)
    rewards = [float(step_metrics[s].get("reward_mean", math.nan)) for s in steps]
    throughputs = [float(step_metrics[s].get("tokens_per_s", math.nan)) for s in steps]
    finite_tp = [t for t in throughputs if math.isfinite(t)]

    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)

    lines = [
        f"# RL run `{run_name}`",
        "",
        f"Reward curve (mean reward per step, {len(steps)} steps): `{sparkline(rewards)}`",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| steps | {len(steps)} |",
        f"| final weight version | {final_version} |",
        f"| wall time | {wall_s:.0f} s |",
        f"| reward, first -> last step | {fmt(rewards[0] if rewards else None, '.3f')} -> "
        f"{fmt(rewards[-1] if rewards else None, '.3f')} |",
        f"| trained tokens/s (mean over steps) | {fmt(sum(finite_tp) / len(finite_tp) if finite_tp else None, '.0f')} |",
        *_per_task_training_rows(steps, step_metrics, rollout, fmt),
        f"| generated tokens/s | {fmt(rollout.get('gen_tokens_per_s'), '.0f')} |",
        f"| reward wait per group (s) | "
        f"{fmt(rollout['reward_wait_s'] / rollout['groups_written'] if rollout.get('groups_written') and 'reward_wait_s' in rollout else None, '.3f')} |",
        f"| weight-sync stall fraction | {fmt(rollout.get('weight_sync_stall_fraction'), '.3f')} |",
        f"| groups written / admitted | {fmt(rollout.get('groups_written'), '.0f')} / {fmt(rollout.get('admitted'), '.0f')} |",
        *_overlap_rows(overlap or {}),
        *_mismatch_rows(steps, step_metrics, fmt),
        "",
        "| step | reward mean | staleness max | trained tokens/s | step time (s) | mean abs log-prob diff | k3 KL |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for step in _sampled_steps(steps, CURVE_ROWS):
        m = step_metrics[step]
        lines.append(
            f"| {step} | {fmt(m.get('reward_mean'), '.3f')} | {fmt(m.get('staleness_max'), '.0f')} | "
            f"{fmt(m.get('tokens_per_s'), '.0f')} | {fmt(m.get('step_time_s'), '.1f')} | "
            f"{fmt(m.get('mismatch/abs_logp_diff_mean'), '.2e')} | {fmt(m.get('mismatch/k3_kl'), '.2e')} |"
        )
    lines += _training_eval_lines(evaluations or {}, evaluation_failure)
    return "\n".join(lines)


def publish_training_report(
    run_name: str,
    step_metrics: Mapping[int, Mapping[str, float]],
    rollout: Mapping[str, float],
    wall_s: float,
    final_version: int,
    evaluations: Mapping[int, EvalResult] | None = None,
    evaluation_failure: str | None = None,
    overlap: Mapping[str, float] | None = None,
) -> None:
    """The training report as a Prefect markdown artifact (key ``<run>-rl-report``)."""
    create_markdown_artifact(
        training_report_markdown(run_name, step_metrics, rollout, wall_s, final_version, evaluations,
                                 evaluation_failure, overlap),  # fmt: skip
        key=artifact_key(run_name, "rl-report"),
        description=f"reward curve and throughput of run {run_name}",
    )


@dataclass(frozen=True)
class PipelineSummary:
    run: str
    steps: int
    final_version: int
    pass_at_1_before: float | None
    pass_at_1_after: float | None
    best_version: int | None
    registered_model: str | None
    registered_model_version: str | None
    wall_s: float
    train_wall_s: float
    mlflow_uri: str
    mlflow_run_id: str
    storage_root: str
    restarts: dict[str, int]
    stages: dict[str, str]
    """Stage -> how it ended this time (run or cached)."""
    by_task_before: dict[str, float] = field(default_factory=dict)
    by_task_after: dict[str, float] = field(default_factory=dict)
    """Held-out figures per task (``pass_at_1/<task>``, ``pass_at_<k>/<task>``, ``reward_mean/<task>``)
    of the first and the last evaluated version."""
    pass_at_1_during_training: dict[int, float] = field(default_factory=dict)
    """Weight version -> held-out pass@1 evaluated during training (``pipeline.eval_every``;
    on the subset ``pipeline.training_eval`` names, so not comparable with the figures above
    unless that is the whole held-out set)."""
    promotion: str | None = None
    """The promotion gate's decision in one line (:meth:`~asyncrl.tasks.pipeline.promotion.PromotionDecision.message`)."""
    overlap: dict[str, float] = field(default_factory=dict)
    """What asynchrony bought the RL phase: ``generation_busy_s``, ``training_busy_s``,
    ``rl_wall_s`` and ``overlap_factor`` = (generation busy + training busy) / RL wall time
    (:func:`~asyncrl.tasks.algo.overlap.overlap_figures`); empty when the RL phase did not run."""


def _overlap_rows(overlap: Mapping[str, float]) -> list[str]:
    """One row: the overlap factor = (generation busy + training busy) / RL wall time, with its
    three figures; none without figures or when nothing was measured (RL wall time 0)."""
    if not overlap.get("rl_wall_s"):
        return []
    return [
        f"| overlap factor (generation + training busy) / RL wall | {overlap['overlap_factor']:.2f} = "
        f"({overlap['generation_busy_s']:.0f} s + {overlap['training_busy_s']:.0f} s) / {overlap['rl_wall_s']:.0f} s |"
    ]


def _task_rows(
    before: Mapping[str, float], after: Mapping[str, float], pct: Callable[[float | None], str]
) -> list[str]:
    """One row per per-task pass@k figure (``pass_at_<k>/<task>``): before -> after RL."""
    names = sorted(name for name in {*before, *after} if name.startswith("pass_at_"))
    return [
        f"| held-out {name.replace('pass_at_', 'pass@').replace('/', ' of ')} | "
        f"{pct(before.get(name))} -> {pct(after.get(name))} |"
        for name in names
    ]


def _during_training_rows(curve: Mapping[int, float], pct: Callable[[float | None], str]) -> list[str]:
    """One row: the held-out pass@1 curve evaluated during training, as a sparkline and its ends."""
    if not curve:
        return []
    versions = sorted(curve)
    return [
        f"| held-out pass@1 during training (subset), v{versions[0]} -> v{versions[-1]} | "
        f"{pct(curve[versions[0]])} -> {pct(curve[versions[-1]])} `{sparkline([curve[v] for v in versions])}` |"
    ]


def summary_markdown(summary: PipelineSummary) -> str:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    return "\n".join(
        [
            f"# asyncrl run `{summary.run}`",
            "",
            "| figure | value |",
            "| --- | --- |",
            f"| held-out pass@1 before RL | {pct(summary.pass_at_1_before)} |",
            f"| held-out pass@1 after RL | {pct(summary.pass_at_1_after)} |",
            *_task_rows(summary.by_task_before, summary.by_task_after, pct),
            *_during_training_rows(summary.pass_at_1_during_training, pct),
            f"| steps | {summary.steps} |",
            f"| final weight version | {summary.final_version} |",
            f"| wall time | {summary.wall_s:.0f} s (RL {summary.train_wall_s:.0f} s) |",
            *_overlap_rows(summary.overlap),
            f"| stages | {', '.join(f'{k}: {v}' for k, v in summary.stages.items())} |",
            f"| component restarts | {sum(summary.restarts.values())} |",
            *([f"| promotion | {summary.promotion} |"] if summary.promotion else []),
            f"| MLflow | {summary.mlflow_uri}, run {summary.mlflow_run_id} |",
            f"| storage | {summary.storage_root} |",
        ]
    )
