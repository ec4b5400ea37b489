"""What an RL step trains on after phases 1 and 2 (:func:`~asyncrl.tasks.trainer.step.prepare_step`):
each kept sample's tokens, behaviour log-probs, advantage and token lags, and the
per-sample figures measured before stale samples were dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.tasks.trainer.batch import TokenSequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TrainItem:
    """One kept sample, ready to train on."""

    sequence: TokenSequence
    logp_behav: torch.Tensor  # (M,) float32, M = sequence.trained_count (model tokens only)
    advantage: float
    group: int
    """Index of its group in the step (mini-batches split by group)."""
    token_lag: tuple[int, ...] = ()
    """Per trained (model) token t, U_trainer - U(v_t): how many training steps the weights that
    sampled it lag the trainer's (0: the trainer's current weights; negative: a branch a
    rollback discarded); empty when unknown (then the mismatch figures skip the sample)."""


@dataclass(frozen=True)
class PreparedStep:
    """Kept samples with advantages, and what was measured and dropped."""

    items: tuple[TrainItem, ...]
    staleness: tuple[int, ...]
    """Per sample of the step (dropped ones included), in input order."""
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    """Per sample of the step (dropped ones included)."""
    dropped_stale: int
    num_groups: int
    clamped: int = 0
    group_rewards: tuple[tuple[str, tuple[float, ...]], ...] = ()
    """(task, rewards of its samples) per group, dropped samples included: the per-task figures."""
    """Samples whose update lag was negative, counted as staleness 0 (see :func:`sample_staleness`)."""
