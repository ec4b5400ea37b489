from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.tasks.algo.loss import decoupled_ppo_loss, reference_kl_loss


@dataclass
class Tokens:
    theta: np.ndarray
    prox: np.ndarray
    behav: np.ndarray
    adv: np.ndarray
    mask: np.ndarray


def make_tokens(seed: int, length: int, spread: float = 0.5) -> Tokens:
    rng = np.random.default_rng(seed)
    behav = -rng.exponential(1.5, length)
    prox = behav + rng.normal(0.0, spread, length)
    theta = prox + rng.normal(0.0, spread, length)
    adv = rng.normal(0.0, 1.0, length)
    mask = rng.random(length) < 0.7
    return Tokens(theta, prox, behav, adv, mask)


def reference_objective(
    tok: Tokens, eps_low: float, eps_high: float, cap: float | None, mode: str, decoupled: bool, norm: float | None
) -> float:
    """J written straight from the formula, token by token, in float64."""
    total = 0.0
    for t in range(len(tok.theta)):
        if not tok.mask[t]:
            continue
        if decoupled:
            u = np.exp(tok.theta[t] - tok.prox[t])
            w = np.exp(tok.prox[t] - tok.behav[t])
            if cap is not None and mode == "clamp":
                w = min(w, cap)
            if cap is not None and mode == "mask" and w > cap:
                continue
        else:
            u = np.exp(tok.theta[t] - tok.behav[t])
            w = 1.0
        clipped_u = min(max(u, 1.0 - eps_low), 1.0 + eps_high)
        total += w * min(u * tok.adv[t], clipped_u * tok.adv[t])
    n = norm if norm is not None else int(tok.mask.sum())
    return total / n if n > 0 else 0.0


def to_torch(tok: Tokens) -> dict[str, torch.Tensor]:
    return {
        "logp_theta": torch.tensor(tok.theta, dtype=torch.float64, requires_grad=True),
        "logp_prox": torch.tensor(tok.prox, dtype=torch.float64),
        "logp_behav": torch.tensor(tok.behav, dtype=torch.float64),
        "advantages": torch.tensor(tok.adv, dtype=torch.float64),
        "loss_mask": torch.tensor(tok.mask),
    }


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 64),
    eps_low=st.floats(0.05, 0.4),
    eps_high=st.one_of(st.none(), st.floats(0.05, 0.6)),
    cap=st.one_of(st.none(), st.floats(1.0, 5.0)),
    mode=st.sampled_from(["clamp", "mask"]),
    decoupled=st.booleans(),
    norm=st.one_of(st.none(), st.floats(1.0, 500.0)),
)
def test_matches_float64_reference(
    seed: int,
    length: int,
    eps_low: float,
    eps_high: float | None,
    cap: float | None,
    mode: str,
    decoupled: bool,
    norm: float | None,
) -> None:
    tok = make_tokens(seed, length, spread=0.6)
    loss, stats = decoupled_ppo_loss(
        **to_torch(tok),
        eps_clip=eps_low,
        eps_clip_high=eps_high,
        behav_weight_cap=cap,
        behav_cap_mode=mode,  # type: ignore[arg-type]
        decoupled=decoupled,
        token_normaliser=norm,
    )
    expected = -reference_objective(tok, eps_low, eps_low if eps_high is None else eps_high, cap, mode, decoupled, norm)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert int(stats.n_tokens) == int(tok.mask.sum())


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), length=st.integers(1, 64), cap=st.one_of(st.none(), st.floats(1.0, 5.0))
)  # w = 1 is never capped
def test_equal_prox_and_behav_reduces_to_standard_ppo(seed: int, length: int, cap: float | None) -> None:
    tok = make_tokens(seed, length)
    tok.prox = tok.behav.copy()
    dec_inputs, std_inputs = to_torch(tok), to_torch(tok)
    dec_loss, _ = decoupled_ppo_loss(**dec_inputs, eps_clip=0.2, behav_weight_cap=cap)
    std_loss, _ = decoupled_ppo_loss(**std_inputs, eps_clip=0.2, decoupled=False)
    dec_loss.backward()
    std_loss.backward()
    assert dec_loss.item() == pytest.approx(std_loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(dec_inputs["logp_theta"].grad, std_inputs["logp_theta"].grad, rtol=1e-12, atol=1e-15)


def test_standard_ppo_accepts_missing_prox_and_decoupled_does_not() -> None:
    inputs = to_torch(make_tokens(3, 16))
    inputs["logp_prox"] = None  # type: ignore[assignment]
    loss, _ = decoupled_ppo_loss(**inputs, eps_clip=0.2, decoupled=False)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="logp_prox"):
        decoupled_ppo_loss(**inputs, eps_clip=0.2)


@pytest.mark.parametrize("decoupled", [True, False])
def test_gradient_only_reaches_logp_theta(decoupled: bool) -> None:
    inputs = to_torch(make_tokens(7, 48))
    for name in ("logp_prox", "logp_behav", "advantages"):
        inputs[name] = inputs[name].clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(**inputs, eps_clip=0.2, behav_weight_cap=3.0, decoupled=decoupled)
    loss.backward()
    assert inputs["logp_theta"].grad is not None and inputs["logp_theta"].grad.abs().sum() > 0
    for name in ("logp_prox", "logp_behav", "advantages"):
        assert inputs[name].grad is None, name


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(2, 64), mode=st.sampled_from(["clamp", "mask"]))
def test_masked_tokens_contribute_nothing(seed: int, length: int, mode: str) -> None:
    tok = make_tokens(seed, length)
    tok.mask[0] = False
    base = to_torch(tok)
    loss_a, _ = decoupled_ppo_loss(**base, eps_clip=0.2, behav_weight_cap=2.0, behav_cap_mode=mode)  # type: ignore[arg-type]
    loss_a.backward()
    # Garbage on masked positions (huge log-ratios, NaN advantage) must not leak.
    garbage = Tokens(tok.theta.copy(), tok.prox.copy(), tok.behav.copy(), tok.adv.copy(), tok.mask)
    # exp(theta - prox) and exp(prox - behav) overflow float64 there.
    garbage.theta[~tok.mask] = 1000.0
    garbage.prox[~tok.mask] = -1000.0
    garbage.behav[~tok.mask] = -2000.0
    garbage.adv[~tok.mask] = np.nan
    noisy = to_torch(garbage)
    loss_b, _ = decoupled_ppo_loss(**noisy, eps_clip=0.2, behav_weight_cap=2.0, behav_cap_mode=mode)  # type: ignore[arg-type]
    loss_b.backward()
    assert loss_b.item() == loss_a.item()
    grad_a, grad_b = base["logp_theta"].grad, noisy["logp_theta"].grad
    assert grad_a is not None and grad_b is not None
    torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=0)
    assert bool((grad_b[~torch.tensor(tok.mask)] == 0).all())


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 32), sign=st.sampled_from([1.0, -1.0]), data=st.data())
def test_gradient_step_follows_advantage_sign(seed: int, length: int, sign: float, data: st.DataObject) -> None:
    tok = make_tokens(seed, length, spread=0.05)  # ratios near 1: inside the clip range
    t = data.draw(st.integers(0, length - 1))
    tok.mask[:] = False
    tok.mask[t] = True
    tok.adv[t] = sign * (abs(tok.adv[t]) + 0.1)
    inputs = to_torch(tok)
    loss, _ = decoupled_ppo_loss(**inputs, eps_clip=0.5)
    loss.backward()
    grad = inputs["logp_theta"].grad
    assert grad is not None
    # Gradient descent moves logp_theta by -lr * grad: up for A > 0, down for A < 0.
    assert np.sign(-grad[t].item()) == sign
    assert bool((grad[torch.arange(length) != t] == 0).all())
    stepped = to_torch(tok)
    with torch.no_grad():
        stepped["logp_theta"] -= 1e-3 * grad
    assert decoupled_ppo_loss(**stepped, eps_clip=0.5)[0].item() < loss.item()


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 64),
    cap=st.one_of(st.none(), st.floats(1.0, 4.0)),
    mode=st.sampled_from(["clamp", "mask"]),
)
def test_stats_are_in_range(seed: int, length: int, cap: float | None, mode: str) -> None:
    tok = make_tokens(seed, length, spread=0.8)
    _, stats = decoupled_ppo_loss(**to_torch(tok), eps_clip=0.2, behav_weight_cap=cap, behav_cap_mode=mode)  # type: ignore[arg-type]
    values = stats.as_floats()
    mask = tok.mask
    assert values["n_tokens"] == mask.sum()
    assert 0.0 <= values["clip_fraction"] <= 1.0
    assert 0.0 <= values["behav_capped_fraction"] <= 1.0
    weights = np.exp(tok.prox - tok.behav)[mask]
    if mask.any():
        assert values["behav_weight_max"] == pytest.approx(weights.max(), rel=1e-9)
        assert values["behav_weight_mean"] == pytest.approx(weights.mean(), rel=1e-9)
        assert values["approx_kl"] == pytest.approx((tok.prox - tok.theta)[mask].mean(), rel=1e-9, abs=1e-12)
        expected_capped = 0.0 if cap is None else float((weights > cap).mean())
        assert values["behav_capped_fraction"] == pytest.approx(expected_capped)
    if cap is not None and mode == "mask":
        assert values["n_active"] == mask.sum() - int((np.exp(tok.prox - tok.behav)[mask] > cap).sum())
    else:
        assert values["n_active"] == mask.sum()


def test_clip_fraction_counts_clipped_tokens() -> None:
    # Token 0: u = e^0.5 > 1.2 with A > 0 -> clipped; token 1: u = 1 -> not;
    # token 2: u = e^-0.5 < 0.8 with A < 0 -> clipped.
    theta = torch.tensor([0.5, 0.0, -0.5], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss, stats = decoupled_ppo_loss(theta, zeros, zeros, adv, torch.ones(3, dtype=torch.bool), eps_clip=0.2)
    assert stats.clip_fraction.item() == pytest.approx(2 / 3)
    loss.backward()
    assert theta.grad is not None
    assert theta.grad[0].item() == 0 and theta.grad[2].item() == 0 and theta.grad[1].item() != 0


def test_zero_masked_tokens_give_zero_loss_without_nan() -> None:
    inputs = to_torch(make_tokens(11, 8))
    inputs["loss_mask"] = torch.zeros(8, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(**inputs, eps_clip=0.2, behav_weight_cap=5.0)
    loss.backward()
    assert loss.item() == 0.0
    assert inputs["logp_theta"].grad is not None and bool((inputs["logp_theta"].grad == 0).all())
    assert all(np.isfinite(v) for v in stats.as_floats().values())


def test_bf16_inputs_compute_in_float32() -> None:
    tok = make_tokens(5, 32)
    inputs = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v) for k, v in to_torch(tok).items()}
    inputs["logp_theta"].requires_grad_(True)
    loss, _ = decoupled_ppo_loss(**inputs, eps_clip=0.2)
    assert loss.dtype == torch.float32
    loss.backward()
    assert inputs["logp_theta"].grad is not None and inputs["logp_theta"].grad.dtype == torch.bfloat16


def test_invalid_mode_lists_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"\['clamp', 'mask'\].*'truncate'"):
        decoupled_ppo_loss(**to_torch(make_tokens(0, 4)), eps_clip=0.2, behav_cap_mode="truncate")  # type: ignore[arg-type]


def test_shape_mismatch_names_shapes() -> None:
    inputs = to_torch(make_tokens(0, 4))
    inputs["advantages"] = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"advantages=\(5,\).*loss_mask=\(4,\)"):
        decoupled_ppo_loss(**inputs, eps_clip=0.2)
    two_d = {k: v.detach().reshape(2, 2) for k, v in to_torch(make_tokens(0, 4)).items()}
    with pytest.raises(ValueError, match=r"logp_theta=\(2, 2\)"):
        decoupled_ppo_loss(**two_d, eps_clip=0.2)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"eps_clip": 1.5}, "eps_clip"),
        ({"eps_clip": 0.2, "eps_clip_high": -0.1}, "eps_clip_high"),
        ({"eps_clip": 0.2, "behav_weight_cap": 0.0}, "behav_weight_cap"),
        ({"eps_clip": 0.2, "token_normaliser": 0.0}, "token_normaliser"),
    ],
)
def test_bad_hyperparameters_raise(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        decoupled_ppo_loss(**to_torch(make_tokens(0, 4)), **kwargs)  # type: ignore[arg-type]


def test_the_reference_kl_is_zero_at_the_reference_and_its_gradient_pulls_theta_back() -> None:
    ref = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    mask = torch.tensor([1, 1, 1, 0])
    at_ref = ref.clone().requires_grad_(True)
    loss, mean_kl = reference_kl_loss(at_ref, ref, mask, kl_coef=0.1)
    loss.backward()
    assert float(loss) == 0.0 and float(mean_kl) == 0.0
    assert at_ref.grad is not None and torch.all(at_ref.grad == 0)

    theta = torch.tensor([-0.5, -2.5, -0.5, 0.0], requires_grad=True)
    loss, mean_kl = reference_kl_loss(theta, ref, mask, kl_coef=0.1, token_normaliser=4.0)
    d = (ref - theta.detach())[:3]
    k3 = torch.exp(d) - d - 1
    assert float(loss) == pytest.approx(0.1 * float(k3.sum()) / 4.0)
    assert float(mean_kl) == pytest.approx(float(k3.mean()))
    loss.backward()
    assert theta.grad is not None
    assert theta.grad[0] > 0 > theta.grad[1]  # descent lowers theta above ref, raises it below
    assert theta.grad[2] == 0 and theta.grad[3] == 0  # at ref; outside the mask


def test_the_reference_kl_refuses_a_negative_coefficient_and_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        reference_kl_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), kl_coef=-0.1)
    with pytest.raises(ValueError, match="logp_ref"):
        reference_kl_loss(torch.zeros(2), torch.zeros(3), torch.ones(2), kl_coef=0.1)
