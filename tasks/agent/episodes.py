"""The two kinds of episode, one path for training and evaluation: :class:`SingleTurnEpisodes`,
the built-in one (n samples of the rendered prompt, scored by the row's reward), and
:class:`AgentEpisodes`, the user's function of ``rollout.episode``. Either turns a prompt into
its group's scored rows; the scheduler's controller trains on them
(:class:`~asyncrl.tasks.scheduler.protocols.GroupEpisodes`) and the held-out evaluation
counts their rewards (:func:`~asyncrl.tasks.evaluator.held_out.evaluate`), so a prompt is
sampled, bounded and scored the same way in both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, Self

from asyncrl.configs.rollout import RolloutConfig
from asyncrl.storage.schema import Sample
from asyncrl.tasks.agent.runner import EpisodeRunner, episode_sample, kept_outcomes, score_outcomes
from asyncrl.tasks.data.records import PromptRecord, sample_budget
from asyncrl.tasks.data.reward_requests import reward_request
from asyncrl.tasks.inference.samples import SampleOutput, UpdateStats
from asyncrl.tasks.model.codec import TextCodec
from asyncrl.tasks.reward.types import RewardResult, RewardScorer

LOG = logging.getLogger("asyncrl.episodes")


class GroupGenerator(Protocol):
    """What the episodes (a group's samples) and the controller (versions, weight updates)
    need of the rollout client."""

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
        journal_key: str | None = None,
    ) -> list[SampleOutput]: ...

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats: ...


class BusyClock(Protocol):
    """Counts the time some piece of work is running (:class:`~asyncrl.tasks.system.busy_time.BusyTime`)."""

    def running(self) -> AbstractContextManager[object]: ...


class EpisodeStats(Protocol):
    """What the episodes count into: generation busy time, time waiting for rewards, each
    sample (task, tokens sampled, reward, reason), context tokens of multi-turn rows and
    episodes left out by reason. The controller's :class:`~asyncrl.tasks.scheduler.controller_stats.ControllerStats`
    is one; the evaluation's tally another."""

    reward_wait_s: float
    context_tokens: int
    episodes_left_out: dict[str, int]

    @property
    def generation(self) -> BusyClock: ...

    def count_sample(self, task: str, output_tokens: int, reward: float, reason: str) -> None: ...


class EpisodeSampling(Protocol):
    """How a group is sampled: ``n_samples`` samples, each within :func:`sample_budget` of its
    row and ``max_new_tokens``, from a prompt of at most ``max_prompt_tokens`` tokens; with
    ``ignore_eos`` no end-of-sequence or stop token ends a sample (:class:`SamplingSettings`,
    the scheduler's and the evaluation's)."""

    @property
    def n_samples(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def max_prompt_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def ignore_eos(self) -> bool: ...


@dataclass(frozen=True)
class SamplingSettings:
    """An :class:`EpisodeSampling`: the scheduler's (from the ``rollout`` section,
    :meth:`from_rollout`) or the held-out evaluation's."""

    n_samples: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, max_prompt_tokens: int, stop_token_ids: tuple[int, ...]) -> Self:
        """The run's sampling: the ``rollout`` section's, prompts of ``data.max_prompt_tokens``,
        stopping at the model's ``stop_token_ids``."""
        return cls(
            n_samples=rollout.n_samples, max_new_tokens=rollout.max_new_tokens, max_prompt_tokens=max_prompt_tokens,
            temperature=rollout.temperature, top_p=rollout.top_p, stop_token_ids=stop_token_ids,
            ignore_eos=rollout.ignore_eos,
        )  # fmt: skip


class SingleTurnEpisodes:
    """The built-in episode: n samples of the rendered prompt in one ``generate_group``
    call, scored together by the row's reward."""

    def __init__(
        self,
        settings: EpisodeSampling,
        render: Callable[[PromptRecord], str],
        codec: TextCodec,
        generator: GroupGenerator,
        scorer: RewardScorer,
    ) -> None:
        self.settings = settings
        self.render = render
        self.codec = codec
        self.generator = generator
        self.scorer = scorer

    async def produce(self, group: str, record: PromptRecord, stats: EpisodeStats) -> list[Sample]:
        """Group ``group``'s single-turn samples, generated and scored; a prompt over
        ``max_prompt_tokens`` fails the run, naming it."""
        settings = self.settings
        prompt_ids = self.codec.encode(self.render(record))
        if len(prompt_ids) > settings.max_prompt_tokens:
            raise ValueError(
                f"prompt {record.prompt_id} has {len(prompt_ids)} tokens, over data.max_prompt_tokens "
                f"= {settings.max_prompt_tokens}"
            )
        # One piece of generation work: the group's samples are submitted together and the
        # call ends with the last, so the calls' union is the samples' (generation_busy_s).
        with stats.generation.running():
            outputs = await self.generator.generate_group(
                prompt_ids,
                settings.n_samples,
                sample_budget(record, settings.max_new_tokens),
                settings.temperature,
                settings.top_p,
                ignore_eos=settings.ignore_eos,
                stop_token_ids=() if settings.ignore_eos else settings.stop_token_ids,
                journal_key=group,
            )
        texts = [self.codec.decode(o.output_token_ids) for o in outputs]
        results: list[RewardResult] = []
        if texts:
            scoring_started = time.monotonic()
            results = await self.scorer.score([reward_request(record, t) for t in texts])
            stats.reward_wait_s += time.monotonic() - scoring_started
        samples = [
            Sample(
                prompt_id=record.prompt_id,
                group_id=group,
                prompt_token_ids=prompt_ids,
                output_token_ids=o.output_token_ids,
                behaviour_logprobs=o.behaviour_logprobs,
                token_versions=o.token_versions,
                reward=r.reward,
                finish_reason=o.finish_reason,
                submit_time=o.timings.submitted_at,
                finish_time=o.timings.finished_at,
                task=record.task,
            )
            for o, r in zip(outputs, results, strict=True)
        ]
        for output, result in zip(outputs, results, strict=True):
            stats.count_sample(record.task, len(output.output_token_ids), result.reward, result.reason)
        return samples


class AgentEpisodes:
    """The user's episodes (``rollout.episode``): n runs of its function through the
    recording endpoint (:mod:`asyncrl.tasks.agent.runner`), kept by ``on_failure``, scored
    by the row's reward where the episode left its reward open."""

    def __init__(self, runner: EpisodeRunner, scorer: RewardScorer, n_samples: int) -> None:
        self.runner = runner
        self.scorer = scorer
        self.n_samples = n_samples

    async def produce(self, group: str, record: PromptRecord, stats: EpisodeStats) -> list[Sample]:
        """Group ``group``'s kept episodes as masked rows; the others counted by reason in
        ``episodes_left_out``, and each failure logged. The episodes count as generation
        (``generation_busy_s``) from their start to the end of the group's last one, their
        tool calls and user turns included: an episode is its row's sample."""
        with stats.generation.running():
            outcomes = await self.runner.run_group(group, record, self.n_samples)
        chosen = kept_outcomes(outcomes, self.runner.config.on_failure)
        for reason, count in chosen.left_out.items():
            stats.episodes_left_out[reason] = stats.episodes_left_out.get(reason, 0) + count
        for outcome in outcomes:
            if outcome.failure is not None:
                LOG.warning("group %s: episode failed: %s", group, outcome.failure)
        scoring_started = time.monotonic()
        scored = await score_outcomes(record, chosen.kept, self.scorer)
        stats.reward_wait_s += time.monotonic() - scoring_started
        samples = []
        for outcome, (reward, reason) in zip(chosen.kept, scored, strict=True):
            sample = episode_sample(record, group, outcome, reward)
            generated = sample.model_token_count
            stats.count_sample(record.task, generated, reward, reason)
            stats.context_tokens += len(sample.output_token_ids) - generated
            samples.append(sample)
        return samples
