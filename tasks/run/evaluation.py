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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asyncrl.tasks.scheduler.controller import RewardScorer, TextCodec
from asyncrl.tasks.data.loader import PromptRecord
from asyncrl.tasks.reward.pass_at_k import CORRECT_REWARD, task_figures
from asyncrl.tasks.reward.requests import reward_request
from asyncrl.tasks.rollout.client import RolloutClient


@dataclass(frozen=True)
class EvalResult:
    version: int
    pass_at_1: float
    prompts: int
    samples_per_prompt: int
    mean_output_tokens: float
    by_task: dict[str, float] = field(default_factory=dict)
    """:func:`task_figures` of the held-out prompts (``pass_at_1/<task>``, ...)."""

    def metrics(self) -> dict[str, float]:
        return {
            "eval_pass_at_1": self.pass_at_1,
            "eval_prompts": float(self.prompts),
            "eval_mean_output_tokens": self.mean_output_tokens,
            **{f"eval_{name}": value for name, value in self.by_task.items()},
        }


def pass_at_1(correct_counts: Sequence[int], samples_per_prompt: int) -> float:
    """Mean over prompts of c_p / n (see the module docstring)."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if not correct_counts:
        raise ValueError("pass@1 of zero prompts is undefined")
    return sum(c / samples_per_prompt for c in correct_counts) / len(correct_counts)


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
    temperature: float,
    stop_token_ids: Sequence[int],
    concurrency: int = 64,
    on_prompt_done: Callable[[], None] | None = None,
    pass_k: Sequence[int] = (),
) -> EvalResult:
    """Generate `samples_per_prompt` answers per held-out prompt and score them, with at most
    `concurrency` prompt groups in flight (the server batches their samples, so more groups in
    flight keep a CPU server busier)."""
    limit = asyncio.Semaphore(concurrency)
    lengths: list[int] = []

    async def one(record: PromptRecord) -> list[float]:
        async with limit:
            outputs = await client.generate_group(
                codec.encode(render(record)), samples_per_prompt, max_new_tokens, temperature,
                stop_token_ids=stop_token_ids,
            )
        lengths.extend(len(o.output_token_ids) for o in outputs)
        results = await scorer.score(
            [reward_request(record, codec.decode(o.output_token_ids)) for o in outputs]
        )
        if on_prompt_done is not None:
            on_prompt_done()
        return [r.reward for r in results]

    rewards = await asyncio.gather(*(one(record) for record in prompts))
    counts = [sum(1 for r in prompt_rewards if r >= CORRECT_REWARD) for prompt_rewards in rewards]
    return EvalResult(
        version=version,
        pass_at_1=pass_at_1(counts, samples_per_prompt),
        prompts=len(prompts),
        samples_per_prompt=samples_per_prompt,
        mean_output_tokens=sum(lengths) / max(len(lengths), 1),
        by_task=task_figures(zip((record.task for record in prompts), rewards, strict=True), pass_k),
    )
