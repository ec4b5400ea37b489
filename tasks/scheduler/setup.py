"""How the scheduler process is built from the run config: the tokenizer codec, the
controller settings, the group's episodes (single-turn or the user's agent episodes), and
the controller run itself."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from asyncrl.configs.episode import EpisodeConfig
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.agent.episode import load_episode
from asyncrl.tasks.agent.runner import EpisodeRunner
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.data.prompting import render_prompt
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.proxy import RecordingProxy
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
from asyncrl.tasks.model.checks import require_model_dir
from asyncrl.tasks.reward.remote import RemoteRewardScorer
from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.controller_stats import ControllerStats
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule
from asyncrl.tasks.scheduler.controller_settings import ControllerSettings
from asyncrl.tasks.scheduler.episodes import AgentEpisodes, SingleTurnEpisodes
from asyncrl.tasks.scheduler.protocols import GroupEpisodes, RewardScorer
from asyncrl.tasks.system.run_paths import RunPaths


class HFCodec:
    """Prompt text <-> token ids with the model's own tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_codec(model_dir: str, key: str = "model.path") -> tuple[HFCodec, tuple[int, ...]]:
    """The tokenizer and the stop token ids (eos of the tokenizer and generation config).

    A local ``model_dir`` that is missing (or holds no ``config.json``) raises
    :class:`~asyncrl.tasks.model.checks.ModelPathError` naming ``key`` and the path."""
    from transformers import AutoTokenizer, GenerationConfig

    require_model_dir(model_dir, key)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    stop.update([eos] if isinstance(eos, int) else list(eos or []))
    return HFCodec(tokenizer), tuple(sorted(stop))


def controller_settings(config: RunConfig, stop_token_ids: tuple[int, ...], max_groups: int | None) -> ControllerSettings:
    rollout = config.rollout
    return ControllerSettings(
        run_id=config.name,
        batch_groups=config.trainer.batch_groups,
        eta=rollout.eta,
        n_samples=rollout.n_samples,
        max_new_tokens=rollout.max_new_tokens,
        max_prompt_tokens=config.data.max_prompt_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=stop_token_ids,
        ignore_eos=rollout.ignore_eos,
        dynamic_filter=rollout.dynamic_filter,
        adaptive_staleness=rollout.adaptive_staleness,
        shard_groups=rollout.shard_groups,
        shard_seconds=rollout.shard_seconds,
        weight_poll_seconds=rollout.weight_poll_seconds,
        max_groups_in_flight=rollout.max_groups_in_flight,
        seed=config.seed,
        max_groups=max_groups,
    )


def run_scheduler(
    config: RunConfig,
    paths: RunPaths,
    handles: list[RolloutServerHandle],
    prompts: list[PromptRecord],
    stop: threading.Event,
    initial_version: int,
    max_groups: int | None = None,
    codec: tuple[HFCodec, tuple[int, ...]] | None = None,
) -> ControllerStats:
    """The rollout controller on its own event loop, scoring through the run's reward
    service, until `stop` is set (or, with `max_groups`, until that many groups are admitted
    and produced). ``codec``: the model's (:func:`load_codec`), loaded here if not given."""
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
        try:
            async with RolloutClient(
                handles, interrupt_mode=config.rollout.interrupt_mode, initial_version=initial_version, adapters=adapters
            ) as client, RemoteRewardScorer(paths.root) as scorer, group_episodes(
                config, settings, client, codec, scorer
            ) as episodes:
                controller = RolloutController(
                    settings,
                    paths.root,
                    PromptSchedule(prompts, seed=config.seed),
                    generator=client,
                    episodes=episodes,
                    weight_loader=weight_loader.for_version,
                    weight_prefetch=lambda version: weight_loader.prefetch(version, handles),
                )
                return await controller.run(stop_async)
        finally:
            relay.cancel()
            weight_loader.close()

    return asyncio.run(main())


@asynccontextmanager
async def group_episodes(
    config: RunConfig, settings: ControllerSettings, client: RolloutClient, codec: HFCodec, scorer: RewardScorer
) -> AsyncIterator[GroupEpisodes]:
    """The run's episodes: single-turn samples of the prompt rendered by
    ``data.prompt_format`` when ``rollout.episode`` is None, else the user's episodes behind
    their recording endpoint (:func:`episode_runner_on`, stopped on exit)."""
    if config.rollout.episode is None:

        def render(record: PromptRecord) -> str:
            return render_prompt(record.prompt, config.data.prompt_format, codec.tokenizer)

        yield SingleTurnEpisodes(settings, render, codec, client, scorer)
        return
    async with episode_runner_on(
        client, codec, config.rollout.episode, config.rollout.max_new_tokens, config.rollout.temperature,
        config.rollout.top_p, model=config.model.path,
    ) as runner:  # fmt: skip
        yield AgentEpisodes(runner, scorer, settings.n_samples)


@asynccontextmanager
async def episode_runner_on(
    client: RolloutClient,
    codec: HFCodec,
    episode: EpisodeConfig,
    max_episode_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    model: str = "asyncrl-policy",
) -> AsyncIterator[EpisodeRunner]:
    """An :class:`EpisodeRunner` of ``episode`` behind a recording endpoint on 127.0.0.1 in
    front of ``client``'s servers (stopped on exit). The user's function is imported first:
    a bad import path fails here, naming the field, before any model call."""
    function = load_episode(episode.function)
    proxy = RecordingProxy(
        client,
        codec.tokenizer,
        default_temperature=temperature,
        default_top_p=top_p,
        max_episode_tokens=max_episode_tokens,
        max_context_tokens=episode.max_context_tokens,
    )
    await proxy.start(host="127.0.0.1", port=0)
    try:
        yield EpisodeRunner(function, proxy, episode, model=model)
    finally:
        await proxy.stop()
