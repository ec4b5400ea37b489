"""What the rollout controller needs of its episodes: :class:`GroupEpisodes`, which turns an
admitted prompt into its group's rows. The rollout client's structural type is
:class:`~asyncrl.tasks.agent.episodes.GroupGenerator`, the reward scorer's
:class:`~asyncrl.tasks.reward.types.RewardScorer`, the text codec's
:class:`~asyncrl.tasks.model.codec.TextCodec`.
"""

from __future__ import annotations

from typing import Protocol

from asyncrl.storage.schema import Sample
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.scheduler.controller_stats import ControllerStats


class GroupEpisodes(Protocol):
    """The one episode interface: how a prompt's group becomes its rows. Single-turn samples
    are the built-in episode, the user's agent episodes the other
    (:mod:`asyncrl.tasks.agent.episodes`); the controller runs either the same way."""

    async def produce(self, group: str, record: PromptRecord, stats: ControllerStats) -> list[Sample]:
        """The rows of group ``group`` (prompt ``record``), scored, counted into ``stats``;
        empty when none could be kept."""
        ...
