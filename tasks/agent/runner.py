"""A prompt's group of episodes, and the trajectory rows they become.

The group is the unit of admission, the staleness rule and exactly-once, as for
single-turn samples: the scheduler admits it, :class:`EpisodeRunner` runs its n episodes
at once, and :func:`episode_sample` turns each kept episode into one masked trajectory row
(the first call's prompt; every later token, with ``output_mask`` True on what the model
sampled; the episode's reward, else the row's reward). :func:`kept_outcomes` decides which
episodes become rows: one that made no model call or whose first prompt differs from its
group's cannot, and a failed one is kept with reward 0 under ``on_failure: record`` and
left out under ``drop``. Field by field: ``docs/internals/agent.md``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.storage.schema import Sample
from asyncrl.configs.episode import EpisodeConfig, FailurePolicy
from asyncrl.tasks.agent.episode import (
    EPISODE_API_KEY,
    EpisodeContext,
    EpisodeFunction,
    EpisodeOutcome,
    EpisodeRecorder,
    load_episode,
    run_episode,
    stable_episode_id,
)
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.data.reward_requests import reward_request
from asyncrl.tasks.inference.proxy import RecordingProxy
from asyncrl.tasks.inference.turn_journal import TurnJournal
from asyncrl.tasks.reward.types import RewardScorer

if TYPE_CHECKING:
    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.model.codec import HFCodec

NO_MODEL_CALL = "no_model_call"
OTHER_PROMPT = "other_prompt"


@dataclass(frozen=True)
class KeptEpisodes:
    """The outcomes written as rows, and why the others were left out (counts by reason)."""

    kept: list[EpisodeOutcome]
    left_out: Counter[str]


def failure_kind(failure: str) -> str:
    """``episode_error`` / ``episode_timeout``: the part of a failure before its detail."""
    return failure.split(":", 1)[0]


def kept_outcomes(outcomes: Sequence[EpisodeOutcome], on_failure: FailurePolicy) -> KeptEpisodes:
    """The outcomes that become rows (module docstring). The group's prompt is the first
    prompt most of its recorded episodes share (ties: the earliest episode's)."""
    left_out: Counter[str] = Counter()
    candidates: list[EpisodeOutcome] = []
    for outcome in outcomes:
        if outcome.tokens is None:
            left_out[NO_MODEL_CALL if outcome.failure is None else failure_kind(outcome.failure)] += 1
        elif outcome.failed and on_failure == "drop":
            left_out[failure_kind(outcome.failure or "")] += 1
        else:
            candidates.append(outcome)
    if not candidates:
        return KeptEpisodes([], left_out)
    first_prompts = [tuple(o.tokens.prompt_token_ids) if o.tokens is not None else () for o in candidates]
    shared = Counter(first_prompts)
    group_prompt = max(first_prompts, key=lambda prompt: shared[prompt])  # ties: the earliest episode's
    kept = [o for o, prompt in zip(candidates, first_prompts) if prompt == group_prompt]
    left_out[OTHER_PROMPT] += len(candidates) - len(kept)
    return KeptEpisodes(kept, left_out)


def episode_sample(record: PromptRecord, group_id: str, outcome: EpisodeOutcome, reward: float) -> Sample:
    """The trajectory row of one kept episode (module docstring); ``finish_reason`` is the
    last call's (``stop``, ``length``, ``tool_calls``) or the failure's kind."""
    tokens = outcome.tokens
    if tokens is None:
        raise ValueError(f"episode of prompt {record.prompt_id} made no model call: it has no row")
    return Sample(
        prompt_id=record.prompt_id,
        group_id=group_id,
        prompt_token_ids=list(tokens.prompt_token_ids),
        output_token_ids=list(tokens.output_token_ids),
        behaviour_logprobs=list(tokens.behaviour_logprobs),
        token_versions=list(tokens.token_versions),
        reward=reward,
        finish_reason=tokens.finish_reason if outcome.failure is None else failure_kind(outcome.failure),
        submit_time=outcome.submitted_at,
        finish_time=max(outcome.finished_at, outcome.submitted_at),
        task=record.task,
        output_mask=list(tokens.output_mask),
        turn_starts=list(tokens.turn_starts),
    )


async def score_outcomes(
    record: PromptRecord, outcomes: Sequence[EpisodeOutcome], scorer: RewardScorer
) -> list[tuple[float, str]]:
    """(reward, reason) of each outcome, in order: a failed episode or one that made no model
    call scores 0 (reason: the failure's kind, ``no_model_call``); an episode's own reward
    is kept (reason ``episode``); the others are scored together by the row's reward on
    their last assistant message (its reason)."""
    open_ = [o.tokens.final_text for o in outcomes if o.tokens is not None and not o.failed and o.reward is None]
    results = iter(await scorer.score([reward_request(record, text) for text in open_]) if open_ else [])
    scored: list[tuple[float, str]] = []
    for outcome in outcomes:
        if outcome.failure is not None:
            scored.append((0.0, failure_kind(outcome.failure)))
        elif outcome.tokens is None:
            scored.append((0.0, NO_MODEL_CALL))
        elif outcome.reward is not None:
            scored.append((outcome.reward, "episode"))
        else:
            result = next(results)
            scored.append((result.reward, str(result.reason)))
    return scored


class EpisodeRunner:
    """Runs the n episodes of a prompt at once through the recording endpoint; episode i of
    group g in ``scope`` has the stable id ``<scope>.<g>.<i>`` (:func:`stable_episode_id`)."""

    def __init__(
        self, function: EpisodeFunction, recorder: EpisodeRecorder, config: EpisodeConfig, model: str, *, scope: str,
        turns: TurnJournal | None = None,
    ) -> None:  # fmt: skip
        self.function = function
        self.recorder = recorder
        self.config = config
        self.model = model
        self.scope = scope
        """The run's name (an evaluation's: with its version), the first part of every episode id."""
        self.turns = turns
        """The recording endpoint's turn journal: a group's episodes are tracked there while they run."""

    async def run_group(self, group: str, record: PromptRecord, n: int) -> list[EpisodeOutcome]:
        """The outcomes of the ``n`` episodes of group ``group`` (prompt ``record``), in episode
        order. A failing episode never cancels the others (its failure is in its outcome)."""

        def context_for(index: int, episode_id: str) -> Callable[[str], EpisodeContext]:
            return lambda base_url: EpisodeContext(
                row=record,
                base_url=base_url,
                api_key=EPISODE_API_KEY,
                model=self.model,
                sample_index=index,
                options=dict(self.config.options),
                episode_id=episode_id,
            )

        ids = [stable_episode_id(self.scope, group, i) for i in range(n)]
        if self.turns is not None:
            self.turns.track(group, ids)
        return list(
            await asyncio.gather(
                *(
                    run_episode(self.function, context_for(i, ids[i]), self.recorder, self.config.timeout_s, ids[i])
                    for i in range(n)
                )
            )
        )


@asynccontextmanager
async def episode_runner_on(
    client: RolloutClient,
    codec: HFCodec,
    episode: EpisodeConfig,
    max_episode_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    model: str = "asyncrl-policy",
    *,
    scope: str,
    turns: TurnJournal | None = None,
) -> AsyncIterator[EpisodeRunner]:
    """An :class:`EpisodeRunner` of ``episode`` (episode ids in ``scope``) behind a recording
    endpoint on 127.0.0.1 in front of ``client``'s servers (stopped on exit), its completed
    turns journaled in ``turns`` and replayed from it (a resumed run). The user's
    function is imported first: a bad import path fails here, naming the field, before any
    model call."""
    function = load_episode(episode.function)
    proxy = RecordingProxy(
        client,
        codec.tokenizer,
        default_temperature=temperature,
        default_top_p=top_p,
        max_episode_tokens=max_episode_tokens,
        max_context_tokens=episode.max_context_tokens,
        turns=turns,
    )
    await proxy.start(host="127.0.0.1", port=0)
    try:
        yield EpisodeRunner(function, proxy, episode, model=model, scope=scope, turns=turns)
    finally:
        await proxy.stop()
