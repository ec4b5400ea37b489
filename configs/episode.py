"""How a run's agent episodes are configured (``rollout.episode``).

Light on purpose: the run config imports it, so nothing here imports the episode code,
the proxy or ``openai``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.reward import check_import_path

FailurePolicy = Literal["record", "drop"]


class EpisodeConfig(StrictModel):
    """A user's multi-turn episode, run ``rollout.n_samples`` times per prompt.

    The episode is an ``async def`` taking an :class:`~asyncrl.tasks.agent.episode.EpisodeContext`
    (the prompt row and the ``base_url`` of the recording endpoint, which the official
    ``openai`` client talks to); it returns a reward, or ``None`` to have the row's reward
    (``math``, ``code`` or a plug-in) score the last assistant message.
    """

    function: str = Field(min_length=3, description="Import path `package.module:function` or `/path/to/file.py:function`.")
    timeout_s: float = Field(300.0, gt=0.0, le=86_400.0, description="Wall-clock limit of one episode; past it the episode is cancelled.")
    """Wall-clock limit of one episode; past it the episode is cancelled and counts as failed
    (reason ``episode_timeout``)."""
    max_context_tokens: int = Field(2048, ge=2, description="Prompt + every turn's tokens of one episode.")
    """Prompt + every turn's tokens of one episode; a call that would pass it is cut to what
    is left (the episode then ends with ``length``)."""
    on_failure: FailurePolicy = Field("record", description="An episode that raises or times out: record it with reward 0, or drop it.")
    """An episode that raises or times out: ``record`` writes what it generated with reward 0
    and its reason as ``finish_reason``; ``drop`` leaves it out of its group (a group left
    empty is released from the staleness gate like a filtered one)."""
    options: dict[str, Any] = Field(default_factory=dict, description="JSON-able settings handed to every episode as `context.options`.")
    """E.g. a turn limit."""

    @field_validator("function")
    @classmethod
    def _import_path(cls, function: str) -> str:
        return check_import_path(function)
