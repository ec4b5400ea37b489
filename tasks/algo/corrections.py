"""Corrections of the behaviour weight of the decoupled PPO objective (see :mod:`.loss`).

Per trained output token t of sample s (|s| trained tokens; environment tokens are outside
``loss_mask``): log w_t = log pi_prox(y_t) - log pi_behav(y_t). The objective multiplies each
token's clipped surrogate by a constant corrected weight rho'_t, defined by three choices:

- level: ``token`` rho_t = w_t; ``sequence_product`` rho_t = W_s = exp(sum_{k in s} log w_k);
  ``sequence_geo_mean`` rho_t = G_s = exp(mean_{k in s} log w_k) (same rho for all of s);
- bounds [low, high]: high = ``behav_weight_cap`` (None: none), low = ``behav_weight_floor``
  (None: 0);
- mode: ``clamp`` (TIS) rho'_t = min(max(rho_t, low), high); ``mask`` (MIS; IcePop at token
  level with two bounds) rho'_t = rho_t and m_t = 0 where rho_t > high or rho_t < low.

Defaults (token, high 5, mask) are AReaL's; masked tokens still count in the normaliser N.
Pure functions of (T,) tensors; positions outside ``loss_mask`` get weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

BehavWeightLevel = Literal["token", "sequence_product", "sequence_geo_mean"]
BEHAV_WEIGHT_LEVELS: tuple[str, ...] = get_args(BehavWeightLevel)
BehavCapMode = Literal["clamp", "mask"]
BEHAV_CAP_MODES: tuple[str, ...] = get_args(BehavCapMode)


def sequence_index(loss_mask: torch.Tensor, output_lengths: Sequence[int]) -> torch.Tensor:
    """(T,) long: for each ``loss_mask`` position, the index k of its sample among the
    micro-batch's samples (in layout order, the order of ``output_lengths``); -1 elsewhere.

    The masked positions of a micro-batch are its samples' trained (model) tokens in layout
    order (:class:`~asyncrl.tasks.trainer.batch.MicroBatch`), so sample k holds the
    ``output_lengths[k]`` masked positions after those of samples 0..k-1, and a sequence
    weight sums over model tokens only."""
    import torch

    mask = loss_mask.to(torch.bool)
    lengths = torch.tensor(list(output_lengths), dtype=torch.long)
    if int(lengths.sum()) != int(mask.sum()):
        raise ValueError(
            f"sequence_index: output lengths sum to {int(lengths.sum())}, loss_mask holds {int(mask.sum())} positions"
        )
    index = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    index[mask] = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(mask.device)
    return index


def token_log_weight(logp_prox: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log w_t = logp_prox_t - logp_behav_t on ``loss_mask`` positions, 0 elsewhere (padding
    may hold arbitrary log-probs; a zero there keeps exp() finite)."""
    import torch

    return torch.where(loss_mask.to(torch.bool), logp_prox - logp_behav, torch.zeros_like(logp_prox))


def sequence_log_weight(
    log_w: torch.Tensor, index: torch.Tensor, aggregate: Literal["product", "geo_mean"]
) -> torch.Tensor:
    """Per position, log of its sample's weight (0 where ``index`` is -1):

        product:   log W_s = sum_{k in s} log w_k
        geo_mean:  log G_s = (1 / |s|) * sum_{k in s} log w_k

    ``index`` from :func:`sequence_index`. Summed in the dtype of ``log_w``."""
    import torch

    if aggregate not in ("product", "geo_mean"):
        raise ValueError(f"aggregate must be one of ['product', 'geo_mean'], got {aggregate!r}")
    valid = index >= 0
    count = int(index.max()) + 1 if bool(valid.any()) else 0
    sums = torch.zeros(count, dtype=log_w.dtype, device=log_w.device).index_add_(0, index[valid], log_w[valid])  # (K,)
    if aggregate == "geo_mean":
        sizes = torch.zeros(count, dtype=log_w.dtype, device=log_w.device).index_add_(
            0, index[valid], torch.ones_like(log_w[valid])
        )  # (K,)
        sums = sums / sizes.clamp(min=1)
    out = torch.zeros_like(log_w)
    out[valid] = sums[index[valid]]
    return out


def level_weight(
    log_w: torch.Tensor, loss_mask: torch.Tensor, level: BehavWeightLevel, index: torch.Tensor | None
) -> torch.Tensor:
    """rho_t of the module docstring (0 outside ``loss_mask``): exp(log w_t) at token level,
    exp of :func:`sequence_log_weight` at a sequence level (which needs ``index``). A
    product over a long sample can overflow to inf: masked, or clamped to ``high``."""
    import torch

    if level not in BEHAV_WEIGHT_LEVELS:
        raise ValueError(f"behav_weight_level must be one of {list(BEHAV_WEIGHT_LEVELS)}, got {level!r}")
    mask = loss_mask.to(torch.bool)
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    if level == "token":
        return torch.where(mask, torch.exp(log_w), zero)
    if index is None:
        raise ValueError(f"behav_weight_level={level!r} needs the per-position sample index (sequence_index)")
    aggregate: Literal["product", "geo_mean"] = "product" if level == "sequence_product" else "geo_mean"
    return torch.where(mask, torch.exp(sequence_log_weight(log_w, index, aggregate)), zero)


def out_of_bounds(rho: torch.Tensor, loss_mask: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """(T,) bool: ``loss_mask`` positions with rho_t > high or rho_t < low (a missing bound
    never hits)."""
    import torch

    outside = torch.zeros_like(loss_mask, dtype=torch.bool)
    if high is not None:
        outside |= rho > high
    if low is not None:
        outside |= rho < low
    return outside & loss_mask.to(torch.bool)


def truncate(rho: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """rho'_t = min(max(rho_t, low), high) (a missing bound is not applied)."""
    import torch

    if low is None and high is None:
        return rho
    return torch.clamp(rho, min=low, max=high)


def correct_behaviour_weight(
    log_w: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    level: BehavWeightLevel = "token",
    low: float | None = None,
    high: float | None = None,
    mode: BehavCapMode = "mask",
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rho', keep, outside), each (T,): the corrected weight rho'_t (0 where not kept), the
    positions that stay in the objective (``loss_mask`` minus those masked), and the
    ``loss_mask`` positions whose rho_t is outside [low, high] (masked in mode "mask",
    truncated in mode "clamp"). See the module docstring for the formulas."""
    import torch

    if mode not in BEHAV_CAP_MODES:
        raise ValueError(f"behav_cap_mode must be one of {list(BEHAV_CAP_MODES)}, got {mode!r}")
    if low is not None and high is not None and not low < high:
        raise ValueError(f"behav_weight_floor ({low}) must be below behav_weight_cap ({high})")
    mask = loss_mask.to(torch.bool)
    rho = level_weight(log_w, mask, level, index)
    outside = out_of_bounds(rho, mask, low, high)
    keep = mask & ~outside if mode == "mask" else mask
    used = truncate(rho, low, high) if mode == "clamp" else rho
    return torch.where(keep, used, torch.zeros_like(used)), keep, outside
