"""Behaviour-weight corrections of the decoupled objective against float64 references computed
by hand (plain Python floats) on one packed micro-batch of samples of different lengths."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from asyncrl.configs.trainer import TrainerConfig
from asyncrl.tasks.trainer.batch import TokenSequence, pack_sequences, pad_sequences
from asyncrl.tasks.algo.corrections import correct_behaviour_weight, sequence_index, token_log_weight
from asyncrl.tasks.algo.loss import decoupled_ppo_loss
from asyncrl.tasks.trainer.rl_settings import RLSettings

EPS = 0.2
# Per sample: (prompt length, per output token log w_t = log pi_prox - log pi_behav). Sample 0
# holds a few large token weights, sample 1 is one token, sample 2 small weights, sample 3
# weights near 1: every level and bound below sees tokens and samples on both sides.
LOG_W = [
    (2, [0.9, -0.1, 0.3]),
    (3, [-1.2]),
    (1, [-0.4, -0.6, 0.05, -0.5]),
    (2, [0.02, -0.03, 0.01, 0.04, -0.02]),
]
BOUNDS = {  # level -> (floor, cap) with hits on both sides
    "token": (0.6, 1.5),
    "sequence_product": (0.5, 2.0),
    "sequence_geo_mean": (0.7, 1.2),
}


def _example() -> dict[str, Any]:
    """Packed micro-batch tensors (float64) and the per-sample Python values they hold."""
    rng = random.Random(7)
    sequences = [TokenSequence(tuple(range(1, p + 1)), tuple(range(10, 10 + len(w)))) for p, w in LOG_W]
    batch = pack_sequences(sequences, list(range(len(sequences))))
    samples = []
    for _, log_w in LOG_W:
        behav = [-rng.uniform(0.2, 3.0) for _ in log_w]
        prox = [b + lw for b, lw in zip(behav, log_w)]
        theta = [p + rng.uniform(-0.4, 0.4) for p in prox]  # u spans both sides of the clip range
        samples.append({"behav": behav, "prox": prox, "theta": theta, "adv": rng.choice([-1.3, 0.7, 1.1])})

    def expand(key: str) -> torch.Tensor:
        values = [torch.tensor(s[key], dtype=torch.float64) for s in samples]
        full = torch.full((batch.slots,), -7.0, dtype=torch.float64)  # arbitrary off the mask
        full[batch.loss_mask] = torch.cat(values)
        return full

    adv = torch.zeros(batch.slots, dtype=torch.float64)
    adv[batch.loss_mask] = torch.cat([torch.full((len(s["behav"]),), s["adv"], dtype=torch.float64) for s in samples])
    return {"batch": batch, "samples": samples, "theta": expand("theta"), "prox": expand("prox"),
            "behav": expand("behav"), "adv": adv}  # fmt: skip


def _reference(samples: list[dict[str, Any]], level: str, low: float | None, high: float | None, mode: str):
    """(loss, d loss / d logp_theta per output token, corrected weights, outside flags, raw
    level weights rho) by hand, per output token in layout order."""
    n_tokens = sum(len(s["behav"]) for s in samples)
    total, grads, weights, outside_flags, raw = 0.0, [], [], [], []
    for s in samples:
        log_w = [p - b for p, b in zip(s["prox"], s["behav"])]
        if level == "token":
            rhos = [math.exp(lw) for lw in log_w]
        elif level == "sequence_product":
            rhos = [math.exp(sum(log_w))] * len(log_w)
        else:
            rhos = [math.exp(sum(log_w) / len(log_w))] * len(log_w)
        raw += rhos
        for t, rho in enumerate(rhos):
            outside = (high is not None and rho > high) or (low is not None and rho < low)
            outside_flags.append(outside)
            if mode == "clamp":
                lower, upper = -math.inf if low is None else low, math.inf if high is None else high
                used, keep = min(max(rho, lower), upper), True
            else:
                used, keep = rho, not outside
            u = math.exp(s["theta"][t] - s["prox"][t])
            a = s["adv"]
            unclipped, clipped = u * a, min(max(u, 1 - EPS), 1 + EPS) * a
            if keep:
                total += used * min(unclipped, clipped)
                grads.append(-used * (unclipped if unclipped <= clipped else 0.0) / n_tokens)
                weights.append(used)
            else:
                grads.append(0.0)
                weights.append(0.0)
    return -total / n_tokens, grads, weights, outside_flags, raw


CASES = [
    (level, mode, sided)
    for level in ("token", "sequence_product", "sequence_geo_mean")
    for mode in ("mask", "clamp")
    for sided in ("upper", "two-sided")
]


@pytest.mark.parametrize(("level", "mode", "sided"), CASES)
def test_loss_and_gradient_match_the_float64_reference(level: str, mode: str, sided: str) -> None:
    ex = _example()
    batch = ex["batch"]
    floor, cap = BOUNDS[level]
    low = floor if sided == "two-sided" else None
    theta = ex["theta"].clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        theta, ex["prox"], ex["behav"], ex["adv"], batch.loss_mask,
        eps_clip=EPS, behav_weight_cap=cap, behav_cap_mode=mode, behav_weight_floor=low,
        behav_weight_level=level, sequence_index=sequence_index(batch.loss_mask, batch.output_lengths),
    )  # fmt: skip
    loss.backward()
    expected_loss, expected_grads, _, outside, raw = _reference(ex["samples"], level, low, cap, mode)
    assert loss.dtype == torch.float64
    assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-12, abs=1e-15)
    got_grads = theta.grad[batch.loss_mask].tolist()
    assert got_grads == pytest.approx(expected_grads, rel=1e-12, abs=1e-15)
    assert theta.grad[~batch.loss_mask].abs().max() == 0.0
    # The case exercises its bounds: some tokens above the cap, some inside, with a floor some below it.
    assert 0 < sum(outside) < len(outside) and any(rho > cap for rho in raw)
    assert low is None or any(rho < low for rho in raw)
    assert float(stats.behav_capped_fraction) == pytest.approx(sum(outside) / len(outside), rel=1e-12)
    kept = len(outside) - (sum(outside) if mode == "mask" else 0)
    assert int(stats.n_active) == kept


@pytest.mark.parametrize(("level", "mode", "sided"), CASES)
def test_corrected_weights_match_the_float64_reference(level: str, mode: str, sided: str) -> None:
    ex = _example()
    batch = ex["batch"]
    floor, cap = BOUNDS[level]
    low = floor if sided == "two-sided" else None
    log_w = token_log_weight(ex["prox"], ex["behav"], batch.loss_mask)
    weight, keep, outside = correct_behaviour_weight(
        log_w, batch.loss_mask, level=level, low=low, high=cap, mode=mode,
        index=sequence_index(batch.loss_mask, batch.output_lengths),
    )  # fmt: skip
    _, _, expected_weights, expected_outside, _ = _reference(ex["samples"], level, low, cap, mode)
    assert weight[batch.loss_mask].tolist() == pytest.approx(expected_weights, rel=1e-12, abs=0.0)
    assert outside[batch.loss_mask].tolist() == expected_outside
    assert keep[batch.loss_mask].tolist() == [not o or mode == "clamp" for o in expected_outside]
    assert not bool(weight[~batch.loss_mask].any()) and not bool(keep[~batch.loss_mask].any())


def test_sequence_mask_drops_whole_samples() -> None:
    ex = _example()
    batch = ex["batch"]
    floor, cap = BOUNDS["sequence_geo_mean"]
    log_w = token_log_weight(ex["prox"], ex["behav"], batch.loss_mask)
    _, keep, _ = correct_behaviour_weight(
        log_w, batch.loss_mask, level="sequence_geo_mean", low=floor, high=cap, mode="mask",
        index=sequence_index(batch.loss_mask, batch.output_lengths),
    )  # fmt: skip
    per_sample = [set(k.tolist()) for k in batch.split(keep)]
    assert all(len(flags) == 1 for flags in per_sample)  # all or nothing per sample
    assert {True, False} <= {next(iter(flags)) for flags in per_sample}


def test_defaults_are_areal_s_token_mask_above_5() -> None:
    trainer = TrainerConfig()
    settings = RLSettings.from_config(trainer, max_staleness=None)
    got = (settings.behav_weight_level, settings.behav_weight_cap, settings.behav_cap_mode, settings.behav_weight_floor)
    assert got == ("token", 5.0, "mask", None)
    assert RLSettings() == settings


def test_defaults_equal_the_token_level_upper_mask_written_out() -> None:
    """The default call (token level, cap, mask, no floor) gives the pre-correction formula
    J = sum_t [w_t <= cap] w_t min(u A, clip(u) A) / N exactly."""
    ex = _example()
    batch = ex["batch"]
    mask = batch.loss_mask
    loss, _ = decoupled_ppo_loss(
        ex["theta"], ex["prox"], ex["behav"], ex["adv"], mask, eps_clip=EPS, behav_weight_cap=1.5
    )
    w = torch.exp(torch.where(mask, ex["prox"] - ex["behav"], torch.zeros(())))
    active = mask & ~(w > 1.5)
    u = torch.exp(ex["theta"] - ex["prox"])
    surrogate = torch.minimum(u * ex["adv"], torch.clamp(u, 1 - EPS, 1 + EPS) * ex["adv"])
    expected = -torch.where(active, w * surrogate, torch.zeros(())).sum() / mask.sum()
    assert float(loss) == float(expected)


def test_sequence_index_follows_the_layout() -> None:
    sequences = [TokenSequence((1, 2), (3, 4, 5)), TokenSequence((6,), (7,)), TokenSequence((8, 9, 10), (11, 12))]
    for batch in (pack_sequences(sequences, [2, 0, 1]), pad_sequences(sequences, [2, 0, 1])):
        index = sequence_index(batch.loss_mask, batch.output_lengths)
        assert index[batch.loss_mask].tolist() == [0, 0, 1, 1, 1, 2]
        assert bool((index[~batch.loss_mask] == -1).all())
    with pytest.raises(ValueError, match="output lengths sum to 5"):
        sequence_index(batch.loss_mask, (3, 1, 1))


def test_sequence_level_needs_the_index() -> None:
    ex = _example()
    with pytest.raises(ValueError, match="sequence_index"):
        decoupled_ppo_loss(ex["theta"], ex["prox"], ex["behav"], ex["adv"], ex["batch"].loss_mask, eps_clip=EPS,
                           behav_weight_level="sequence_product")  # fmt: skip


def test_invalid_settings_name_the_field() -> None:
    ex = _example()
    args = (ex["theta"], ex["prox"], ex["behav"], ex["adv"], ex["batch"].loss_mask)
    with pytest.raises(ValueError, match=r"behav_weight_level must be one of \['token', 'sequence_product'"):
        decoupled_ppo_loss(*args, eps_clip=EPS, behav_weight_level="sentence")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="behav_weight_floor must be > 0 and below behav_weight_cap"):
        decoupled_ppo_loss(*args, eps_clip=EPS, behav_weight_cap=2.0, behav_weight_floor=3.0)
    with pytest.raises(ValidationError, match="trainer.behav_weight_floor: 0.5 needs trainer.behav_weight_cap"):
        TrainerConfig(behav_weight_floor=0.5, behav_weight_cap=None)
    with pytest.raises(ValidationError, match="behav_weight_floor"):
        TrainerConfig(behav_weight_floor=1.5)
    with pytest.raises(ValidationError, match="behav_weight_level"):
        TrainerConfig(behav_weight_level="sentence")  # type: ignore[arg-type]
    two_sided = TrainerConfig(behav_weight_floor=0.5, behav_weight_cap=2.0, behav_weight_level="sequence_geo_mean")
    settings = RLSettings.from_config(two_sided, max_staleness=None)
    assert (settings.behav_weight_floor, settings.behav_weight_cap, settings.behav_weight_level) == (
        0.5, 2.0, "sequence_geo_mean"
    )  # fmt: skip
