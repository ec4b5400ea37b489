"""Controller settings from one flat set of keywords, as the unit tests of the controller write
them: the sampling keys go to both the ``rollout`` section and the episodes' sampling (as
``tasks/scheduler/setup.py`` derives one from the other), the section's own keys to the section."""

from __future__ import annotations

from typing import Any

from asyncrl.configs.rollout import RolloutConfig
from asyncrl.tasks.agent.episodes import SamplingSettings
from asyncrl.tasks.scheduler.controller_settings import ControllerSettings

OWN = ("run_id", "batch_groups", "seed", "max_groups", "admit_poll_seconds")
SAMPLING_ONLY = ("max_prompt_tokens", "stop_token_ids")


def flat_controller_settings(**keys: Any) -> ControllerSettings:  # noqa: ANN401 - any key's value
    own = {key: keys.pop(key) for key in OWN if key in keys}
    sampling_only = {key: keys.pop(key) for key in SAMPLING_ONLY if key in keys}
    rollout = RolloutConfig(**keys)
    sampling = SamplingSettings.from_rollout(rollout, sampling_only["max_prompt_tokens"], sampling_only.get("stop_token_ids", ()))
    return ControllerSettings(rollout=rollout, sampling=sampling, **own)
