from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from asyncrl.tasks.algo.advantages import group_advantages, scale_negative_advantages, token_advantages

METHODS = ["grpo", "drgrpo", "rloo"]


def reward_matrices(min_n: int = 1) -> st.SearchStrategy[np.ndarray]:
    shapes = st.tuples(st.integers(1, 6), st.integers(min_n, 8))
    # Rule-based rewards are mostly a few discrete values; mix those with continuous ones.
    elements = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.1]), st.floats(-10, 10, allow_nan=False, width=64))
    return shapes.flatmap(lambda shape: arrays(np.float64, shape, elements=elements))


@settings(max_examples=200, deadline=None)
@given(rewards=reward_matrices(min_n=2), method=st.sampled_from(METHODS))
def test_zero_mean_per_group(rewards: np.ndarray, method: str) -> None:
    adv = group_advantages(torch.from_numpy(rewards), method).numpy()  # type: ignore[arg-type]
    assert adv.shape == rewards.shape
    # grpo divides rounding error of size ulp(max|r|) by std + eps >= 1e-6.
    scale = max(1.0, float(np.abs(rewards).max())) * (1e3 if method == "grpo" else 1.0)
    np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-9 * scale)


@settings(max_examples=200, deadline=None)
@given(rewards=reward_matrices(min_n=2))
def test_grpo_has_unit_population_std(rewards: np.ndarray) -> None:
    adv = group_advantages(torch.from_numpy(rewards), "grpo", eps=0.0).numpy()
    for g in range(rewards.shape[0]):
        if rewards[g].std(ddof=0) < 1e-6:  # too close to equal for a well-conditioned ratio
            continue
        assert adv[g].std(ddof=0) == pytest.approx(1.0, rel=1e-6)
    with_eps = group_advantages(torch.from_numpy(rewards), "grpo").numpy()
    spread = rewards.std(axis=1, ddof=0)
    expected = (rewards - rewards.mean(axis=1, keepdims=True)) / (spread[:, None] + 1e-6)
    np.testing.assert_allclose(
        with_eps, np.where(np.ptp(rewards, axis=1, keepdims=True) == 0, 0.0, expected), atol=1e-7
    )


@settings(max_examples=100, deadline=None)
@given(
    value=st.floats(-100, 100, allow_nan=False),
    groups=st.integers(1, 4),
    n=st.integers(2, 16),
    method=st.sampled_from(METHODS),
    eps=st.sampled_from([0.0, 1e-6]),
)
def test_equal_rewards_give_exact_zeros(value: float, groups: int, n: int, method: str, eps: float) -> None:
    rewards = torch.full((groups, n), value, dtype=torch.float64)
    adv = group_advantages(rewards, method, eps=eps)  # type: ignore[arg-type]
    assert bool((adv == 0).all())


def test_equal_rewards_that_do_not_average_exactly() -> None:
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]], dtype=torch.float32)
    for method in METHODS:
        assert bool((group_advantages(rewards, method) == 0).all()), method  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(rewards=reward_matrices(min_n=2))
def test_rloo_equals_leave_one_out_loop(rewards: np.ndarray) -> None:
    adv = group_advantages(torch.from_numpy(rewards), "rloo").numpy()
    groups, n = rewards.shape
    expected = np.zeros_like(rewards)
    for g in range(groups):
        for i in range(n):
            others = [rewards[g, j] for j in range(n) if j != i]
            expected[g, i] = rewards[g, i] - sum(others) / len(others)
    np.testing.assert_allclose(adv, expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(rewards=reward_matrices())
def test_drgrpo_is_centred_rewards(rewards: np.ndarray) -> None:
    adv = group_advantages(torch.from_numpy(rewards), "drgrpo").numpy()
    np.testing.assert_allclose(adv, rewards - rewards.mean(axis=1, keepdims=True), atol=1e-9)


def test_single_sample_group() -> None:
    rewards = torch.tensor([[1.0], [0.0]])
    assert bool((group_advantages(rewards, "grpo") == 0).all())
    with pytest.raises(ValueError, match="n=1"):
        group_advantages(rewards, "rloo")


@pytest.mark.parametrize(
    ("rewards", "needle"),
    [
        (torch.zeros(4), r"\(G, n\).*\(4,\)"),
        (torch.zeros(2, 3, 4), r"\(2, 3, 4\)"),
        (torch.zeros(2, 3, dtype=torch.long), "floating"),
        (torch.tensor([[0.0, float("nan")]]), r"rewards\[0, 1\]"),
    ],
)
def test_bad_rewards_raise(rewards: torch.Tensor, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        group_advantages(rewards, "grpo")


def test_unknown_method_lists_allowed() -> None:
    with pytest.raises(ValueError, match=r"\['grpo', 'drgrpo', 'rloo'\].*'ppo'"):
        group_advantages(torch.zeros(2, 2), "ppo")  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(data=st.data(), n=st.integers(0, 8))
def test_token_advantages_broadcast(data: st.DataObject, n: int) -> None:
    seq = torch.tensor(data.draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n)), dtype=torch.float64)
    out_lens = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    prompt_lens = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    packed = token_advantages(seq, out_lens).tolist()
    assert packed == [float(seq[k]) for k in range(n) for _ in range(out_lens[k])]
    laid_out = token_advantages(seq, out_lens, prompt_lengths=prompt_lens).tolist()
    expected: list[float] = []
    for k in range(n):
        expected += [0.0] * prompt_lens[k] + [float(seq[k])] * out_lens[k]
    assert laid_out == expected


def test_token_advantages_errors() -> None:
    seq = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="output_lengths has 3 entries but seq_advantages has 2"):
        token_advantages(seq, [1, 2, 3])
    with pytest.raises(ValueError, match=r"output_lengths\[1\] must be >= 0, got -2"):
        token_advantages(seq, [1, -2])
    with pytest.raises(TypeError, match=r"prompt_lengths\[0\] must be an integer"):
        token_advantages(seq, [1, 2], prompt_lengths=[1.5, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"1-D.*\(2, 1\)"):
        token_advantages(seq.reshape(2, 1), [1, 2])


def test_negative_advantages_are_scaled_and_positive_ones_kept():
    adv = torch.tensor([[1.5, -0.5, 0.0, -1.0]])
    assert scale_negative_advantages(adv, 0.25).tolist() == [[1.5, -0.125, 0.0, -0.25]]
    assert scale_negative_advantages(adv, 1.0).tolist() == adv.tolist()
    assert scale_negative_advantages(adv, 0.0).tolist() == [[1.5, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("scale", [-0.1, 1.5])
def test_a_negative_advantage_scale_outside_zero_one_is_refused(scale):
    with pytest.raises(ValueError, match="negative advantage scale must be in"):
        scale_negative_advantages(torch.zeros(1, 2), scale)
