"""An agent episode run again resumes at its last completed turn: the recording endpoint answers
each call that repeats a journaled turn from the turn journal (same tokens, log-probs and
versions, the same tool calls and keys), the calculator answers those calls from its memo, and
the first call that differs is sampled, the episode's later journaled turns dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.episode import EpisodeConfig
from asyncrl.examples import calculator
from asyncrl.storage.journal import JournaledTurn
from asyncrl.tasks.agent.episode import EpisodeOutcome
from asyncrl.tasks.agent.runner import EpisodeRunner
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.proxy import RecordingProxy
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.turn_journal import TurnJournal
from asyncrl.tasks.model.tokenizer import IM_END_TOKEN, build_tokenizer, special_token_ids

RECORD = PromptRecord(prompt_id="000001-abc", prompt="What is 482*37+5?", answer="17839")
TOKENIZER = build_tokenizer(320, 2048)
IM_END = special_token_ids()[IM_END_TOKEN]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"properties": {"expr": {}}}}}]
GROUP = "g00000003"
EPISODE = f"demo-tool.{GROUP}.0"


class Model:
    """Asks ``calc`` for ``482*37+<salt + k>`` on an episode's first turn (k counts this model's
    calls: sampled again, it asks otherwise) and answers on the next; tokens of ``version``."""

    def __init__(
        self, helpers: Any, version: int, salt: int = 0,  # noqa: ANN401 - the session's plain helpers
        fail_at: int | None = None, first_prompt_ends: int | None = None,
    ) -> None:  # fmt: skip
        self.helpers = helpers
        self.first_prompt_ends = first_prompt_ends
        """End-of-message tokens in an episode's first prompt (taken from the first call if
        None): a context with more is a later turn."""
        self.version = version
        self.salt = salt
        self.fail_at = fail_at
        self.calls = 0

    async def generate_one(
        self, prompt_token_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        *, stop_token_ids: Sequence[int] = (), prefer_server: str | None = None,
    ) -> tuple[SampleOutput, str]:  # fmt: skip
        if self.calls == self.fail_at:
            raise RuntimeError("the scheduler was killed here")
        ends = list(prompt_token_ids).count(IM_END)
        if self.first_prompt_ends is None:
            self.first_prompt_ends = ends
        first_turn = ends == self.first_prompt_ends
        text = (
            f'<tool_call>\n{{"name": "calc", "arguments": {{"expr": "482*37+{self.salt + self.calls}"}}}}\n</tool_call>'
            if first_turn
            else f"#### {17839 + self.calls}"
        )
        self.calls += 1
        ids = list(TOKENIZER.encode(text, add_special_tokens=False)) + [IM_END]
        return self.helpers.sample_output(ids, "stop", [self.version] * len(ids)), "http://s1"


def run_group(model: Model, turns: TurnJournal, memo: Path, max_turns: int = 3) -> EpisodeOutcome:
    config = EpisodeConfig(function="m:f", options={"tools": TOOLS, "max_turns": max_turns, "memo_dir": str(memo)})

    async def main() -> EpisodeOutcome:
        proxy = RecordingProxy(model, TOKENIZER, max_episode_tokens=1000, max_context_tokens=2048, turns=turns)
        await proxy.start(host="127.0.0.1", port=0)
        try:
            runner = EpisodeRunner(calculator.solve, proxy, config, model="m", scope="demo-tool", turns=turns)
            (outcome,) = await runner.run_group(GROUP, RECORD, 1)
        finally:
            await proxy.stop()
        return outcome

    return asyncio.run(main())


def resumed_from(saved: list[JournaledTurn]) -> TurnJournal:
    """The book of a restarted scheduler that read ``saved`` from the journal."""
    book = TurnJournal()
    book.load({GROUP: saved})
    return book


@pytest.fixture
def tool_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    ran: list[str] = []
    real_calc = calculator.calc
    monkeypatch.setattr(calculator, "calc", lambda expr: ran.append(expr) or real_calc(expr))
    return ran


def test_a_run_again_replays_its_completed_turns_and_samples_from_the_first_unjournaled_one(
    tmp_path: Path, helpers: Any, tool_runs: list[str]
) -> None:  # fmt: skip
    first, first_model = TurnJournal(), Model(helpers, version=3, fail_at=1)
    killed = run_group(first_model, first, tmp_path / "memo")
    assert killed.failed and tool_runs == ["482*37+0"]  # turn 0 (the tool call) completed, turn 1 did not
    saved = first.snapshot()
    assert [(t.episode, t.turn) for t in saved] == [(EPISODE, 0)] and first.unjournaled_tokens() == 0

    book = resumed_from(saved)
    model = Model(helpers, version=5, salt=100, first_prompt_ends=first_model.first_prompt_ends)
    outcome = run_group(model, book, tmp_path / "memo")
    assert not outcome.failed and outcome.tokens is not None
    assert model.calls == 1  # turn 0 was replayed; only turn 1 was sampled
    assert tool_runs == ["482*37+0"]  # the replayed call's key was in the memo: the tool did not run again
    assert book.counts.replayed_turns == 1 and book.counts.replayed_tokens == len(saved[0].token_ids)
    tokens = outcome.tokens
    first_turn = list(saved[0].token_ids)
    assert tokens.output_token_ids[: len(first_turn)] == first_turn  # the journaled turn, exactly
    model_versions = [v for v, sampled in zip(tokens.token_versions, tokens.output_mask) if sampled]
    assert model_versions[: len(first_turn)] == [3] * len(first_turn)  # staleness: its own version
    assert model_versions[len(first_turn):] == [5] * (len(model_versions) - len(first_turn))
    assert [(t.episode, t.turn) for t in book.snapshot()] == [(EPISODE, 0), (EPISODE, 1)]  # both journaled again


def test_a_call_that_differs_from_its_journaled_turn_is_sampled_and_the_later_turns_dropped(
    tmp_path: Path, helpers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, first_model = TurnJournal(), Model(helpers, version=1)
    run_group(first_model, first, tmp_path / "memo-a")
    saved = first.snapshot()
    assert [t.turn for t in saved] == [0, 1]
    # Without the memo the tool runs again; here it answers otherwise (the world changed), so
    # turn 1's context differs from the journaled one: sampled, and nothing after it replayed.
    calc = calculator.calc
    monkeypatch.setattr(calculator, "calc", lambda expr: str(int(calc(expr)) + 1))
    book = resumed_from(saved)
    model = Model(helpers, version=2, salt=100, first_prompt_ends=first_model.first_prompt_ends)
    outcome = run_group(model, book, tmp_path / "memo-b")
    assert not outcome.failed
    assert book.counts.replayed_turns == 1 and book.counts.diverged == 1 and model.calls == 1


def test_turns_of_untracked_or_forgotten_groups_are_not_journaled(helpers: Any) -> None:
    book = TurnJournal()
    sample = helpers.sample_output([1, 2, IM_END], "stop", [0, 0, 0])
    book.record("other.g1.0", 0, [9], 8, sample)  # an evaluation's episode: never tracked
    assert book.snapshot() == [] and book.unjournaled_tokens() == 0
    book.track("g2", ["run.g2.0"])
    book.record("run.g2.0", 0, [9], 8, sample)
    assert book.unjournaled_tokens() == 3 and len(book.snapshot()) == 1
    book.load({"g2": book.snapshot()})
    book.forget(["g2"])  # written: its turns go, and none is replayed
    assert book.snapshot() == [] and book.replay("run.g2.0", 0, [9], 8) is None
