"""pass@k against hand-computed cases, and the per-task figures."""

from __future__ import annotations

import pytest

from asyncrl.tasks.reward.pass_at_k import pass_at_k, task_figures


def test_pass_at_k_matches_hand_computed_cases() -> None:
    # n=4, c=1: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; pass@1 = 1/4
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=5, c=2: pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n - c < k: every draw of k holds it
    for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)


def test_task_figures_per_task_with_k_only_where_enough_samples() -> None:
    groups = [
        ("math", [1.0, 0.0, 0.0, 0.0]),
        ("math", [1.0, 1.0, 0.0, 0.0]),
        ("code", [1.0, 0.5, 0.0, 0.0]),  # 0.5: a program that passed half its tests is not correct
        ("code", [0.0, 0.0]),
    ]
    figures = task_figures(groups, ks=[2, 4])
    assert figures["reward_mean/math"] == pytest.approx(3 / 8)
    assert figures["pass_at_1/math"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert figures["pass_at_2/math"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    assert figures["pass_at_4/math"] == 1.0
    assert figures["reward_mean/code"] == pytest.approx(1.5 / 6)
    assert figures["pass_at_1/code"] == pytest.approx((1 / 4 + 0) / 2)
    assert figures["pass_at_4/code"] == pytest.approx(1.0)  # only the 4-sample prompt counts
    assert figures["prompts/code"] == 2.0
    assert set(figures) == {f"{name}/{task}" for task in ("math", "code")
                            for name in ("reward_mean", "prompts", "pass_at_1", "pass_at_2", "pass_at_4")}
