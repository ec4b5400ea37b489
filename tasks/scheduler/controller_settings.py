"""The rollout controller's settings: batch size, staleness bound, sampling, shard timing,
admission caps, dynamic filtering and the adaptive bound (one frozen dataclass, built by
``tasks/scheduler/setup.py`` from the run config).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig


@dataclass(frozen=True)
class ControllerSettings:
    run_id: str
    batch_groups: int
    eta: int
    n_samples: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate to the budget: no end-of-sequence or stop token ends a sample."""
    shard_groups: int = 4
    shard_seconds: float = 10.0
    weight_poll_seconds: float = 0.5
    admit_poll_seconds: float = 0.05
    seed: int = 0
    max_groups_in_flight: int | None = None
    """Admit a group only while fewer are generating or being scored (None: the gate alone).
    A restart sends the groups admitted before it out again at once, over the cap if need be."""
    max_groups: int | None = None
    """Admit at most this many groups in total (None: until stopped); with ``dynamic_filter``,
    filtered groups do not count, so the run still produces this many kept groups."""
    dynamic_filter: bool = False
    """Leave out (and release from the gate) groups whose rewards are all equal (module docstring)."""
    adaptive_staleness: AdaptiveStalenessConfig | None = None
    """Move the gate's effective bound with the drift each step measured (None: always ``eta``;
    :mod:`~asyncrl.tasks.algo.adaptive_eta`)."""
