"""Held-out evaluation through vLLM: pass@1 averaged over n samples per prompt.

    pass@1 = (1 / P) * sum_p (c_p / n)

with P prompts, n samples per prompt and c_p the samples of prompt p that the reward
service scores correct (reward 1). Sampling at the rollout temperature gives the
unbiased pass@1 estimate of the sampling policy, not of greedy decoding. Each prompt is
scored by its own task's reward (math, code or a plug-in); per task the result also holds
the mean reward, pass@1 and unbiased pass@k (:mod:`asyncrl.tasks.reward.pass_at_k`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.tasks.model.codec import TextCodec, load_codec
from asyncrl.tasks.reward.types import RewardScorer
from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.data.prompting import render_prompt
from asyncrl.tasks.reward.pass_at_k import CORRECT_REWARD, task_figures
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.configs.episode import EpisodeConfig
from asyncrl.storage.evaluations import EvalResult
from asyncrl.tasks.agent.episodes import AgentEpisodes, SamplingSettings, SingleTurnEpisodes
from asyncrl.tasks.agent.runner import episode_runner_on
from asyncrl.tasks.system.busy_time import BusyTime

if TYPE_CHECKING:
    from pathlib import Path

    from asyncrl.configs.processes import EvaluatorProcessConfig

DEFAULT_CONCURRENCY = 64
"""Prompt groups an evaluation keeps in flight on a server with vLLM's default batch size."""


def pass_at_1(correct_counts: Sequence[int], samples_per_prompt: int) -> float:
    """Mean over prompts of c_p / n (see the module docstring)."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if not correct_counts:
        raise ValueError("pass@1 of zero prompts is undefined")
    return sum(c / samples_per_prompt for c in correct_counts) / len(correct_counts)


@dataclass
class HeldOutTally:
    """The :class:`~asyncrl.tasks.agent.episodes.EpisodeStats` of an evaluation: the tokens
    the model sampled per answer; the other figures are a training run's and are dropped."""

    generation: BusyTime = field(default_factory=BusyTime)
    reward_wait_s: float = 0.0
    context_tokens: int = 0
    episodes_left_out: dict[str, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)

    def count_sample(self, task: str, output_tokens: int, reward: float, reason: str) -> None:
        self.lengths.append(output_tokens)


async def evaluate(
    client: RolloutClient,
    version: int,
    prompts: Sequence[PromptRecord],
    render: Callable[[PromptRecord], str],
    codec: TextCodec,
    scorer: RewardScorer,
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    temperature: float,
    stop_token_ids: Sequence[int],
    concurrency: int = DEFAULT_CONCURRENCY,
    on_prompt_done: Callable[[], None] | None = None,
    pass_k: Sequence[int] = (),
    episode: EpisodeConfig | None = None,
    run_name: str = "asyncrl-run",
) -> EvalResult:
    """Generate ``samples_per_prompt`` answers per held-out prompt and score them, with at most
    ``concurrency`` prompt groups in flight (the server batches their samples, so more groups
    in flight keep a CPU server busier). The answers come from training's own episodes
    (:mod:`asyncrl.tasks.agent.episodes`): single-turn samples within the row's token budget,
    or with ``episode`` (``rollout.episode``) runs of the user's episode through a recording
    endpoint on ``client``, scored as in training (episode ids ``<run_name>.v<version>.eval-<prompt>.<sample>``,
    so tool calls' idempotency keys differ from training's and between versions). An answer
    that is not a row (a failed episode left out, one that made no model call) counts as
    wrong; a length is the tokens the model sampled in all its turns."""
    limit = asyncio.Semaphore(concurrency)
    tally = HeldOutTally()
    sampling = SamplingSettings(
        n_samples=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        temperature=temperature,
        stop_token_ids=tuple(stop_token_ids),
    )

    async def one(index: int, record: PromptRecord, episodes: SingleTurnEpisodes | AgentEpisodes) -> list[float]:
        async with limit:
            samples = await episodes.produce(f"eval-{index:06d}", record, tally)
        if on_prompt_done is not None:
            on_prompt_done()
        return [s.reward for s in samples] + [0.0] * (samples_per_prompt - len(samples))

    async def run_all(episodes: SingleTurnEpisodes | AgentEpisodes) -> list[list[float]]:
        return await asyncio.gather(*(one(i, record, episodes) for i, record in enumerate(prompts)))

    if episode is None:
        rewards = await run_all(SingleTurnEpisodes(sampling, render, codec, client, scorer))
    else:
        async with episode_runner_on(
            client, codec, episode, max_new_tokens, temperature, scope=f"{run_name}.v{version}"
        ) as runner:
            rewards = await run_all(AgentEpisodes(runner, scorer, samples_per_prompt))
    counts = [sum(1 for r in prompt_rewards if r >= CORRECT_REWARD) for prompt_rewards in rewards]
    return EvalResult(
        version=version,
        pass_at_1=pass_at_1(counts, samples_per_prompt),
        prompts=len(prompts),
        samples_per_prompt=samples_per_prompt,
        mean_output_tokens=sum(tally.lengths) / max(len(tally.lengths), 1),
        by_task=task_figures(zip((record.task for record in prompts), rewards, strict=True), pass_k),
        prompt_pass=tuple(c / samples_per_prompt for c in counts),
        prompt_tasks=tuple(record.task for record in prompts),
    )


@dataclass(frozen=True)
class HeldOutTask:
    """One held-out evaluation as a run defines it, for any version on any server: the
    prompts, how they are rendered and decoded, and the sampling settings (the rollout's
    budget and temperature)."""

    prompts: Sequence[PromptRecord]
    render: Callable[[PromptRecord], str]
    codec: TextCodec
    samples_per_prompt: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float
    stop_token_ids: Sequence[int]
    pass_k: Sequence[int] = ()
    episode: EpisodeConfig | None = None
    """``rollout.episode``: each answer is one run of the user's episode."""
    run_name: str = "asyncrl-run"
    """The run's ``name``: its episodes' ids begin with it."""
    concurrency: int = DEFAULT_CONCURRENCY
    """Prompt groups in flight (:func:`eval_concurrency`)."""

    async def run(
        self, client: RolloutClient, version: int, scorer: RewardScorer, on_prompt_done: Callable[[], None] | None = None
    ) -> EvalResult:
        """:func:`evaluate` of ``version``, the weights ``client``'s servers hold."""
        return await evaluate(
            client, version, self.prompts, self.render, self.codec, scorer,
            samples_per_prompt=self.samples_per_prompt, max_new_tokens=self.max_new_tokens,
            max_prompt_tokens=self.max_prompt_tokens, temperature=self.temperature, stop_token_ids=self.stop_token_ids, on_prompt_done=on_prompt_done,
            pass_k=self.pass_k, episode=self.episode, run_name=self.run_name, concurrency=self.concurrency,
        )  # fmt: skip


def eval_concurrency(max_num_seqs: int | None, samples: int) -> int:
    """Prompt groups an evaluation keeps in flight: enough to fill a server that decodes
    ``max_num_seqs`` sequences at once (``inference.max_num_seqs``),

        groups = max(DEFAULT_CONCURRENCY, ceil(max_num_seqs / samples))

    and :data:`DEFAULT_CONCURRENCY` when the server keeps vLLM's default."""
    if max_num_seqs is None:
        return DEFAULT_CONCURRENCY
    return max(DEFAULT_CONCURRENCY, math.ceil(max_num_seqs / samples))


def held_out_task(config: EvaluatorProcessConfig, model_dir: Path, prompts: int | None, samples: int) -> HeldOutTask:
    """The run's held-out evaluation: the first ``prompts`` rows of ``data.eval_path`` (None:
    all), ``samples`` per prompt, rendered by ``data.prompt_format`` with the tokenizer of
    ``model_dir`` (a version's or ``model.path``), pass@k for the k of ``tracking.pass_k``
    up to ``samples``."""
    if not config.data.eval_path:
        raise ValueError("data.eval_path: not set; held-out evaluation needs it")
    rows = load_prompts(config.data.eval_path, plugins=config.reward.plugins)[:prompts]
    codec, stop_ids = load_codec(str(model_dir))
    return HeldOutTask(
        prompts=rows,
        render=lambda record: render_prompt(record.prompt, config.data.prompt_format, codec.tokenizer),
        codec=codec,
        samples_per_prompt=samples,
        max_new_tokens=config.rollout.max_new_tokens,
        max_prompt_tokens=config.data.max_prompt_tokens,
        temperature=config.rollout.temperature,
        stop_token_ids=stop_ids,
        pass_k=[k for k in config.pass_k if k <= samples],
        episode=config.rollout.episode,
        run_name=config.name,
        concurrency=eval_concurrency(config.inference.max_num_seqs, samples),
    )
