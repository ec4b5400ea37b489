"""How the scheduler process is built from its config: the
controller settings, the group's episodes (single-turn or the user's agent episodes), and
the controller run itself."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from asyncrl.configs.processes import SchedulerProcessConfig
from asyncrl.tasks.agent.runner import episode_runner_on
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.data.prompting import render_prompt
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.turn_journal import TurnJournal
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
from asyncrl.tasks.model.codec import HFCodec, load_codec
from asyncrl.tasks.reward.remote import RemoteRewardScorer
from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.controller_stats import ControllerStats
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule
from asyncrl.tasks.scheduler.controller_settings import ControllerSettings
from asyncrl.tasks.agent.episodes import AgentEpisodes, SamplingSettings, SingleTurnEpisodes
from asyncrl.tasks.reward.types import RewardScorer
from asyncrl.tasks.scheduler.protocols import GroupEpisodes
from asyncrl.tasks.system.durable_count import DurableCount
from asyncrl.tasks.system.run_paths import RunPaths


def controller_settings(
    config: SchedulerProcessConfig, stop_token_ids: tuple[int, ...], max_groups: int | None
) -> ControllerSettings:
    """The controller's settings: the ``rollout`` section, its sampling, the run's name, seed
    and ``trainer.batch_groups``."""
    return ControllerSettings(
        run_id=config.name,
        batch_groups=config.trainer.batch_groups,
        rollout=config.rollout,
        sampling=SamplingSettings.from_rollout(config.rollout, config.data.max_prompt_tokens, stop_token_ids),
        seed=config.seed,
        max_groups=max_groups,
    )


DELIVERED_PREFIX = "delivered"
"""The scheduler processes' counts of output tokens received (``RunPaths.token_counts``)."""


def run_scheduler(
    config: SchedulerProcessConfig,
    paths: RunPaths,
    handles: list[RolloutServerHandle],
    prompts: list[PromptRecord],
    stop: threading.Event,
    initial_version: int,
    max_groups: int | None = None,
    codec: tuple[HFCodec, tuple[int, ...]] | None = None,
    delivered: DurableCount | None = None,
) -> ControllerStats:
    """The rollout controller on its own event loop, scoring through the run's reward
    service, until `stop` is set (or, with `max_groups`, until that many groups are admitted
    and produced). ``codec``: the model's (:func:`load_codec`), loaded here if not given;
    ``delivered``: the process's count of output tokens received (``RolloutClient``)."""
    codec, stop_ids = codec or load_codec(config.model.path)
    adapters = config.trainer.lora is not None  # a LoRA run: every version is an adapter
    weight_loader = ServerWeightLoader(
        config.storage.root, config.storage.options, cache_dir=str(paths.work_dir / "weights-cache"), adapters=adapters
    )

    settings = controller_settings(config, stop_ids, max_groups=max_groups)

    async def main() -> ControllerStats:
        stop_async = asyncio.Event()

        async def relay_stop() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.2)
            stop_async.set()

        relay = asyncio.create_task(relay_stop())
        # in-flight samples and completed agent turns are journaled (rollout.journal_tokens > 0)
        journal = SampleJournal() if config.rollout.journal_tokens > 0 else None
        turns = TurnJournal() if journal is not None and config.rollout.episode is not None else None
        try:
            async with RolloutClient(
                handles, interrupt_mode=config.rollout.interrupt_mode, initial_version=initial_version, adapters=adapters,
                journal=journal, delivered=delivered,
            ) as client, RemoteRewardScorer(paths.root) as scorer, group_episodes(
                config, settings, client, codec, scorer, turns
            ) as episodes:
                controller = RolloutController(
                    settings,
                    paths.root,
                    PromptSchedule(prompts, seed=config.seed),
                    generator=client,
                    episodes=episodes,
                    weight_loader=weight_loader.for_version,
                    weight_prefetch=lambda version: weight_loader.prefetch(version, handles),
                    journal=journal,
                    turns=turns,
                )
                return await controller.run(stop_async)
        finally:
            relay.cancel()
            weight_loader.close()

    return asyncio.run(main())


@asynccontextmanager
async def group_episodes(
    config: SchedulerProcessConfig, settings: ControllerSettings, client: RolloutClient, codec: HFCodec,
    scorer: RewardScorer, turns: TurnJournal | None = None,
) -> AsyncIterator[GroupEpisodes]:
    """The run's episodes: single-turn samples of the prompt rendered by
    ``data.prompt_format`` when ``rollout.episode`` is None, else the user's episodes behind
    their recording endpoint (:func:`episode_runner_on`, stopped on exit), whose completed
    turns go to ``turns`` (the journal's book)."""
    if config.rollout.episode is None:

        def render(record: PromptRecord) -> str:
            return render_prompt(record.prompt, config.data.prompt_format, codec.tokenizer)

        yield SingleTurnEpisodes(settings.sampling, render, codec, client, scorer)
        return
    async with episode_runner_on(
        client, codec, config.rollout.episode, config.rollout.max_new_tokens, config.rollout.temperature,
        config.rollout.top_p, model=config.model.path, scope=config.name, turns=turns,
    ) as runner:  # fmt: skip
        yield AgentEpisodes(runner, scorer, settings.sampling.n_samples)
