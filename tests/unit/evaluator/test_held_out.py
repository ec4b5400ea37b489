"""Held-out evaluation goes through training's own episodes: each row's token budget and the
prompt-length bound hold as in training, pass@1 and pass@k count the scored answers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.evaluator.held_out import DEFAULT_CONCURRENCY, eval_concurrency, evaluate, pass_at_1
from asyncrl.tasks.inference.samples import SampleOutput, SampleTimings
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult


class CountingGenerator:
    """Answers with the prompt's first character repeated up to the budget; records budgets."""

    current_version = 0

    def __init__(self) -> None:
        self.budgets: list[int] = []

    async def generate_group(
        self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float = 1.0,
        top_p: float = 1.0, *, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
        journal_key: str | None = None,
    ) -> list[SampleOutput]:  # fmt: skip
        self.budgets.append(max_new_tokens)
        tokens = [prompt_token_ids[0]] * min(max_new_tokens, 3)
        timings = SampleTimings(submitted_at=0.0, finished_at=0.0, interruptions=0, retries=0, segments=1)
        return [SampleOutput(list(tokens), [0.0] * len(tokens), [0] * len(tokens), "stop", timings) for _ in range(n)]


class Codec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)


class RightWhenAnswerMatches:
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        return [RewardResult(1.0, Reason.OK) if r.response == r.reference else RewardResult(0.0, Reason.WRONG_ANSWER)
                for r in requests]  # fmt: skip


def _run(rows: list[PromptRecord], generator: CountingGenerator, max_prompt_tokens: int = 8):  # noqa: ANN202
    return asyncio.run(
        evaluate(
            generator, 3, rows, lambda r: r.prompt, Codec(), RightWhenAnswerMatches(),  # type: ignore[arg-type]
            samples_per_prompt=2, max_new_tokens=5, max_prompt_tokens=max_prompt_tokens, temperature=1.0,
            stop_token_ids=(), pass_k=(2,),
        )
    )  # fmt: skip


def test_rows_are_answered_within_their_own_budget_and_scored_as_in_training() -> None:
    rows = [
        PromptRecord(prompt_id="a", prompt="a?", answer="aaa", solution=None),
        PromptRecord(prompt_id="b", prompt="b?", answer="bbb", solution=None, max_new_tokens=2),  # answers "bb"
    ]
    generator = CountingGenerator()
    result = _run(rows, generator)
    assert generator.budgets == [5, 2]
    assert result.pass_at_1 == pass_at_1([2, 0], 2) == 0.5
    assert result.mean_output_tokens == pytest.approx((3 + 3 + 2 + 2) / 4)
    assert (result.version, result.prompts, result.samples_per_prompt) == (3, 2, 2)
    assert result.by_task["pass_at_2/math"] == 0.5


def test_a_held_out_prompt_over_the_prompt_bound_fails_naming_it() -> None:
    rows = [PromptRecord(prompt_id="long", prompt="x" * 9, answer="1", solution=None)]
    with pytest.raises(ValueError, match="prompt long has 9 tokens, over data.max_prompt_tokens = 8"):
        _run(rows, CountingGenerator())


class OverlapCountingGenerator(CountingGenerator):
    """Holds each group a moment and records the most groups in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.most_in_flight = 0

    async def generate_group(self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, *args: object,
                             **kwargs: object) -> list[SampleOutput]:  # fmt: skip
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return await super().generate_group(prompt_token_ids, n, max_new_tokens)


@pytest.mark.parametrize("concurrency", [3, 10])
def test_at_most_concurrency_prompt_groups_are_in_flight(concurrency: int) -> None:
    rows = [PromptRecord(prompt_id=str(i), prompt=f"{i}?", answer="x", solution=None) for i in range(10)]
    generator = OverlapCountingGenerator()
    asyncio.run(
        evaluate(
            generator, 0, rows, lambda r: r.prompt, Codec(), RightWhenAnswerMatches(),  # type: ignore[arg-type]
            samples_per_prompt=2, max_new_tokens=5, max_prompt_tokens=8, temperature=1.0, stop_token_ids=(),
            concurrency=concurrency,
        )
    )  # fmt: skip
    assert generator.most_in_flight == concurrency


def test_the_concurrency_fills_a_server_that_decodes_more_sequences() -> None:
    assert eval_concurrency(None, 2) == DEFAULT_CONCURRENCY  # vLLM's default batch: as before
    assert eval_concurrency(512, 2) == 256 and eval_concurrency(401, 2) == 201
    assert eval_concurrency(16, 2) == DEFAULT_CONCURRENCY  # never fewer groups than before
