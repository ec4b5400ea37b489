"""The controller journals its groups in flight and a restarted controller goes on from the
journal: a stopped controller's groups are written by the next one with their journaled
tokens first, generating only the rest; written groups leave the journal. In an agent run
the episodes' completed turns are journaled and replayed the same way.

The generator is a stand-in for the vLLM edge that drips tokens into the real book
(:class:`SampleJournal`) the way the rollout client does; the controller, the journal
writer, the storage and the episodes are the real ones. ``tests/integration/inference/
test_journal_resume.py`` runs the client's side on a real server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.episode import EpisodeConfig
from asyncrl.examples import calculator
from asyncrl.storage.fs import open_root
from asyncrl.storage.journal import JOURNAL_PATH, read_journal, read_journal_contents
from asyncrl.storage.shards import ShardReader
from asyncrl.tasks.agent.episodes import AgentEpisodes, SingleTurnEpisodes
from asyncrl.tasks.agent.runner import EpisodeRunner
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.proxy import RecordingProxy
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.turn_journal import TurnJournal
from asyncrl.tasks.model.tokenizer import IM_END_TOKEN, build_tokenizer, special_token_ids
from asyncrl.tasks.inference.samples import SampleOutput, Segment, UpdateStats
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult
from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule
from controller_settings_builder import flat_controller_settings

RUN_ID = "run-journal"
LENGTH = 40


class DripGenerator:
    """Each sample gets token ``mark`` every ``tick_s`` until LENGTH, through the book."""

    def __init__(self, book: SampleJournal, mark: int, tick_s: float = 0.005) -> None:
        self.book = book
        self.mark = mark
        self.tick_s = tick_s
        self.current_version = 0
        self.streamed = 0

    async def generate_group(
        self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float = 1.0,
        top_p: float = 1.0, *, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
        journal_key: str | None = None,
    ) -> list[SampleOutput]:
        assert journal_key is not None
        partials = self.book.start_group(journal_key, prompt_token_ids, n, LENGTH, time.time())
        while any(p.remaining and p.finish_reason is None for p in partials):
            await asyncio.sleep(self.tick_s)
            for p in partials:
                if p.remaining and p.finish_reason is None:
                    p.extend(Segment([self.mark], [-0.5], [self.current_version], "abort"))
                    self.streamed += 1
        return [p.finish(p.finish_reason or "length", time.time()) for p in partials]

    def streamed_tokens(self) -> dict[str, int]:
        return {"drip": self.streamed}

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats:
        self.current_version = version
        return UpdateStats(version, "recompute", 0.0, {}, {}, 0)


class Codec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(48 + t) for t in token_ids)


class ZeroScorer:
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        return [RewardResult(0.0, Reason.WRONG_ANSWER) for _ in requests]


def controller(root: Path, generator: DripGenerator, book: SampleJournal, max_groups: int | None) -> RolloutController:
    settings = flat_controller_settings(
        run_id=RUN_ID, batch_groups=2, eta=1, n_samples=2, max_new_tokens=LENGTH, max_prompt_tokens=16,
        shard_groups=1, shard_seconds=0.1, weight_poll_seconds=0.05, admit_poll_seconds=0.01, max_groups=max_groups,
        journal_tokens=8, journal_seconds=30.0,
    )  # fmt: skip
    records = [PromptRecord(prompt_id=f"p{i}", prompt=f"Q{i}", answer="x", solution=None) for i in range(8)]
    episodes = SingleTurnEpisodes(settings.sampling, lambda r: r.prompt, Codec(), generator, ZeroScorer())
    return RolloutController(
        settings, open_root(str(root)), PromptSchedule(records, seed=0), generator=generator, episodes=episodes,
        weight_loader=lambda version: (lambda address: None), journal=book,
    )  # fmt: skip


def test_a_restarted_controller_goes_on_from_the_journal_and_generates_only_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    first_book = SampleJournal()
    first = DripGenerator(first_book, mark=1, tick_s=0.01)
    ctrl = controller(root, first, first_book, max_groups=None)  # the gate admits 4 groups at version 0

    async def first_life() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(ctrl.run(stop))
        while first.streamed < 4 * 2 * 12:  # the 4 groups' samples about a third of the way
            await asyncio.sleep(0.01)
        stop.set()
        await task

    asyncio.run(first_life())
    journal = read_journal(open_root(str(root)))
    journaled = {key: [len(s.token_ids) for s in samples] for key, samples in journal.items()}
    assert len(journaled) == 4 and all(0 < n < LENGTH for counts in journaled.values() for n in counts), journaled
    figures = ctrl.stats.journal
    assert figures["journal_writes"] >= 2 and figures["journal_last_bytes"] == (root / JOURNAL_PATH).stat().st_size

    second_book = SampleJournal()
    second = DripGenerator(second_book, mark=2)
    again = controller(root, second, second_book, max_groups=4)

    async def second_life() -> None:
        await again.run(asyncio.Event())  # to max_groups

    asyncio.run(second_life())
    reader = ShardReader(open_root(str(root)), RUN_ID)
    written = {g[0].group_id: g for shard in reader.list_shards() for g in reader.read_groups(shard)}
    assert sorted(written) == sorted(journaled)
    resumed = 0
    for key, group in written.items():
        for sample, count in zip(group, journaled[key], strict=True):
            assert list(sample.output_token_ids) == [1] * count + [2] * (LENGTH - count)
            resumed += count
    assert second_book.counts.resumed_tokens == resumed and second.streamed == 4 * 2 * LENGTH - resumed
    summary = again.stats.summary()
    assert summary["journal_resumed_samples"] == 8 and summary["wasted_tokens"] == 0
    assert read_journal(open_root(str(root))) == {} or all(
        key in written for key in read_journal(open_root(str(root)))
    )  # what is left names written groups only, which a restart never dispatches


class TurnModel:
    """The proxy's model for the calculator episode (:func:`asyncrl.examples.calculator.solve`):
    a first turn calls ``calc`` on ``<salt>*2`` (``salt`` tells the lives apart), a later one
    answers; with ``hold`` later turns wait for it (the scheduler is stopped meanwhile)."""

    def __init__(self, helpers: Any, salt: int, hold: asyncio.Event | None = None) -> None:  # noqa: ANN401
        self.helpers = helpers
        self.salt = salt
        self.hold = hold
        self.current_version = 0
        self.first_turns = 0
        self.later_turns = 0

    async def generate_one(
        self, prompt_token_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        *, stop_token_ids: Sequence[int] = (), prefer_server: str | None = None,
    ) -> tuple[SampleOutput, str]:  # fmt: skip
        if list(prompt_token_ids).count(IM_END) <= FIRST_TURN_ENDS:
            self.first_turns += 1
            text = f'<tool_call>\n{{"name": "calc", "arguments": {{"expr": "{self.salt}*2"}}}}\n</tool_call>'
        else:
            if self.hold is not None:
                await self.hold.wait()
            self.later_turns += 1
            text = "#### 2"
        ids = list(TOKENIZER.encode(text, add_special_tokens=False)) + [IM_END]
        return self.helpers.sample_output(ids, "stop", [self.current_version] * len(ids)), "http://s1"

    async def generate_group(self, *args: Any, **kwargs: Any) -> list[SampleOutput]:
        raise AssertionError("an agent run generates through its episodes")

    def streamed_tokens(self) -> dict[str, int]:
        return {}

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats:
        self.current_version = version
        return UpdateStats(version, "recompute", 0.0, {}, {}, 0)


TOKENIZER = build_tokenizer(320, 2048)
IM_END = special_token_ids()[IM_END_TOKEN]
FIRST_TURN_ENDS = 2
"""End-of-message tokens in the calculator's first prompt (the system turn with the tools, the
user's question); a context with more holds a model turn."""
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"properties": {"expr": {}}}}}]


async def agent_life(root: Path, model: TurnModel, memo: Path, max_groups: int | None,
                     until: Callable[[], bool] | None) -> tuple[RolloutController, TurnJournal]:  # fmt: skip
    """One scheduler life of a calculator agent run: stopped once ``until`` holds, or at ``max_groups``."""
    settings = flat_controller_settings(
        run_id=RUN_ID, batch_groups=1, eta=0, n_samples=2, max_new_tokens=LENGTH, max_prompt_tokens=400,
        shard_groups=1, shard_seconds=0.1, weight_poll_seconds=0.05, admit_poll_seconds=0.01, max_groups=max_groups,
        journal_tokens=8, journal_seconds=30.0,
    )  # fmt: skip
    records = [PromptRecord(prompt_id=f"p{i}", prompt=f"What is {i}*2?", answer=str(2 * i)) for i in range(4)]
    book, turns = SampleJournal(), TurnJournal()
    episode = EpisodeConfig(function="m:f", options={"tools": TOOLS, "max_turns": 3, "memo_dir": str(memo)})
    proxy = RecordingProxy(model, TOKENIZER, max_episode_tokens=400, max_context_tokens=2048, turns=turns)
    await proxy.start(host="127.0.0.1", port=0)
    try:
        runner = EpisodeRunner(calculator.solve, proxy, episode, model="m", scope="agent", turns=turns)
        ctrl = RolloutController(
            settings, open_root(str(root)), PromptSchedule(records, seed=0), generator=model,
            episodes=AgentEpisodes(runner, ZeroScorer(), 2), weight_loader=lambda version: (lambda address: None),
            journal=book, turns=turns,
        )  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(ctrl.run(stop))
        while until is not None and not until():
            await asyncio.sleep(0.01)
        if until is not None:
            stop.set()
        await task
    finally:
        await proxy.stop()
    return ctrl, turns


def test_an_agent_group_run_again_resumes_each_episode_at_its_last_completed_turn(
    tmp_path: Path, helpers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The real controller, journal writer, recording endpoint, episode runner and calculator:
    a scheduler stopped while its episodes wait in their second turn leaves their first turns
    in the journal; the next life replays them (its model is asked for the second turns only,
    the tool does not run again) and writes rows that begin with the first life's turns."""
    ran: list[str] = []
    real_calc = calculator.calc
    monkeypatch.setattr(calculator, "calc", lambda expr: ran.append(expr) or real_calc(expr))
    root, memo = tmp_path / "run", tmp_path / "memo"
    first = TurnModel(helpers, salt=7, hold=asyncio.Event())  # never set: the second turns wait
    ctrl, _ = asyncio.run(agent_life(root, first, memo, None, until=lambda: first.first_turns == 2))
    journal = read_journal_contents(open_root(str(root)))
    (group,) = journal.turns
    assert [(t.episode, t.turn) for t in journal.turns[group]] == [(f"agent.{group}.0", 0), (f"agent.{group}.1", 0)]
    assert ran == ["7*2", "7*2"] and ctrl.stats.journal["journal_writes"] >= 1

    second = TurnModel(helpers, salt=9)
    again, turns = asyncio.run(agent_life(root, second, memo, max_groups=1, until=None))
    assert second.first_turns == 0 and second.later_turns == 2  # only the second turns were sampled
    assert ran == ["7*2", "7*2"]  # the replayed calls' keys were in the memo
    assert turns.counts.replayed_turns == 2 and again.stats.summary()["journal_replayed_turns"] == 2
    reader = ShardReader(open_root(str(root)), RUN_ID)
    (rows,) = [g for shard in reader.list_shards() for g in reader.read_groups(shard)]
    assert rows[0].group_id == group
    for row, saved in zip(rows, journal.turns[group], strict=True):
        assert list(row.output_token_ids[: len(saved.token_ids)]) == list(saved.token_ids)
        text = TOKENIZER.decode(list(row.output_token_ids))
        assert '"7*2"' in text and '"9*2"' not in text
