"""The controller journals its groups in flight and a restarted controller goes on from the
journal: a stopped controller's groups are written by the next one with their journaled
tokens first, generating only the rest; written groups leave the journal.

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

from asyncrl.storage.fs import open_root
from asyncrl.storage.journal import JOURNAL_PATH, read_journal
from asyncrl.storage.shards import ShardReader
from asyncrl.tasks.agent.episodes import SingleTurnEpisodes
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.sample_journal import SampleJournal
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
