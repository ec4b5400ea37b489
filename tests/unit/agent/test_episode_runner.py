"""The episode runner's rules without servers: how an episode's end becomes its outcome,
which outcomes become rows, and the row a kept episode is.

The recorder here is a stand-in for the recording endpoint (an edge of the runner: the
endpoint itself is tested on a real vLLM server in tests/integration/inference/).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncrl.configs.episode import EpisodeConfig
from asyncrl.tasks.agent.episode import (
    EPISODE_API_KEY,
    EpisodeContext,
    EpisodeOutcome,
    episode_reward,
    load_episode,
    run_episode,
)
from asyncrl.tasks.agent.runner import (
    NO_MODEL_CALL,
    OTHER_PROMPT,
    EpisodeRunner,
    episode_sample,
    kept_outcomes,
)
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.conversation import EpisodeTokens

RECORD = PromptRecord(prompt_id="000001-abc", prompt="What is 2*3?", answer="6")


def tokens(prompt: Sequence[int] = (1, 2), finish_reason: str = "stop", budget_exhausted: bool = False) -> EpisodeTokens:
    """Two model turns (3 + 2 tokens) around 2 inserted tokens."""
    return EpisodeTokens(
        prompt_token_ids=list(prompt),
        output_token_ids=[10, 11, 12, 50, 51, 13, 14],
        output_mask=[True, True, True, False, False, True, True],
        behaviour_logprobs=[-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5],
        token_versions=[3, 3, 4, 4, 4, 5, 5],
        turn_starts=[0, 5],
        finish_reason=finish_reason,
        final_text="#### 6",
        budget_exhausted=budget_exhausted,
    )


class Recorder:
    """Hands out base URLs and returns what each episode "generated"."""

    def __init__(self, made: dict[int, EpisodeTokens | None] | None = None) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.made = made or {}

    def open_episode(self, episode_id: str) -> str:
        self.opened.append(episode_id)
        return f"http://127.0.0.1:1/episodes/{episode_id}/v1"

    def close_episode(self, episode_id: str) -> EpisodeTokens | None:
        self.closed.append(episode_id)
        return self.made.get(len(self.closed) - 1, tokens())


def context_builder(base_url: str) -> EpisodeContext:
    return EpisodeContext(RECORD, base_url, EPISODE_API_KEY, "m", 0)


@pytest.mark.parametrize(
    ("value", "reward", "failed"),
    [(None, None, False), (1, 1.0, False), (0.25, 0.25, False), (True, None, True), (math.nan, None, True), ("1", None, True)],
)
def test_what_an_episode_returns_is_its_reward_or_a_failure(value: object, reward: float | None, failed: bool) -> None:
    got_reward, failure = episode_reward(value)
    assert got_reward == reward
    assert (failure is not None) == failed
    if failed:
        assert failure is not None and failure.startswith("episode_error: returned")


def test_a_raising_episode_is_an_outcome_with_its_error_and_its_tokens() -> None:
    async def episode(context: EpisodeContext) -> float:
        assert context.base_url.endswith("/v1") and context.api_key == EPISODE_API_KEY
        raise KeyError("tool 'calc' is missing")

    recorder = Recorder()
    outcome = asyncio.run(run_episode(episode, context_builder, recorder, timeout_s=5))
    assert outcome.failure == "episode_error: KeyError: \"tool 'calc' is missing\""
    assert outcome.tokens is not None and outcome.reward is None
    assert recorder.opened == recorder.closed  # closed even though it raised


def test_an_episode_past_its_time_limit_is_cancelled_and_says_so() -> None:
    cancelled = asyncio.Event()

    async def episode(context: EpisodeContext) -> float:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()
        return 1.0

    outcome = asyncio.run(run_episode(episode, context_builder, Recorder(), timeout_s=0.2))
    assert outcome.failure is not None and outcome.failure.startswith("episode_timeout")
    assert cancelled.is_set()


def test_a_timeout_error_raised_by_the_users_code_is_an_error_not_the_time_limit() -> None:
    async def episode(context: EpisodeContext) -> float:
        raise TimeoutError("the tool's backend did not answer")

    outcome = asyncio.run(run_episode(episode, context_builder, Recorder(), timeout_s=30))
    assert outcome.failure == "episode_error: TimeoutError: the tool's backend did not answer"


def test_cancelling_the_runner_propagates_and_closes_the_episode() -> None:
    recorder = Recorder()

    async def episode(context: EpisodeContext) -> float:
        await asyncio.sleep(60)
        return 1.0

    async def main() -> None:
        task = asyncio.create_task(run_episode(episode, context_builder, recorder, timeout_s=30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(recorder.closed) == 1


def outcome(made: EpisodeTokens | None, failure: str | None = None, reward: float | None = None) -> EpisodeOutcome:
    return EpisodeOutcome(made, reward, failure, 100.0, 101.0)


def test_kept_outcomes_under_record_and_drop() -> None:
    outcomes = [
        outcome(tokens()),
        outcome(tokens(), failure="episode_error: ValueError: bad tool arguments"),
        outcome(None, failure="episode_timeout: still running after 5 s"),
        outcome(None),
        outcome(tokens(prompt=(1, 9))),
    ]
    recorded = kept_outcomes(outcomes, "record")
    assert recorded.kept == outcomes[:2]
    assert recorded.left_out == {"episode_timeout": 1, NO_MODEL_CALL: 1, OTHER_PROMPT: 1}
    dropped = kept_outcomes(outcomes, "drop")
    assert dropped.kept == outcomes[:1]
    assert dropped.left_out == {"episode_error": 1, "episode_timeout": 1, NO_MODEL_CALL: 1, OTHER_PROMPT: 1}


def test_the_group_prompt_is_the_one_most_episodes_share() -> None:
    outcomes = [outcome(tokens(prompt=(7,))), outcome(tokens(prompt=(1, 2))), outcome(tokens(prompt=(1, 2)))]
    chosen = kept_outcomes(outcomes, "record")
    assert chosen.kept == outcomes[1:] and chosen.left_out == {OTHER_PROMPT: 1}


def test_a_kept_episode_becomes_one_masked_row() -> None:
    sample = episode_sample(RECORD, "g00000003", outcome(tokens()), reward=1.0)
    assert sample.prompt_token_ids == [1, 2]
    assert sample.output_token_ids == [10, 11, 12, 50, 51, 13, 14]
    assert sample.output_mask == [True, True, True, False, False, True, True]
    assert sample.turn_starts == [0, 5]
    assert sample.token_versions == [3, 3, 4, 4, 4, 5, 5]
    assert (sample.reward, sample.finish_reason, sample.task, sample.group_id) == (1.0, "stop", "math", "g00000003")
    failed = episode_sample(RECORD, "g00000003", outcome(tokens(), failure="episode_timeout: late"), reward=0.0)
    assert failed.finish_reason == "episode_timeout"
    with pytest.raises(ValueError, match="made no model call"):
        episode_sample(RECORD, "g00000003", outcome(None), reward=0.0)


def test_the_runner_runs_n_episodes_at_once_and_one_failure_spares_the_others() -> None:
    started: list[int] = []
    both_started = asyncio.Event()

    async def episode(context: EpisodeContext) -> float:
        started.append(context.sample_index)
        if len(started) == 3:
            both_started.set()
        await asyncio.wait_for(both_started.wait(), 5)  # all three run at the same time
        assert context.options == {"max_turns": 2} and context.row is RECORD
        if context.sample_index == 1:
            raise RuntimeError("tool crashed")
        return float(context.sample_index)

    runner = EpisodeRunner(episode, Recorder(), EpisodeConfig(function="m:f", options={"max_turns": 2}), model="m", scope="run")
    outcomes = asyncio.run(runner.run_group("g00000000", RECORD, 3))
    assert [o.reward for o in outcomes] == [0.0, None, 2.0]
    assert outcomes[1].failure == "episode_error: RuntimeError: tool crashed"


def test_load_episode_names_the_field_for_a_function_that_is_not_async(tmp_path: Path) -> None:
    module = tmp_path / "episodes.py"
    module.write_text("def solve(context):\n    return 1.0\n\nasync def good(context):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"rollout\.episode\.function: .* must be an 'async def'"):
        load_episode(f"{module}:solve")
    with pytest.raises(ValueError, match=r"rollout\.episode\.function: .*has no attribute 'missing'"):
        load_episode(f"{module}:missing")
    assert asyncio.run(load_episode(f"{module}:good")(None)) == 1.0  # type: ignore[arg-type]


def test_an_episode_that_raises_once_its_budget_is_spent_is_over_budget() -> None:
    async def episode(context: EpisodeContext) -> float:
        raise RuntimeError("400: episode budget exhausted")

    recorder = Recorder({0: tokens(finish_reason="length", budget_exhausted=True)})
    outcome = asyncio.run(run_episode(episode, context_builder, recorder, timeout_s=5))
    assert outcome.failure == "episode_over_budget: RuntimeError: 400: episode budget exhausted"
    # a turn cut by the request's own max_tokens is no spent budget
    recorder = Recorder({0: tokens(finish_reason="length")})
    outcome = asyncio.run(run_episode(episode, context_builder, recorder, timeout_s=5))
    assert outcome.failure == "episode_error: RuntimeError: 400: episode budget exhausted"


def test_the_run_config_names_the_fields_of_a_bad_episode_section(tmp_path: Path) -> None:
    from asyncrl.configs.run_config import RunConfig
    from pydantic import ValidationError

    base = {
        "name": "episodes", "model": {"path": str(tmp_path)}, "data": {"train_path": str(tmp_path / "t.jsonl")},
        "storage": {"root": str(tmp_path / "store")}, "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db"},
        "trainer": {"micro_batch_tokens": 512},
    }  # fmt: skip
    good = {"function": "examples.calculator:solve", "max_context_tokens": 512}
    RunConfig.model_validate({**base, "rollout": {"episode": good}})
    for rollout, message in (
        ({"episode": {**good, "function": "no-colon"}}, "rollout.episode.function"),
        ({"episode": {**good, "on_failure": "retry"}}, "rollout.episode.on_failure"),
        ({"episode": {**good, "max_context_tokens": 1024}}, "rollout.episode.max_context_tokens = 1024"),
        ({"episode": good, "ignore_eos": True}, "rollout.ignore_eos"),
    ):
        with pytest.raises(ValidationError, match=message.replace(".", r"\.")):
            RunConfig.model_validate({**base, "rollout": rollout})
