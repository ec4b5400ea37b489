"""The promotion gate: does a run's candidate beat the registered model's incumbent
(``models:/<name>@best``) on the same held-out prompts by more than noise?

Both are evaluated in one evaluation (one server, the same P prompts, n samples each), which
gives each prompt p a score s_p = c_p / n per model. With the paired differences
d_p = s_p(candidate) - s_p(incumbent):

    gain      = (1 / P) * sum_p d_p
    gain*_b   = (1 / P) * sum_i d_(p_bi),  the P prompts p_bi drawn with replacement, b = 1..B
    p-value   = (1 + #{b : gain*_b <= min_gain}) / (B + 1)
    interval  = [q_(1-c)(gain*), q_c(gain*)]   (c = confidence; its lower end is the one-sided bound)

The candidate is promoted when p-value <= 1 - c (its gain exceeds ``min_gain`` with
confidence c) and no task's mean difference is below ``-max_task_regression``. Pairing by
prompt removes the between-prompt variance that dominates two separate evaluations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asyncrl.configs.pipeline import PromotionConfig
from asyncrl.storage.evaluations import EvalResult

PROMOTED = "promoted"
REJECTED = "rejected"


@dataclass(frozen=True)
class BootstrapResult:
    gain: float
    lower: float
    upper: float
    p_value: float


def paired_bootstrap(
    differences: Sequence[float], min_gain: float, confidence: float, resamples: int, seed: int
) -> BootstrapResult:
    """The paired bootstrap of the module docstring over the per-prompt ``differences``."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        raise ValueError("paired bootstrap: no prompts to compare")
    rng = np.random.default_rng(seed)
    gains = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    return BootstrapResult(
        gain=float(d.mean()),
        lower=float(np.quantile(gains, 1.0 - confidence)),
        upper=float(np.quantile(gains, confidence)),
        p_value=float((1 + np.count_nonzero(gains <= min_gain)) / (resamples + 1)),
    )


@dataclass(frozen=True)
class TaskComparison:
    task: str
    prompts: int
    incumbent: float
    candidate: float

    @property
    def gain(self) -> float:
        return self.candidate - self.incumbent


@dataclass(frozen=True)
class PromotionDecision:
    """What the gate decided and on which figures; ``incumbent`` is None for a model's first
    version (nothing to compare with: promoted)."""

    promoted: bool
    reason: str
    candidate: str
    """``models:/<name>/<number>`` of the candidate."""
    incumbent: str | None = None
    candidate_pass_at_1: float | None = None
    incumbent_pass_at_1: float | None = None
    bootstrap: BootstrapResult | None = None
    tasks: tuple[TaskComparison, ...] = ()
    prompts: int = 0
    samples_per_prompt: int = 0
    settings: PromotionConfig | None = None

    @property
    def outcome(self) -> str:
        return PROMOTED if self.promoted else REJECTED

    def message(self) -> str:
        """One line: the outcome, both scores, the gain with its interval and p-value."""
        if self.incumbent is None or self.bootstrap is None:
            return f"{self.candidate} {self.outcome}: {self.reason}"
        b = self.bootstrap
        return (
            f"{self.candidate} {self.outcome} over {self.incumbent}: pass@1 {_pct(self.candidate_pass_at_1)} vs "
            f"{_pct(self.incumbent_pass_at_1)}, gain {_pts(b.gain)} [{_pts(b.lower)}, {_pts(b.upper)}], "
            f"p = {b.p_value:.3f}; {self.reason}"
        )

    def markdown(self) -> str:
        """The decision as a markdown report: scores, interval, p-value and the per-task table."""
        lines = [f"# Promotion: {self.candidate} {self.outcome}", "", self.reason, ""]
        if self.incumbent is None or self.bootstrap is None or self.settings is None:
            return "\n".join(lines)
        b, s = self.bootstrap, self.settings
        lines += [
            f"Incumbent {self.incumbent} against candidate {self.candidate}, one evaluation: "
            f"{self.prompts} held-out prompts x {self.samples_per_prompt} samples.",
            "",
            "| | pass@1 |",
            "|---|---|",
            f"| incumbent {self.incumbent} | {_pct(self.incumbent_pass_at_1)} |",
            f"| candidate {self.candidate} | {_pct(self.candidate_pass_at_1)} |",
            f"| gain | {_pts(b.gain)} |",
            f"| interval [q{1 - s.confidence:.2f}, q{s.confidence:.2f}] of {s.resamples} paired bootstrap resamples "
            f"| [{_pts(b.lower)}, {_pts(b.upper)}] |",
            f"| p-value of gain <= {_pts(s.min_gain)} | {b.p_value:.4f} (promote at <= {1 - s.confidence:.2f}) |",
            "",
            f"| task | prompts | incumbent | candidate | gain (may not be below {_pts(-s.max_task_regression)}) |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {t.task} | {t.prompts} | {_pct(t.incumbent)} | {_pct(t.candidate)} | {_pts(t.gain)} |" for t in self.tasks
        ]
        return "\n".join(lines)

    def tags(self) -> dict[str, str]:
        """The figures as MLflow model version tags (``asyncrl.promotion.*``)."""
        tags = {"asyncrl.promotion": self.outcome, "asyncrl.promotion.reason": self.reason[:500]}
        if self.incumbent is not None:
            tags["asyncrl.promotion.incumbent"] = self.incumbent
        if self.bootstrap is not None:
            b = self.bootstrap
            tags.update({
                "asyncrl.promotion.pass_at_1": f"{self.candidate_pass_at_1:.4f}",
                "asyncrl.promotion.incumbent_pass_at_1": f"{self.incumbent_pass_at_1:.4f}",
                "asyncrl.promotion.gain": f"{b.gain:.4f}",
                "asyncrl.promotion.interval": f"[{b.lower:.4f}, {b.upper:.4f}]",
                "asyncrl.promotion.p_value": f"{b.p_value:.4f}",
            })  # fmt: skip
        return tags


def first_version(candidate: str) -> PromotionDecision:
    """The decision for a registered model's first version: no incumbent, promoted."""
    return PromotionDecision(promoted=True, reason="no incumbent: the model's first version", candidate=candidate)


def task_comparisons(incumbent: EvalResult, candidate: EvalResult) -> tuple[TaskComparison, ...]:
    """Per task, the mean per-prompt score of each model over that task's prompts."""
    by_task: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for task, inc, cand in zip(candidate.prompt_tasks, incumbent.prompt_pass, candidate.prompt_pass, strict=True):
        by_task[task].append((inc, cand))
    return tuple(
        TaskComparison(task, len(pairs), sum(i for i, _ in pairs) / len(pairs), sum(c for _, c in pairs) / len(pairs))
        for task, pairs in sorted(by_task.items())
    )


def decide(
    incumbent: EvalResult,
    candidate: EvalResult,
    names: tuple[str, str],
    settings: PromotionConfig,
    seed: int,
) -> PromotionDecision:
    """The gate of the module docstring for two evaluations of the same prompts; ``names`` are
    (incumbent, candidate) as ``models:/<name>/<number>``. ``ValueError`` when the two were
    not evaluated on the same prompts (their task lists differ) or hold no per-prompt scores."""
    if not candidate.prompt_pass or incumbent.prompt_tasks != candidate.prompt_tasks:
        raise ValueError(
            f"promotion: {names[0]} and {names[1]} must be evaluated on the same held-out prompts with per-prompt "
            f"scores ({len(incumbent.prompt_tasks)} and {len(candidate.prompt_tasks)} prompts)"
        )
    differences = [c - i for i, c in zip(incumbent.prompt_pass, candidate.prompt_pass, strict=True)]
    result = paired_bootstrap(differences, settings.min_gain, settings.confidence, settings.resamples, seed)
    tasks = task_comparisons(incumbent, candidate)
    regressed = [t for t in tasks if t.gain < -settings.max_task_regression]
    significant = result.p_value <= 1.0 - settings.confidence
    if regressed:
        reason = "rejected: " + ", ".join(f"task {t.task} regressed by {-100 * t.gain:.1f} pts" for t in regressed)
        reason += f" (more than max_task_regression, {100 * settings.max_task_regression:.1f} pts)"
    elif not significant:
        reason = (
            f"rejected: the gain is not above min_gain {_pts(settings.min_gain)} with confidence "
            f"{settings.confidence:.2f} (p = {result.p_value:.3f})"
        )
    else:
        reason = f"promoted: the gain is above min_gain {_pts(settings.min_gain)} with confidence {settings.confidence:.2f}"
    return PromotionDecision(
        promoted=significant and not regressed,
        reason=reason,
        candidate=names[1],
        incumbent=names[0],
        candidate_pass_at_1=candidate.pass_at_1,
        incumbent_pass_at_1=incumbent.pass_at_1,
        bootstrap=result,
        tasks=tasks,
        prompts=candidate.prompts,
        samples_per_prompt=candidate.samples_per_prompt,
        settings=settings,
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _pts(value: float) -> str:
    return f"{100 * value:+.1f} pts"
