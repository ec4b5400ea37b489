"""Decoupled PPO objective over packed token tensors (AReaL, arXiv 2505.24298).

All tensors are 1-D of shape (T,), T = total tokens of a micro-batch (prompt and
padding tokens included, excluded from the objective by ``loss_mask``, and so are the
environment tokens of multi-turn samples: ``loss_mask`` holds the model tokens only, see
:mod:`.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.tasks.algo.corrections import (
    BEHAV_CAP_MODES,
    BEHAV_WEIGHT_LEVELS,
    BehavCapMode,
    BehavWeightLevel,
    correct_behaviour_weight,
    token_log_weight,
)

__all__ = ["BEHAV_CAP_MODES", "BehavCapMode", "BehavWeightLevel", "PPOLossStats", "decoupled_ppo_loss", "reference_kl_loss"]


@dataclass(frozen=True)
class PPOLossStats:
    """Diagnostics of one :func:`decoupled_ppo_loss` call, as detached 0-d tensors.

    Tensors rather than floats so the trainer decides when to synchronise with
    the device (``as_floats()`` does it once for all fields).

    - ``n_tokens``: tokens with ``loss_mask`` true (before cap masking).
    - ``n_active``: tokens that contribute to the objective (after cap masking).
    - ``clip_fraction``: over contributing tokens, the fraction where
      ``min(u*A, clip(u)*A)`` selects the clipped branch strictly
      (``clip(u)*A < u*A``, i.e. the token gets no gradient).
    - ``behav_weight_mean`` / ``behav_weight_max``: w = pi_prox / pi_behav over
      ``loss_mask`` tokens, before clamping or masking (1 for standard PPO).
    - ``behav_capped_fraction``: fraction of ``loss_mask`` tokens whose corrected-level
      weight rho is outside [floor, cap] (masked out in "mask" mode, truncated in "clamp"
      mode; 0 without bounds; see :mod:`.corrections`).
    - ``approx_kl``: mean over ``loss_mask`` tokens of logp_ref - logp_theta,
      ref = proximal policy if decoupled else behaviour policy.
    """

    n_tokens: torch.Tensor
    n_active: torch.Tensor
    clip_fraction: torch.Tensor
    behav_weight_mean: torch.Tensor
    behav_weight_max: torch.Tensor
    behav_capped_fraction: torch.Tensor
    approx_kl: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        return {name: float(value.item()) for name, value in vars(self).items()}


def decoupled_ppo_loss(
    logp_theta: torch.Tensor,
    logp_prox: torch.Tensor | None,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    behav_weight_cap: float | None = None,
    behav_cap_mode: BehavCapMode = "mask",
    behav_weight_floor: float | None = None,
    behav_weight_level: BehavWeightLevel = "token",
    sequence_index: torch.Tensor | None = None,
    decoupled: bool = True,
    token_normaliser: float | None = None,
) -> tuple[torch.Tensor, PPOLossStats]:
    """Decoupled PPO loss (negated objective) and its diagnostics.

    Three policies, each given as per-token log-probabilities of the sampled tokens:
    ``logp_theta`` from pi_theta (the parameters being optimised; the only input
    that receives gradient), ``logp_prox`` from pi_prox (the proximal policy: the
    trainer's parameters before this update step, recomputed by a forward pass)
    and ``logp_behav`` from pi_behav (the rollout weights that sampled each token).

        J     = sum_t m'_t * rho'_t * min(u_t * A_t, clip(u_t, 1 - eps_low, 1 + eps_high) * A_t) / N
        loss  = -J
        u_t   = exp(logp_theta_t - logp_prox_t)
        w_t   = exp(logp_prox_t - logp_behav_t)       (a constant: no gradient)
        rho'_t, m'_t = the corrected behaviour weight and mask (:mod:`.corrections`)

    eps_low = ``eps_clip``, eps_high = ``eps_clip_high`` (defaults to eps_clip).
    m_t = ``loss_mask``.  The correction: rho_t = w_t (``behav_weight_level`` "token"),
    or the sample's product W_s = prod_{k in s} w_k ("sequence_product") or geometric
    mean G_s = exp(mean_{k in s} log w_k) ("sequence_geo_mean"), over its ``loss_mask``
    tokens, i.e. its model tokens (``sequence_index`` gives each position's sample,
    :func:`.corrections.sequence_index`);
    bounds [low, high] = [``behav_weight_floor`` or 0, ``behav_weight_cap`` or inf];
    mode "clamp" (truncate) uses rho'_t = min(max(rho_t, low), high) and m'_t = m_t;
    mode "mask" uses rho'_t = rho_t and m'_t = 0 where rho_t is outside the bounds. The
    defaults (token level, no floor) with cap 5 in mode "mask" are AReaL's.
    N = ``token_normaliser`` if given (e.g. the mask count of a whole mini-batch
    split into micro-batches), else the number of ``loss_mask`` tokens before cap
    masking; with N = 0 the loss is 0.

    ``decoupled=False`` is standard PPO: u_t = exp(logp_theta_t - logp_behav_t),
    rho'_t = 1, no correction (``logp_prox`` may then be None and the correction
    arguments are ignored).  ``logp_prox``, ``logp_behav`` and ``advantages`` are
    detached.  Computation is in at least float32.
    """
    if behav_cap_mode not in BEHAV_CAP_MODES:
        raise ValueError(f"behav_cap_mode must be one of {list(BEHAV_CAP_MODES)}, got {behav_cap_mode!r}")
    if behav_weight_level not in BEHAV_WEIGHT_LEVELS:
        raise ValueError(f"behav_weight_level must be one of {list(BEHAV_WEIGHT_LEVELS)}, got {behav_weight_level!r}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_hyperparameters(eps_clip, eps_high, behav_weight_cap, token_normaliser, behav_weight_floor)
    if decoupled and logp_prox is None:
        raise ValueError("logp_prox is required when decoupled=True")
    _check_shapes(logp_theta, logp_prox, logp_behav, advantages, loss_mask)

    dtype = torch.promote_types(logp_theta.dtype, torch.float32)
    theta = logp_theta.to(dtype)
    behav = logp_behav.detach().to(dtype)
    ref = logp_prox.detach().to(dtype) if decoupled and logp_prox is not None else behav
    mask = loss_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=theta.device)

    if decoupled:
        # Padding tokens may hold arbitrary log-probs; zero their log-ratio so
        # exp() cannot overflow there and poison the backward pass with 0 * inf.
        log_w = token_log_weight(ref, behav, mask)  # (T,)
        weight = torch.exp(log_w)  # (T,) raw token weights w_t, for the stats
        weight_used, active, capped = correct_behaviour_weight(
            log_w,
            mask,
            level=behav_weight_level,
            low=behav_weight_floor,
            high=behav_weight_cap,
            mode=behav_cap_mode,
            index=sequence_index,
        )
    else:
        weight = torch.ones_like(theta)
        capped = torch.zeros_like(mask)
        active = mask
        weight_used = torch.where(active, weight, zero)

    adv = torch.where(active, advantages.detach().to(dtype), zero)
    ratio = torch.exp(torch.where(active, theta - ref, zero))  # u, (T,)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    per_token = torch.where(active, weight_used * surrogate, zero)

    n_tokens = mask.sum()
    normaliser = n_tokens.clamp(min=1).to(dtype) if token_normaliser is None else token_normaliser
    loss = -per_token.sum() / normaliser

    with torch.no_grad():
        n_mask = n_tokens.clamp(min=1).to(dtype)
        n_active = active.sum()
        clip_hits = (active & (clipped < unclipped)).sum()
        stats = PPOLossStats(
            n_tokens=n_tokens,
            n_active=n_active,
            clip_fraction=clip_hits.to(dtype) / n_active.clamp(min=1).to(dtype),
            behav_weight_mean=torch.where(mask, weight, zero).sum() / n_mask,
            behav_weight_max=torch.where(mask, weight, zero).max() if weight.numel() else zero,
            behav_capped_fraction=capped.sum().to(dtype) / n_mask,
            approx_kl=torch.where(mask, ref - theta.detach(), zero).sum() / n_mask,
        )
    return loss, stats


def reference_kl_loss(
    logp_theta: torch.Tensor,
    logp_ref: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl_coef: float,
    token_normaliser: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty to a fixed reference policy pi_ref (the run's first weights), added to
    the PPO loss, and the mean per-token KL estimate (detached):

        d_t   = logp_ref_t - logp_theta_t
        k3_t  = exp(d_t) - d_t - 1            (>= 0; unbiased for KL(pi_theta || pi_ref) on
                                               tokens sampled from pi_theta; GRPO's estimator)
        loss  = beta * sum_t m_t * k3_t / N

    beta = ``kl_coef``, m_t = ``loss_mask``, N = ``token_normaliser`` if given, else the
    mask count (as :func:`decoupled_ppo_loss`, so the two terms add per token). It pulls
    every trained token's probability back toward pi_ref, which keeps a small model's
    update noise from wearing away what the warm start learned. Only ``logp_theta``
    receives gradient; computed in at least float32."""
    if not kl_coef >= 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if logp_ref.shape != logp_theta.shape or loss_mask.shape != logp_theta.shape:
        raise ValueError(
            f"logp_ref {tuple(logp_ref.shape)} and loss_mask {tuple(loss_mask.shape)} must have "
            f"logp_theta's shape {tuple(logp_theta.shape)}"
        )
    dtype = torch.promote_types(logp_theta.dtype, torch.float32)
    mask = loss_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=logp_theta.device)
    d = torch.where(mask, logp_ref.detach().to(dtype) - logp_theta.to(dtype), zero)
    k3 = torch.where(mask, torch.exp(d) - d - 1.0, zero)
    n_tokens = mask.sum().clamp(min=1).to(dtype)
    normaliser = n_tokens if token_normaliser is None else token_normaliser
    return kl_coef * k3.sum() / normaliser, k3.detach().sum() / n_tokens


def _check_hyperparameters(
    eps_clip: float, eps_high: float, cap: float | None, token_normaliser: float | None, floor: float | None = None
) -> None:
    if not 0.0 < eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in (0, 1), got {eps_clip}")
    if not eps_high > 0.0:
        raise ValueError(f"eps_clip_high must be > 0, got {eps_high}")
    if cap is not None and not cap > 0.0:
        raise ValueError(f"behav_weight_cap must be > 0 or None, got {cap}")
    if floor is not None and not (floor > 0.0 and (cap is None or floor < cap)):
        raise ValueError(f"behav_weight_floor must be > 0 and below behav_weight_cap ({cap}), or None, got {floor}")
    if token_normaliser is not None and not token_normaliser > 0.0:
        raise ValueError(f"token_normaliser must be > 0 or None, got {token_normaliser}")


def _check_shapes(
    logp_theta: torch.Tensor,
    logp_prox: torch.Tensor | None,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> None:
    named = {
        "logp_theta": logp_theta,
        "logp_prox": logp_prox,
        "logp_behav": logp_behav,
        "advantages": advantages,
        "loss_mask": loss_mask,
    }
    shapes = {name: tuple(t.shape) for name, t in named.items() if t is not None}
    if logp_theta.dim() != 1 or len(set(shapes.values())) != 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"decoupled_ppo_loss expects 1-D tensors of one shape (T,), got {listed}")
