"""The adaptive staleness bound's drift budget (``rollout.adaptive_staleness``); the rule it
configures is :mod:`asyncrl.tasks.algo.adaptive_eta`."""

from __future__ import annotations

from pydantic import Field, model_validator

from asyncrl.configs.base import StrictModel


class AdaptiveStalenessConfig(StrictModel):
    """``rollout.adaptive_staleness``: the drift budget (module docstring). At least one of
    ``max_behav_weight_p99`` and ``min_ess`` must be set."""

    max_behav_weight_p99: float | None = Field(
        1.3, gt=1.0, description="Budget on the 0.99 quantile of the behaviour weights; None: not judged."
    )
    """Over budget when the 0.99 quantile of pi_prox / pi_behav at some staleness 1..e exceeds
    this (1 = no drift at all). The default is about PPO's own trust region (clip 1 +- 0.2):
    more than 1% of the tokens drifted further than 1.5 clip widths. The quantile grows with
    staleness and is largest early in a run, shrinking as the policy changes less per step
    (``asyncrl bench ablation`` shows it for the demo)."""
    min_ess: float | None = Field(
        None, gt=0.0, le=1.0, description="Budget on the normalised ESS of the behaviour weights; None: not judged."
    )
    """The step's normalised effective sample size: over budget when ESS < this."""
    min_eta: int = Field(0, ge=0, description="The effective bound never goes below this (0: down to synchronous RL).")
    recover_steps: int = Field(2, ge=1, description="Steps in a row under budget before the effective bound grows by one.")

    @model_validator(mode="after")
    def _some_budget(self) -> AdaptiveStalenessConfig:
        if self.max_behav_weight_p99 is None and self.min_ess is None:
            raise ValueError(
                "rollout.adaptive_staleness: set max_behav_weight_p99 or min_ess (or both); with neither, "
                "nothing is measured against the bound"
            )
        return self
