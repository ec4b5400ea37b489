"""Train/inference mismatch figures of one training step (the ``mismatch/*`` metrics).

Per trained token t: log pi_prox (the trainer's, at the start of the step), log pi_behav (the
rollout server's) and lag_t = U_trainer - U(v_t); d_t = log pi_prox(y_t) - log pi_behav(y_t)
and r_t = w_t = exp(d_t). Over the n_0 tokens with lag 0 (where a weight-sync bug shows first;
the run's canary, :mod:`asyncrl.tasks.launch.canary`, watches them):

- ``abs_logp_diff_mean`` / ``abs_logp_diff_max`` of |d_t|; ``current_version_tokens`` = n_0;
- ``k3_kl`` = mean[(r_t - 1) - log r_t], Schulman's unbiased k3 estimate of KL(pi_behav || pi_trainer);
- ``ratio_outside_frac`` = share of tokens with r_t < 0.5 or r_t > 2.

Over every token, by staleness s_t = max(0, lag_t): ``behav_weight_p99/staleness_<s>`` and
``behav_weight_max/staleness_<s>`` (quantile of sorted x_0..x_{n-1}: h = 0.99 (n - 1),
q = x_floor(h) + (h - floor(h)) (x_floor(h)+1 - x_floor(h))), and ``ess`` = (sum w)^2 / (n sum w^2).
Exact across ranks (:func:`all_gather_mismatch`). Derivations: ``docs/internals/algo.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    import torch

QUANTILE = 0.99
RATIO_LOW, RATIO_HIGH = 0.5, 2.0


@dataclass
class LocalMismatch:
    """One rank's sums over its tokens (see the module docstring), float64."""

    current_tokens: int = 0
    abs_diff_sum: float = 0.0
    abs_diff_max: float = 0.0
    k3_sum: float = 0.0
    outside: int = 0
    weight_count: int = 0
    weight_sum: float = 0.0
    weight_sq_sum: float = 0.0
    weights_by_staleness: dict[int, torch.Tensor] = field(default_factory=dict)
    """s -> (n_s,) float64 raw weights of the tokens of staleness s, sorted descending."""


def local_mismatch(
    logp_trainer: Sequence[torch.Tensor], logp_behav: Sequence[torch.Tensor], token_lag: Sequence[Sequence[int]]
) -> LocalMismatch:
    """This rank's sums, one tensor of shape (M_i,) per sample i for each argument (same M_i:
    the sample's trained tokens, model tokens only)."""
    import torch

    out = LocalMismatch()
    if not logp_trainer:
        return out
    trainer = torch.cat([t.detach().to("cpu", torch.float64) for t in logp_trainer])  # (N,)
    behav = torch.cat([t.detach().to("cpu", torch.float64) for t in logp_behav])  # (N,)
    lag = torch.tensor([v for lags in token_lag for v in lags], dtype=torch.long)  # (N,)
    if not trainer.shape == behav.shape == lag.shape:
        raise ValueError(
            f"local_mismatch: {trainer.numel()} trainer log-probs, {behav.numel()} behaviour log-probs, "
            f"{lag.numel()} token lags"
        )
    diff = trainer - behav  # d_t = log r_t
    weight = torch.exp(diff)  # w_t = r_t
    current = lag == 0
    d0 = diff[current]
    out.current_tokens = int(d0.numel())
    if out.current_tokens:
        out.abs_diff_sum = float(d0.abs().sum())
        out.abs_diff_max = float(d0.abs().max())
        out.k3_sum = float((torch.expm1(d0) - d0).sum())  # (r - 1) - log r
        out.outside = int(((d0 < math.log(RATIO_LOW)) | (d0 > math.log(RATIO_HIGH))).sum())
    out.weight_count = int(weight.numel())
    out.weight_sum = float(weight.sum())
    out.weight_sq_sum = float((weight * weight).sum())
    staleness = lag.clamp(min=0)
    for s in sorted(set(staleness.tolist())):
        out.weights_by_staleness[int(s)] = torch.sort(weight[staleness == s], descending=True).values
    return out


def upper_quantile(top: Sequence[float], n: int, q: float = QUANTILE) -> float:
    """The q-quantile (linear interpolation, module docstring) of n values of which ``top``
    holds the k = n - floor(q (n - 1)) largest, in descending order."""
    h = q * (n - 1)
    lo = math.floor(h)
    k = n - lo
    if len(top) < k:
        raise ValueError(f"upper_quantile: needs the {k} largest of {n} values, got {len(top)}")
    x_lo = top[k - 1]  # ascending index lo
    x_hi = top[k - 2] if k >= 2 else x_lo  # ascending index lo + 1
    return x_lo + (h - lo) * (x_hi - x_lo)


def quantile_tail_size(n: int, q: float = QUANTILE) -> int:
    """k = n - floor(q (n - 1)): how many of the largest values :func:`upper_quantile` needs."""
    return n - math.floor(q * (n - 1)) if n else 0


def all_gather_mismatch(local: LocalMismatch, all_gather_objects: Callable[[object], list]) -> dict[str, float]:
    """The ``mismatch/*`` metrics of the whole step from every rank's sums. ``all_gather_objects``
    is the trainer's collective (one object per rank, in rank order); it is called twice, by every
    rank, so every rank gets the same figures. One process passes ``lambda x: [x]``."""
    summaries = all_gather_objects(
        (local.current_tokens, local.abs_diff_sum, local.abs_diff_max, local.k3_sum, local.outside,
         local.weight_count, local.weight_sum, local.weight_sq_sum,
         {s: int(w.numel()) for s, w in local.weights_by_staleness.items()})
    )  # fmt: skip
    counts: dict[int, int] = {}
    for summary in summaries:
        for s, n in summary[8].items():
            counts[s] = counts.get(s, 0) + n
    tails = {s: quantile_tail_size(n) for s, n in counts.items()}
    local_tops = {s: local.weights_by_staleness[s][: tails[s]].tolist() for s in local.weights_by_staleness}
    tops_by_rank = all_gather_objects(local_tops)

    n0 = sum(x[0] for x in summaries)
    out: dict[str, float] = {"mismatch/current_version_tokens": float(n0)}
    if n0:
        out["mismatch/abs_logp_diff_mean"] = sum(x[1] for x in summaries) / n0
        out["mismatch/abs_logp_diff_max"] = max(x[2] for x in summaries if x[0])
        out["mismatch/k3_kl"] = sum(x[3] for x in summaries) / n0
        out["mismatch/ratio_outside_frac"] = sum(x[4] for x in summaries) / n0
    n = sum(x[5] for x in summaries)
    square = sum(x[7] for x in summaries)
    if n and square > 0:
        out["mismatch/ess"] = sum(x[6] for x in summaries) ** 2 / (n * square)
    for s in sorted(counts):
        merged = sorted((v for tops in tops_by_rank for v in tops.get(s, ())), reverse=True)[: tails[s]]
        out[f"mismatch/behav_weight_p99/staleness_{s}"] = upper_quantile(merged, counts[s])
        out[f"mismatch/behav_weight_max/staleness_{s}"] = merged[0]
    return out
