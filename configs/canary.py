"""The mismatch canary's thresholds (``tracking.mismatch_canary``)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.configs.base import StrictModel


class MismatchCanaryConfig(StrictModel):
    """Thresholds of the mismatch canary (``tracking.mismatch_canary``); None turns one off.

    On by default, with thresholds about ten times what a healthy run typically shows: float32 on CPU
    (this stack's default) differs by ~1e-6 in log-prob, bf16 vLLM against a bf16/fp32
    trainer by ~1e-3 to 1e-2 in mean |log-prob difference| and ~1e-4 to 1e-3 in k3 KL, with
    well under 1% of ratios outside [0.5, 2]. Serving weights other than the trainer's moves
    these by a policy change: far above the thresholds for a server that never loaded new
    weights after a few updates or loaded the wrong ones. A server exactly one small update
    behind can stay under them; lower the thresholds to watch for that."""

    abs_logp_diff_mean: float | None = Field(0.1, gt=0.0, description="Alarm when `mismatch/abs_logp_diff_mean` exceeds this.")
    """mean |log p_trainer - log p_behav|."""
    k3_kl: float | None = Field(0.02, gt=0.0, description="Alarm when `mismatch/k3_kl` exceeds this.")
    """k3 estimate of KL(pi_behav || pi_trainer), nats per token."""
    ratio_outside_frac: float | None = Field(0.05, gt=0.0, le=1.0, description="Alarm when `mismatch/ratio_outside_frac` exceeds this.")
    """Share of ratios p_trainer / p_behav outside [0.5, 2]."""
    min_tokens: int = Field(32, ge=1, description="Steps with fewer current-version tokens than this are not checked.")
    """Too few to tell."""

    def thresholds(self) -> dict[str, float]:
        """Metric name -> threshold, for the figures that are on."""
        return {
            f"mismatch/{name}": value
            for name, value in (
                ("abs_logp_diff_mean", self.abs_logp_diff_mean),
                ("k3_kl", self.k3_kl),
                ("ratio_outside_frac", self.ratio_outside_frac),
            )
            if value is not None
        }
