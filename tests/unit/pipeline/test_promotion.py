"""The promotion gate's statistics and decision: a paired bootstrap over per-prompt scores,
and a per-task regression check, on hand-made evaluations whose answer is known."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from asyncrl.configs.pipeline import PromotionConfig
from asyncrl.storage.evaluations import EvalResult
from asyncrl.tasks.pipeline.promotion import decide, first_version, paired_bootstrap

NAMES = ("models:/m/1", "models:/m/2")


def result(scores: list[float], tasks: list[str] | None = None, version: int = 0) -> EvalResult:
    tasks = tasks or ["math"] * len(scores)
    return EvalResult(
        version=version, pass_at_1=sum(scores) / len(scores), prompts=len(scores), samples_per_prompt=4,
        mean_output_tokens=10.0, prompt_pass=tuple(scores), prompt_tasks=tuple(tasks),
    )  # fmt: skip


def test_the_bootstrap_of_a_constant_difference_is_that_difference() -> None:
    b = paired_bootstrap([0.25] * 50, min_gain=0.0, confidence=0.9, resamples=500, seed=0)
    assert b.gain == b.lower == b.upper == pytest.approx(0.25)
    assert b.p_value == pytest.approx(1 / 501)  # no resample at or below min_gain


def test_the_bootstrap_interval_matches_the_normal_approximation() -> None:
    rng = np.random.default_rng(1)
    d = rng.normal(0.05, 0.2, size=400)
    b = paired_bootstrap(d.tolist(), min_gain=0.0, confidence=0.9, resamples=4000, seed=2)
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert b.gain == pytest.approx(d.mean())
    assert b.lower == pytest.approx(d.mean() - 1.2816 * se, abs=0.25 * se)
    assert b.upper == pytest.approx(d.mean() + 1.2816 * se, abs=0.25 * se)
    assert b.p_value == pytest.approx(0.5 * (1 + math.erf(-d.mean() / se / np.sqrt(2))), abs=0.01)


def test_a_clear_gain_is_promoted_and_named_in_every_figure() -> None:
    incumbent = result([0.25, 0.5, 0.0, 0.25] * 25)
    candidate = result([0.75, 0.75, 0.5, 0.5] * 25)
    decision = decide(incumbent, candidate, NAMES, PromotionConfig(), seed=0)
    assert decision.promoted and decision.outcome == "promoted"
    assert decision.bootstrap is not None and decision.bootstrap.gain == pytest.approx(0.375)
    assert "models:/m/2 promoted over models:/m/1" in decision.message()
    report = decision.markdown()
    assert "| incumbent models:/m/1 | 25.0% |" in report and "| candidate models:/m/2 | 62.5% |" in report
    assert "| math | 100 | 25.0% | 62.5% | +37.5 pts |" in report
    assert decision.tags()["asyncrl.promotion"] == "promoted"


@pytest.mark.parametrize(("gain", "reason"), [(0.0, "rejected: the gain is not above"), (-0.25, "rejected: task math regressed by 25.0 pts")])
def test_no_gain_or_a_regression_is_rejected(gain: float, reason: str) -> None:
    scores = [0.25, 0.5, 0.75, 0.5] * 25
    decision = decide(result(scores), result([s + gain for s in scores]), NAMES, PromotionConfig(), seed=0)
    assert not decision.promoted and decision.reason.startswith(reason)
    regression = decide(result(scores), result([s + gain for s in scores]), NAMES, PromotionConfig(max_task_regression=1.0), seed=0)
    assert not regression.promoted and regression.reason.startswith("rejected: the gain is not above")


def test_a_gain_within_the_noise_is_rejected() -> None:
    rng = np.random.default_rng(3)
    incumbent = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=50).tolist()
    candidate = [min(1.0, s + 0.25) if i % 10 == 0 else s for i, s in enumerate(rng.permutation(incumbent))]
    decision = decide(result(incumbent), result(candidate), NAMES, PromotionConfig(confidence=0.95), seed=0)
    assert decision.bootstrap is not None and decision.bootstrap.lower < 0 < decision.bootstrap.upper
    assert not decision.promoted


def test_min_gain_raises_the_bar() -> None:
    incumbent = result([0.5] * 100)
    candidate = result([0.5 + (0.25 if i % 2 else 0.0) for i in range(100)])  # +12.5 points
    assert decide(incumbent, candidate, NAMES, PromotionConfig(min_gain=0.05), seed=0).promoted
    assert not decide(incumbent, candidate, NAMES, PromotionConfig(min_gain=0.2), seed=0).promoted


def test_one_task_regressing_blocks_a_promotion_the_mean_would_allow() -> None:
    tasks = ["math"] * 80 + ["code"] * 20
    incumbent = result([0.25] * 80 + [0.75] * 20, tasks)
    candidate = result([0.75] * 80 + [0.5] * 20, tasks)  # math +50, code -25 points
    decision = decide(incumbent, candidate, NAMES, PromotionConfig(max_task_regression=0.1), seed=0)
    assert not decision.promoted
    assert "task code regressed by 25.0 pts" in decision.reason
    assert decide(incumbent, candidate, NAMES, PromotionConfig(max_task_regression=0.3), seed=0).promoted


def test_evaluations_of_other_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="same held-out prompts"):
        decide(result([0.5] * 10), result([0.5] * 11), NAMES, PromotionConfig(), seed=0)
    with pytest.raises(ValueError, match="same held-out prompts"):
        decide(result([0.5] * 2, ["math", "code"]), result([0.5] * 2, ["code", "math"]), NAMES, PromotionConfig(), seed=0)


def test_the_first_version_is_promoted_without_a_comparison() -> None:
    decision = first_version("models:/m/1")
    assert decision.promoted and decision.incumbent is None and "first version" in decision.message()


def test_promotion_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="confidence"):
        PromotionConfig(confidence=1.5)


def test_a_run_s_untrained_start_is_no_candidate(tmp_path: Path) -> None:
    """A scheduled run starts from the incumbent's weights without SFT: its version 0 is the
    incumbent, so it is no candidate; with an SFT warm start version 0 was trained by the run."""
    from asyncrl.configs.loading import config_from_dict
    from asyncrl.tasks.pipeline.registration import is_untrained_start

    raw = {"name": "n", "model": {"path": str(tmp_path / "m")}, "data": {"train_path": str(tmp_path / "t.parquet")},
           "storage": {"root": str(tmp_path / "s")}, "work_dir": str(tmp_path / "w")}  # fmt: skip
    nightly = config_from_dict(raw)
    assert is_untrained_start(nightly, 0) and not is_untrained_start(nightly, 1)
    warm_started = config_from_dict({**raw, "pipeline": {"sft_steps": 2}})
    assert not is_untrained_start(warm_started, 0)


def test_behind_the_gate_a_night_s_candidate_is_its_best_trained_version(tmp_path: Path) -> None:
    """A night whose start (the incumbent's weights) scored best still offers its best trained
    version to the gate, which rejects it with the figures; with no ``@best`` (no gate) or
    nothing trained, every evaluated version competes."""
    from asyncrl.configs.loading import config_from_dict
    from asyncrl.storage.evaluations import EvalResult
    from asyncrl.tasks.pipeline.registration import candidate_results

    raw = {"name": "n", "model": {"path": str(tmp_path / "m")}, "data": {"train_path": str(tmp_path / "t.parquet")},
           "storage": {"root": str(tmp_path / "s")}, "work_dir": str(tmp_path / "w")}  # fmt: skip
    nightly = config_from_dict(raw)
    results = {v: EvalResult(version=v, pass_at_1=p, prompts=4, samples_per_prompt=1, mean_output_tokens=8.0)
               for v, p in ((0, 0.7), (1, 0.1), (2, 0.3))}  # fmt: skip
    best = lambda rs: max(rs, key=lambda r: (r.pass_at_1, r.version)).version  # noqa: E731
    assert best(candidate_results(nightly, results, gated=True)) == 2
    assert best(candidate_results(nightly, results, gated=False)) == 0
    assert best(candidate_results(nightly, {0: results[0]}, gated=True)) == 0  # nothing trained: no candidate
    warm_started = config_from_dict({**raw, "pipeline": {"sft_steps": 2}})
    assert best(candidate_results(warm_started, results, gated=True)) == 0  # its version 0 was trained (SFT)
