"""The controller's one path for both kinds of episode: the user's agent episodes go through
the same produce -> filter -> write loop as the built-in single-turn samples (tested in
test_controller.py), and the scheduler's set-up picks the kind from ``rollout.episode``.

The episode runner runs real user functions against a stand-in recording endpoint (the
endpoint itself is tested on a real vLLM server in tests/integration/inference/).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.episode import EpisodeConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.shards import ShardReader
from asyncrl.tasks.agent.episode import EpisodeContext
from asyncrl.tasks.agent.runner import EpisodeRunner
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult
from asyncrl.tasks.scheduler import setup
from asyncrl.tasks.scheduler.controller import RolloutController
from controller_settings_builder import flat_controller_settings
from asyncrl.tasks.agent.episodes import AgentEpisodes, SingleTurnEpisodes
from asyncrl.tasks.scheduler.filtered import filtered_groups
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule, group_index
from tests.unit.agent.test_episode_runner import Recorder
from tests.unit.scheduler.test_controller import RUN_ID, ScriptedGenerator, run_for


class InOrderSchedule(PromptSchedule):
    """Group k is prompt k, so an episode can tell which group it serves."""

    def record(self, index: int) -> PromptRecord:
        return PromptRecord(prompt_id=f"p{index}", prompt=f"Q{index}", answer="6")


class AllRight:
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        return [RewardResult(1.0, Reason.OK) for _ in requests]


async def episode(context: EpisodeContext) -> float | None:
    """Every episode of group 1 fails; elsewhere the last of a group rewards itself 0.5 and
    the others leave scoring to the row's reward."""
    if context.row.prompt_id == "p1":
        raise RuntimeError("tool backend down")
    return 0.5 if context.sample_index == 2 else None


def test_agent_episodes_run_through_the_controller_s_one_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """n = 3, B = 1, max_groups = 2 with ``on_failure: drop``: group 1 keeps no episode, so it
    is recorded, released and replaced by group 2; the kept groups are written as masked rows
    and counted as the single-turn path counts its samples."""
    settings = flat_controller_settings(run_id=RUN_ID, batch_groups=1, eta=2, n_samples=3, max_new_tokens=16,
                                  max_prompt_tokens=16, shard_groups=1, shard_seconds=0.2, weight_poll_seconds=0.05,
                                  admit_poll_seconds=0.01, max_groups=2)  # fmt: skip
    runner = EpisodeRunner(episode, Recorder(), EpisodeConfig(function="m:f", on_failure="drop"), model="m", scope="run")
    root = open_root(str(tmp_path / "run"))
    generator = ScriptedGenerator()
    ctrl = RolloutController(
        settings, root, InOrderSchedule([PromptRecord(prompt_id="p", prompt="Q", answer="6")], seed=0), generator=generator,
        episodes=AgentEpisodes(runner, AllRight(), settings.sampling.n_samples), weight_loader=lambda v: (lambda _: None),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="asyncrl.scheduler"):
        asyncio.run(run_for(ctrl, 2.0))
    reader = ShardReader(root, RUN_ID)
    groups = [g for shard in reader.list_shards() for g in reader.read_groups(shard)]
    assert [group_index(g[0].group_id) for g in groups] == [0, 2]
    assert filtered_groups(root) == [1]
    assert generator.calls == []  # no single-turn generation
    for group in groups:
        assert [s.reward for s in group] == [1.0, 1.0, 0.5]
        assert all(list(s.output_mask or []) == [True, True, True, False, False, True, True] for s in group)
    stats = ctrl.stats
    assert (stats.samples, stats.output_tokens, stats.context_tokens) == (6, 30, 12)
    assert stats.episodes_left_out == {"episode_error": 3, "other_prompt": 0}  # kept groups count theirs: none
    assert stats.reward_reasons == {"math/ok": 4, "math/episode": 2}
    assert stats.filtered_groups == 1
    failures = [r.getMessage() for r in caplog.records if "episode failed" in r.getMessage()]
    assert failures == ["group g00000001: episode failed: episode_error: RuntimeError: tool backend down"] * 3


def run_config(tmp_path: Path, rollout: dict[str, Any]) -> Any:  # noqa: ANN401 - the scheduler's config
    from asyncrl.configs.processes import process_configs
    from asyncrl.configs.run_config import RunConfig

    return process_configs(RunConfig.model_validate({
        "name": "episodes", "model": {"path": str(tmp_path)}, "data": {"train_path": str(tmp_path / "t.jsonl")},
        "storage": {"root": str(tmp_path / "store")}, "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db"},
        "trainer": {"micro_batch_tokens": 512}, "rollout": rollout,
    })).scheduler  # fmt: skip


def test_the_set_up_picks_the_episodes_from_the_rollout_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = flat_controller_settings(run_id=RUN_ID, batch_groups=1, eta=0, n_samples=4, max_new_tokens=8,
                                  max_prompt_tokens=8)  # fmt: skip
    runner = EpisodeRunner(episode, Recorder(), EpisodeConfig(function="m:f"), model="m", scope="run")
    opened: list[EpisodeConfig] = []

    @asynccontextmanager
    async def runner_on(client: Any, codec: Any, config: EpisodeConfig, *args: Any, **kwargs: Any) -> AsyncIterator[EpisodeRunner]:
        opened.append(config)
        yield runner

    monkeypatch.setattr(setup, "episode_runner_on", runner_on)

    async def pick(rollout: dict[str, Any]) -> Any:  # noqa: ANN401 - the episodes
        async with setup.group_episodes(run_config(tmp_path, rollout), settings, None, None, AllRight()) as episodes:  # type: ignore[arg-type]
            return episodes

    single = asyncio.run(pick({}))
    assert isinstance(single, SingleTurnEpisodes) and single.settings is settings.sampling and opened == []
    agent = asyncio.run(pick({"episode": {"function": "examples.calculator:solve", "max_context_tokens": 512}}))
    assert isinstance(agent, AgentEpisodes) and agent.runner is runner and agent.n_samples == 4
    assert [c.function for c in opened] == ["examples.calculator:solve"]
