"""The ``rollout`` section: what the scheduler asks the servers to generate (sampling, staleness,
episodes) and how it writes the results. The servers themselves are the ``inference`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig
from asyncrl.configs.base import StrictModel
from asyncrl.configs.episode import EpisodeConfig


class RolloutConfig(StrictModel):
    n_samples: int = Field(4, ge=1, description="Samples per prompt (the group size n).")
    max_new_tokens: int = Field(256, ge=1, description="Generation budget per sample, across interruptions.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature of generation.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus-sampling probability mass of generation.")
    eta: int = Field(4, ge=0, description="Maximum staleness in policy versions; 0 makes the system synchronous.")
    interrupt_mode: Literal["recompute", "keep"] = Field(
        "recompute", description="On a weight update: recompute the KV cache with the new weights, or keep it."
    )
    """``recompute``: abort and resubmit with prompt + tokens so far (recompute the KV cache with
    new weights, the paper's); ``keep``: keep vLLM's KV cache (pause mode=keep)."""
    shard_groups: int = Field(4, ge=1, description="Write a partial shard every this many finished groups.")
    """The scheduler writes groups in admission order, a shard as soon as a batch of
    `trainer.batch_groups` is complete, and a partial one every `shard_groups` finished groups
    or after `shard_seconds`, whichever comes first."""
    shard_seconds: float = Field(10.0, gt=0.0, description="...or when the oldest unwritten group has waited this long.")
    journal_tokens: int = Field(
        64, ge=0, description="Journal in-flight samples once one holds this many unjournaled tokens; 0: no journal."
    )
    """The scheduler journals every sample of every unwritten group (``scheduler/journal.json``,
    replaced whole) so that a killed scheduler, server or node goes on from the last journaled
    token: a kill loses at most about this many tokens a sample in flight
    (:mod:`~asyncrl.tasks.inference.sample_journal`). Agent episodes are journaled by completed
    turn and resume at their last one (:mod:`~asyncrl.tasks.inference.turn_journal`)."""
    journal_seconds: float = Field(10.0, gt=0.0, description="...or when this long has passed since the last journal write.")
    weight_poll_seconds: float = Field(
        0.5, gt=0.0, description="How often the scheduler looks for a newly published weight version."
    )
    max_groups_in_flight: int | None = Field(
        None, ge=1, description="Most prompt groups generating or being scored at once; None: the staleness rule alone."
    )
    """Over all servers (AReaL's ``max_concurrent_rollouts``): a group is admitted only below it,
    which bounds what the servers hold at once (KV cache, open agent episodes). The staleness
    rule still bounds admission; None: the rule alone, up to (eta + 1) x ``trainer.batch_groups``
    groups. A cap need not shorten a run (README, "Groups in flight")."""
    ignore_eos: bool = Field(False, description="Generate every sample to its full budget, ignoring end-of-sequence tokens.")
    """For benchmarks: output lengths set by the budgets alone, identical in every run."""
    dynamic_filter: bool = Field(False, description="DAPO-style dynamic filtering: groups with all-equal rewards are not trained.")
    """A prompt group whose rewards are all equal (no advantage signal) is not trained, and its
    admission is released, so the staleness rule counts the trained groups only (needs
    ``n_samples`` >= 2)."""
    episode: EpisodeConfig | None = Field(None, description="Multi-turn agent episodes; None: single-turn samples.")
    """Each prompt's group is n runs of the user's episode function against a recording
    OpenAI-compatible endpoint (:mod:`asyncrl.tasks.agent`); None: single-turn samples of the
    rendered prompt."""
    adaptive_staleness: AdaptiveStalenessConfig | None = Field(
        None, description="Lower the staleness bound while measured drift is over budget; None: the bound is `eta`."
    )
    """The gate's effective bound drops toward ``min_eta`` while the drift the trainer measures
    (behaviour-weight tail, ESS) is over its budget and comes back up to ``eta``, never above
    it, when it is under (each change logged)."""

    @model_validator(mode="after")
    def _adaptive_within_eta(self) -> RolloutConfig:
        adaptive = self.adaptive_staleness
        if adaptive is not None and adaptive.min_eta > self.eta:
            raise ValueError(
                f"rollout.adaptive_staleness.min_eta: {adaptive.min_eta} is above rollout.eta = {self.eta}; "
                "the effective bound moves between min_eta and eta"
            )
        return self

    @model_validator(mode="after")
    def _episodes_end_themselves(self) -> RolloutConfig:
        if self.episode is not None and self.ignore_eos:
            raise ValueError(
                "rollout.ignore_eos: an episode's turns must end on their own (the endpoint returns each "
                "turn when the model stops); it cannot be combined with rollout.episode"
            )
        return self

    @model_validator(mode="after")
    def _filter_needs_groups(self) -> RolloutConfig:
        if self.dynamic_filter and self.n_samples < 2:
            raise ValueError(
                f"rollout.dynamic_filter needs rollout.n_samples >= 2 (got {self.n_samples}): "
                "a group of one sample always has equal rewards and would never be trained"
            )
        return self
