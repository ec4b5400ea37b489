"""The trainer-config fields one RL step uses (objective, clipping, behaviour-weight cap,
advantages, mini-batching, packing, staleness bound), gathered in one frozen dataclass so
the step, the SFT path and the tests build it without a full trainer config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from asyncrl.configs.trainer import TrainerConfig
from asyncrl.tasks.algo.advantages import AdvantageMethod
from asyncrl.tasks.algo.corrections import BehavCapMode, BehavWeightLevel


@dataclass(frozen=True)
class RLSettings:
    """The trainer-config fields one RL step uses."""

    objective: Literal["decoupled", "standard"] = "decoupled"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    behav_weight_cap: float | None = 5.0
    behav_cap_mode: BehavCapMode = "mask"
    behav_weight_floor: float | None = None
    behav_weight_level: BehavWeightLevel = "token"
    advantage: AdvantageMethod = "grpo"
    negative_advantage_scale: float = 1.0
    kl_coef: float = 0.0
    """beta of the KL penalty to the reference policy (:func:`~asyncrl.tasks.algo.loss.reference_kl_loss`)."""
    mini_batches: int = 1
    micro_batch_tokens: int = 4096
    packer: str = "ffd"
    max_staleness: int | None = None
    """Drop samples with staleness above this; None keeps all."""
    pass_k: tuple[int, ...] = ()
    """k values of the per-task pass@k metrics (pass@1 is always reported)."""

    @staticmethod
    def from_config(trainer: TrainerConfig, max_staleness: int | None, pass_k: Sequence[int] = ()) -> RLSettings:
        return RLSettings(
            objective=trainer.objective,
            eps_clip=trainer.eps_clip,
            eps_clip_high=trainer.eps_clip_high,
            behav_weight_cap=trainer.behav_weight_cap,
            behav_cap_mode=trainer.behav_cap_mode,
            behav_weight_floor=trainer.behav_weight_floor,
            behav_weight_level=trainer.behav_weight_level,
            advantage=trainer.advantage,
            negative_advantage_scale=trainer.negative_advantage_scale,
            kl_coef=trainer.kl_coef,
            mini_batches=trainer.mini_batches,
            micro_batch_tokens=trainer.micro_batch_tokens,
            packer=trainer.packer,
            max_staleness=max_staleness,
            pass_k=tuple(pass_k),
        )
