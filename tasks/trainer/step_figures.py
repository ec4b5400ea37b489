"""The figures of one RL step: the token-weighted update sums, the step's result and its flat
metrics, the train/inference mismatch over all ranks, and the reduction of every rank's
figures to the step's (collective calls; the same numbers with one rank).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from asyncrl.tasks.trainer.data_parallel import all_gather_objects, all_reduce_floats
from asyncrl.tasks.algo.mismatch import all_gather_mismatch, local_mismatch
from asyncrl.tasks.reward.pass_at_k import task_figures
from asyncrl.tasks.trainer.step_data import PreparedStep, TrainItem

if TYPE_CHECKING:
    import torch


@dataclass
class UpdateStats:
    """Token-weighted sums over the micro-batches of one or more updates (see :meth:`means`)."""

    loss: float = 0.0
    updates: int = 0
    tokens: int = 0
    active: int = 0
    clipped: float = 0.0
    behav_weight_sum: float = 0.0
    behav_weight_max: float = 0.0
    capped: float = 0.0
    kl_sum: float = 0.0
    ref_kl_sum: float = 0.0
    """Sum over loss tokens of the k3 estimate of KL(pi_theta || pi_ref) (``trainer.kl_coef`` > 0)."""
    grad_norms: list[float] = field(default_factory=list)
    fillers: int = 0
    """Zero-weighted micro-batches this rank ran to keep in step with a rank that had more."""

    def add_micro(self, loss: float, stats: dict[str, float]) -> None:
        n_tokens, n_active = int(stats["n_tokens"]), int(stats["n_active"])
        self.loss += loss
        self.tokens += n_tokens
        self.active += n_active
        self.clipped += stats["clip_fraction"] * n_active
        self.behav_weight_sum += stats["behav_weight_mean"] * n_tokens
        self.behav_weight_max = max(self.behav_weight_max, stats["behav_weight_max"])
        self.capped += stats["behav_capped_fraction"] * n_tokens
        self.kl_sum += stats["approx_kl"] * n_tokens
        self.ref_kl_sum += stats.get("ref_kl", 0.0) * n_tokens

    def means(self) -> dict[str, float]:
        """loss = mean over updates of the mini-batch loss; clip fraction over contributing
        tokens, behaviour-weight stats and KL over loss tokens; grad_norm = the largest of
        the updates' global gradient norms (NaN where DeepSpeed reports none, e.g. ZeRO 0)."""
        tokens, active = max(self.tokens, 1), max(self.active, 1)
        norms = [n for n in self.grad_norms if n is not None and math.isfinite(n)]
        return {
            "loss": self.loss / max(self.updates, 1),
            "clip_fraction": self.clipped / active,
            "behav_weight_mean": self.behav_weight_sum / tokens,
            "behav_weight_max": self.behav_weight_max,
            "behav_capped_fraction": self.capped / tokens,
            "approx_kl": self.kl_sum / tokens,
            "ref_kl": self.ref_kl_sum / tokens,
            "grad_norm": max(norms) if norms else math.nan,  # NaN: DeepSpeed reported none
            "optimizer_updates": float(self.updates),
        }


@dataclass(frozen=True)
class RLStepResult:
    """What one step did, as plain numbers (see :meth:`metrics`)."""

    prepared: PreparedStep
    update: UpdateStats
    sequence_tokens: int
    """Every token of the trained sequences: prompt, model and environment tokens."""
    output_tokens: int
    """Trained output tokens: those the model sampled."""
    micro_batches: int
    packing_efficiency: float
    proximal_time_s: float
    """The separate proximal pass (0 when the step took log pi_prox from its update's
    forward pass: :func:`~asyncrl.tasks.trainer.step.reuses_update_forward`)."""
    update_time_s: float
    rank_token_imbalance: float = 1.0
    """Largest rank's sequence tokens over the mean over ranks (1.0: perfectly even, or one rank)."""
    mismatch: dict[str, float] = field(default_factory=dict)
    """The step's ``mismatch/*`` metrics over all ranks (:func:`step_mismatch`; empty for the
    standard objective, which computes no proximal log-probs)."""
    context_tokens: int = 0
    """Output tokens inserted by an environment (multi-turn samples): attended to, not trained.
    sequence_tokens = prompt tokens + output_tokens + context_tokens."""

    def metrics(self, pass_k: Sequence[int] = ()) -> dict[str, float]:
        """Flat metrics of the step: loss, rewards, advantages, clipping, behaviour weights,
        staleness distribution (``staleness/count_<s>``), token counts (``sequence_tokens`` =
        prompt + ``output_tokens`` (trained) + ``context_tokens`` (environment output tokens,
        not trained)), throughput, packing efficiency,
        train/inference mismatch (``mismatch/*``, :mod:`~asyncrl.tasks.algo.mismatch`), and
        per task the mean reward, pass@1 and pass@k of the step's groups (:func:`task_figures`)."""
        prepared = self.prepared
        compute_time = self.proximal_time_s + self.update_time_s
        out = {
            **self.update.means(),
            **_describe("reward", prepared.rewards),
            **_describe("advantage", prepared.advantages),
            **_describe("staleness", [float(s) for s in prepared.staleness]),
            "dropped_stale": float(prepared.dropped_stale),
            "staleness_clamped": float(prepared.clamped),
            "groups": float(prepared.num_groups),
            "samples": float(len(prepared.staleness)),
            "trained_samples": float(len(prepared.items)),
            "sequence_tokens": float(self.sequence_tokens),
            "output_tokens": float(self.output_tokens),
            "context_tokens": float(self.context_tokens),
            "micro_batches": float(self.micro_batches),
            "filler_micro_batches": float(self.update.fillers),
            "packing_efficiency": self.packing_efficiency,
            "rank_token_imbalance": self.rank_token_imbalance,
            "proximal_time_s": self.proximal_time_s,
            "update_time_s": self.update_time_s,
            "tokens_per_s": self.sequence_tokens / compute_time if compute_time > 0 else 0.0,
            **task_figures(prepared.group_rewards, pass_k),
            **self.mismatch,
        }
        for staleness, count in sorted(Counter(prepared.staleness).items()):
            out[f"staleness/count_{staleness}"] = float(count)
        return out


def _describe(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {f"{name}_mean": 0.0, f"{name}_std": 0.0, f"{name}_min": 0.0, f"{name}_max": 0.0}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return {f"{name}_mean": mean, f"{name}_std": math.sqrt(var), f"{name}_min": min(values), f"{name}_max": max(values)}


def step_mismatch(items: Sequence[TrainItem], proximal: dict[int, torch.Tensor]) -> dict[str, float]:
    """The step's ``mismatch/*`` metrics (:mod:`~asyncrl.tasks.algo.mismatch`) from the
    proximal log-probs of this rank's items (keys of ``proximal``; log p_trainer) and their
    behaviour log-probs and token lags (collective: every rank calls it once per step; the
    figures are those of all ranks' tokens). All three are over trained (model) tokens only,
    so environment tokens of multi-turn samples never enter the figures. Items with unknown
    token lags are left out."""
    known = [i for i in sorted(proximal) if len(items[i].token_lag) == len(items[i].logp_behav)]
    local = local_mismatch(
        [proximal[i] for i in known], [items[i].logp_behav for i in known], [items[i].token_lag for i in known]
    )
    return all_gather_mismatch(local, all_gather_objects)


def all_reduce_step_figures(local: RLStepResult, token_budget: int) -> RLStepResult:
    """The step's figures over all ranks, from each rank's own (collective; with one
    rank the same figures).

    - summed over ranks: the loss sums (each rank's part of the mini-batch loss, so the
      sum is the mini-batch loss), token counts, clipped / capped / KL / reference-KL / behaviour-weight
      sums, sequence, output and context tokens, micro-batches and fillers;
    - max over ranks: ``behav_weight_max``, and the proximal and update times (the step
      waits for the slowest rank, so tokens/s = all ranks' tokens / the slowest time);
    - the same on every rank already: ``updates`` and the global gradient norms.

    packing efficiency = sum_r real tokens_r / (token_budget * sum_r micro-batches_r)
    (:func:`~asyncrl.tasks.algo.packing.packing_efficiency` over every rank's
    micro-batches; 1.0 without micro-batches); rank token imbalance = max_r T_r / mean_r T_r
    with T_r rank r's sequence tokens (1.0 when no rank has any).
    """
    stats = local.update
    sums = all_reduce_floats(
        [stats.loss, stats.tokens, stats.active, stats.clipped, stats.behav_weight_sum, stats.capped, stats.kl_sum,
         stats.ref_kl_sum, stats.fillers, local.sequence_tokens, local.output_tokens, local.micro_batches, 1.0,
         local.context_tokens],
        "sum",
    )  # fmt: skip
    maxes = all_reduce_floats(
        [stats.behav_weight_max, local.proximal_time_s, local.update_time_s, local.sequence_tokens], "max"
    )
    loss, tokens, active, clipped, weight_sum, capped, kl_sum, ref_kl_sum, fillers, seq_tokens, out_tokens, micro, ranks, ctx = (
        sums
    )
    weight_max, proximal_time, update_time, rank_tokens_max = maxes
    update = replace(
        stats,
        loss=loss,
        tokens=int(tokens),
        active=int(active),
        clipped=clipped,
        behav_weight_sum=weight_sum,
        behav_weight_max=weight_max,
        capped=capped,
        kl_sum=kl_sum,
        ref_kl_sum=ref_kl_sum,
        grad_norms=list(stats.grad_norms),
        fillers=int(fillers),
    )
    return replace(
        local,
        update=update,
        sequence_tokens=int(seq_tokens),
        output_tokens=int(out_tokens),
        context_tokens=int(ctx),
        micro_batches=int(micro),
        packing_efficiency=seq_tokens / (token_budget * micro) if micro else 1.0,
        proximal_time_s=proximal_time,
        update_time_s=update_time,
        rank_token_imbalance=rank_tokens_max * ranks / seq_tokens if seq_tokens else 1.0,
    )
