"""What the rollout controller needs of its collaborators: the rollout client that generates
groups and takes weight updates, the episodes that turn a prompt into its group's rows, the
reward scorer, and the text codec. Structural types only, so the controller, the evaluator
and their test doubles share one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from asyncrl.storage.schema import Sample
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.samples import SampleOutput, UpdateStats
from asyncrl.tasks.scheduler.controller_stats import ControllerStats


class GroupGenerator(Protocol):
    """What the controller needs of the rollout client."""

    @property
    def current_version(self) -> int: ...

    def streamed_tokens(self) -> dict[str, int]: ...

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> list[SampleOutput]: ...

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats: ...


class GroupEpisodes(Protocol):
    """The one episode interface: how a prompt's group becomes its rows. Single-turn samples
    are the built-in episode, the user's agent episodes the other
    (:mod:`asyncrl.tasks.scheduler.episodes`); the controller runs either the same way."""

    async def produce(self, index: int, record: PromptRecord, stats: ControllerStats) -> list[Sample]:
        """The rows of group ``index`` (prompt ``record``), scored, counted into ``stats``;
        empty when none could be kept."""
        ...
