"""The rollout controller's settings: the run's ``rollout`` section as it is (staleness bound,
shard timing, admission cap, dynamic filtering, the adaptive bound), the sampling its episodes
use, and the values handed down from other sections (built by ``tasks/scheduler/setup.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.configs.rollout import RolloutConfig
from asyncrl.tasks.agent.episodes import SamplingSettings


@dataclass(frozen=True)
class ControllerSettings:
    run_id: str
    batch_groups: int
    """Groups per training step (``trainer.batch_groups``): the gate's unit."""
    rollout: RolloutConfig
    """Its staleness bound limits admission; ``shard_groups``/``shard_seconds`` time the writes;
    ``max_groups_in_flight`` caps admission beside the gate (a restart sends the groups admitted
    before it out again at once, over the cap if need be); ``dynamic_filter`` leaves out groups
    whose rewards are all equal; ``adaptive_staleness`` moves the gate's effective bound with
    the drift each step measured (:mod:`~asyncrl.tasks.algo.adaptive_eta`)."""
    sampling: SamplingSettings
    """How each group is sampled (:class:`~asyncrl.tasks.agent.episodes.EpisodeSampling`)."""
    seed: int = 0
    max_groups: int | None = None
    """Admit at most this many groups in total (None: until stopped); with ``dynamic_filter``,
    filtered groups do not count, so the run still produces this many kept groups."""
    admit_poll_seconds: float = 0.05
