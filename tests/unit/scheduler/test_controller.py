"""The rollout controller's bookkeeping: staleness bound, weight pushes, exactly-once
production across restarts, failure propagation.

The generator and scorer here are small deterministic stand-ins for the edges (vLLM
servers, reward pool); the controller, the gate and the storage are the real ones. The
end-to-end tests run the same controller on real vLLM servers and the real reward pool.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.gate_state import load_gate_state
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule, group_index
from asyncrl.tasks.scheduler.controller_settings import ControllerSettings
from controller_settings_builder import flat_controller_settings
from asyncrl.tasks.agent.episodes import SingleTurnEpisodes
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.shards import ShardReader
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult
from asyncrl.tasks.inference.samples import SampleOutput, SampleTimings, UpdateStats

RUN_ID = "run-test"


class ScriptedGenerator:
    """Answers each prompt with its own token ids reversed, after `delay_s`; groups whose
    first prompt token is in `hang_on` never finish (they stay in flight)."""

    def __init__(self, delay_s: float = 0.0, hang_on: frozenset[int] = frozenset(), fail_on: int | None = None):
        self.current_version = 0
        self.delay_s = delay_s
        self.hang_on = hang_on
        self.fail_on = fail_on
        self.calls: list[list[int]] = []
        self.updates: list[int] = []
        self.streamed = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        """Most groups generating at once."""

    async def generate_group(
        self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float = 1.0,
        top_p: float = 1.0, *, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
        journal_key: str | None = None,
    ) -> list[SampleOutput]:
        self.calls.append(list(prompt_token_ids))
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise ConnectionError("rollout server went away")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if prompt_token_ids[0] in self.hang_on:
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        version = self.current_version
        out = list(reversed(prompt_token_ids))[:max_new_tokens]
        self.streamed += n * len(out)
        timings = SampleTimings(time.time(), time.time(), 0, 0, 1)
        return [SampleOutput(out, [-0.5] * len(out), [version] * len(out), "stop", timings) for _ in range(n)]

    def streamed_tokens(self) -> dict[str, int]:
        return {"scripted": self.streamed}

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats:
        load(None)
        self.updates.append(version)
        self.current_version = version
        return UpdateStats(version, "recompute", 0.01, {}, {}, 0)


class ExactScorer:
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        return [
            RewardResult(1.0 if r.response.strip() == str(r.reference) else 0.0, Reason.OK
                         if r.response.strip() == str(r.reference) else Reason.WRONG_ANSWER)
            for r in requests
        ]


class DigitCodec:
    """Text <-> ids as character codes."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=f"p{i}", prompt=chr(65 + i % 26) + str(i), answer=str(i)[::-1] + chr(65 + i % 26),
                         solution=None) for i in range(n)]


def settings(**overrides: Any) -> ControllerSettings:
    base = dict(run_id=RUN_ID, batch_groups=2, eta=1, n_samples=3, max_new_tokens=16, max_prompt_tokens=16,
                shard_groups=2, shard_seconds=0.2, weight_poll_seconds=0.05, admit_poll_seconds=0.01)
    base.update(overrides)
    return flat_controller_settings(**base)


def single_turn(config: ControllerSettings, generator: ScriptedGenerator, scorer: Any = None) -> SingleTurnEpisodes:
    """The built-in episode over the scripted edges: the prompt as is, character codes."""
    return SingleTurnEpisodes(config.sampling, lambda r: r.prompt, DigitCodec(), generator, scorer or ExactScorer())


def controller(root_dir: Path, generator: ScriptedGenerator, loads: list[int] | None = None,
               **overrides: Any) -> RolloutController:
    loaded = loads if loads is not None else []
    config = settings(**overrides)
    return RolloutController(
        config, open_root(str(root_dir)), PromptSchedule(records(20), seed=0), generator=generator,
        episodes=single_turn(config, generator), weight_loader=lambda version: (lambda address: loaded.append(version)),
    )


def written_groups(root_dir: Path) -> list[int]:
    reader = ShardReader(open_root(str(root_dir)), RUN_ID)
    found: list[int] = []
    for shard in reader.list_shards():
        for group in reader.read_groups(shard):
            assert len({s.group_id for s in group}) == 1
            found.append(group_index(group[0].group_id))
    return found


async def run_for(ctrl: RolloutController, seconds: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stop.set)
    await ctrl.run(stop)


def publish(root_dir: Path, version: int, tmp_path: Path) -> None:
    weights = tmp_path / f"w{version}"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(b"\0" * 16)
    WeightStore(open_root(str(root_dir))).publish(version, weights)


def test_gate_holds_rollout_at_the_bound_until_a_new_version(tmp_path: Path) -> None:
    root_dir = tmp_path / "run"
    generator = ScriptedGenerator()
    loads: list[int] = []
    ctrl = controller(root_dir, generator, loads)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(ctrl.run(stop))
        await asyncio.sleep(0.5)
        # version 0, B = 2, eta = 1: at most (0 + 1 + 1) * 2 = 4 groups admitted
        assert ctrl.stats.admitted == 4
        publish(root_dir, 1, tmp_path)
        await asyncio.sleep(0.5)
        assert generator.updates == [1] and loads == [1]
        assert ctrl.stats.admitted == 6
        stop.set()
        await task

    asyncio.run(scenario())
    assert sorted(written_groups(root_dir)) == list(range(6))
    versions = {s.token_versions[0] for shard in ShardReader(open_root(str(root_dir)), RUN_ID).list_shards()
                for g in ShardReader(open_root(str(root_dir)), RUN_ID).read_groups(shard) for s in g}
    assert versions == {0, 1}


@pytest.mark.parametrize("cap", [None, 2])
def test_groups_in_flight_stay_under_the_cap_and_every_admitted_group_is_written(tmp_path: Path, cap: int | None) -> None:
    """B = 2, eta = 1: the gate alone lets 4 groups generate at once; a cap of 2 admits the
    next group only when one is done, and the run still writes every group in order."""
    root_dir = tmp_path / "run"
    generator = ScriptedGenerator(delay_s=0.15)
    ctrl = controller(root_dir, generator, max_groups=4, max_groups_in_flight=cap)
    asyncio.run(run_for(ctrl, 3.0))
    assert generator.peak_in_flight == (4 if cap is None else cap)
    assert written_groups(root_dir) == [0, 1, 2, 3]
    assert ctrl.stats.admitted == 4


def test_rewards_and_prompts_reach_the_shards(tmp_path: Path) -> None:
    root_dir = tmp_path / "run"
    asyncio.run(run_for(controller(root_dir, ScriptedGenerator(), max_groups=4), 0.6))
    reader = ShardReader(open_root(str(root_dir)), RUN_ID)
    samples = [s for shard in reader.list_shards() for g in reader.read_groups(shard) for s in g]
    assert len(samples) == 4 * 3
    for sample in samples:
        assert list(sample.output_token_ids) == list(reversed(sample.prompt_token_ids))
        assert sample.reward == 1.0  # the scripted answer is the reversed prompt, as the records expect


def test_restart_resubmits_unwritten_groups_without_new_admissions(tmp_path: Path) -> None:
    root_dir = tmp_path / "run"
    schedule = PromptSchedule(records(20), seed=0)
    hang_first = frozenset({ord(schedule.record(k).prompt[0]) for k in (1,)})
    first = controller(root_dir, ScriptedGenerator(hang_on=hang_first))
    asyncio.run(run_for(first, 0.6))  # stopped while group 1 is still in flight
    state = load_gate_state(open_root(str(root_dir)))
    assert state is not None and state.admitted == 4
    # Groups are written in admission order: 2 and 3 finished behind group 1, which was
    # still generating, so they were not written; their tokens are counted as wasted.
    assert written_groups(root_dir) == [0]
    tokens_per_group = 3 * len(schedule.record(2).prompt)
    assert first.stats.discarded_tokens == tokens_per_group + 3 * len(schedule.record(3).prompt)
    assert first.stats.summary()["wasted_tokens"] == first.stats.discarded_tokens

    second_generator = ScriptedGenerator()
    second = controller(root_dir, second_generator)
    asyncio.run(run_for(second, 0.6))
    assert second.stats.resubmitted_after_restart == 3
    assert second.stats.admitted == 0  # the bound at version 0 was already reached
    assert sorted(written_groups(root_dir)) == [0, 1, 2, 3]  # each exactly once
    # The controller kept its written-groups index up to date with every shard it wrote.
    index = json.loads(fs.read_bytes(open_root(str(root_dir)), paths.SCHEDULER_WRITTEN))
    assert (index["prefix"], index["extra"]) == (4, [])
    assert [call for call in second_generator.calls] == [
        [ord(c) for c in schedule.record(k).prompt] for k in (1, 2, 3)
    ]
    assert second.stats.summary()["wasted_tokens"] == 0


def test_a_failing_generator_fails_the_run_with_its_error(tmp_path: Path) -> None:
    ctrl = controller(tmp_path / "run", ScriptedGenerator(fail_on=2))
    with pytest.raises(ConnectionError, match="rollout server went away"):
        asyncio.run(run_for(ctrl, 5.0))


def test_oversized_prompt_is_refused_by_name(tmp_path: Path) -> None:
    ctrl = controller(tmp_path / "run", ScriptedGenerator(), max_prompt_tokens=1)
    with pytest.raises(ValueError, match="over data.max_prompt_tokens = 1"):
        asyncio.run(run_for(ctrl, 5.0))


def test_prompt_schedule_visits_every_prompt_once_per_epoch() -> None:
    schedule = PromptSchedule(records(7), seed=3)
    first_epoch = [schedule.record(k).prompt_id for k in range(7)]
    second_epoch = [schedule.record(k).prompt_id for k in range(7, 14)]
    assert sorted(first_epoch) == sorted(second_epoch) == sorted(f"p{i}" for i in range(7))
    assert [PromptSchedule(records(7), seed=3).record(k).prompt_id for k in range(7)] == first_epoch


class RecordingGenerator(ScriptedGenerator):
    """Also records each request's budget, ignore_eos and stop tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[int, bool, tuple[int, ...]]] = []

    async def generate_group(
        self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float = 1.0,
        top_p: float = 1.0, *, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
        journal_key: str | None = None,
    ) -> list[SampleOutput]:
        self.requests.append((max_new_tokens, ignore_eos, tuple(stop_token_ids)))
        return await super().generate_group(prompt_token_ids, n, max_new_tokens, temperature, top_p,
                                            ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)


def budget_records(budgets: Sequence[int | None]) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=f"p{i}", prompt=f"Q{i}", answer="x", max_new_tokens=b) for i, b in enumerate(budgets)]


@pytest.mark.parametrize(("ignore_eos", "stop_sent"), [(False, (7,)), (True, ())])
def test_per_prompt_budgets_capped_and_eos_setting_reach_the_generator(
    tmp_path: Path, ignore_eos: bool, stop_sent: tuple[int, ...]
) -> None:
    budgets = [4, None, 40, 1]  # settings.max_new_tokens = 16 caps 40; None takes it
    generator = RecordingGenerator()
    config = settings(max_groups=4, eta=1, ignore_eos=ignore_eos, stop_token_ids=(7,))
    ctrl = RolloutController(
        config, open_root(str(tmp_path / "run")), PromptSchedule(budget_records(budgets), seed=0),
        generator=generator, episodes=single_turn(config, generator), weight_loader=lambda version: (lambda address: None),
    )  # fmt: skip
    asyncio.run(run_for(ctrl, 0.6))
    schedule = PromptSchedule(budget_records(budgets), seed=0)
    expected = [min(16, schedule.record(k).max_new_tokens or 16) for k in range(4)]
    assert [r[0] for r in generator.requests] == expected
    assert {r[1:] for r in generator.requests} == {(ignore_eos, stop_sent)}


def test_rates_end_when_the_controller_stops(tmp_path: Path) -> None:
    ctrl = controller(tmp_path / "run", ScriptedGenerator(), max_groups=2)
    asyncio.run(run_for(ctrl, 0.3))
    stats = ctrl.stats
    assert stats.finished_at is not None
    first = stats.summary()
    time.sleep(0.3)  # e.g. the servers shutting down after the run: not part of its rates
    assert stats.summary() == first
    assert first["elapsed_s"] == pytest.approx(stats.finished_at - stats.started_at)
    assert 0.0 < first["generation_busy_s"] <= first["elapsed_s"] and stats.generation.in_flight == 0
    assert first["gen_tokens_per_s"] == pytest.approx(stats.output_tokens / first["elapsed_s"])
    # streamed: what the generator reports it streamed during the run (all of it finished here)
    assert first["streamed_tokens"] == stats.output_tokens > 0
    assert first["streamed_tokens_per_s"] == pytest.approx(first["gen_tokens_per_s"])


# ----- the hand-off without idle waits (doorbells, batch-completing flush) -----


def test_a_finished_batch_is_written_at_once_not_after_the_shard_timer(tmp_path: Path) -> None:
    """B = 2 and shard_groups = 4 with a 60 s shard timer: the two groups of the trainer's
    next batch are written as soon as both finished, in one shard, and the trainer's
    doorbell rings; groups beyond that batch wait for the shard to fill."""
    from asyncrl.storage.doorbell import SHARDS_TOPIC, DoorbellListener

    root_dir = tmp_path / "run"
    root = open_root(str(root_dir))
    ctrl = controller(root_dir, ScriptedGenerator(delay_s=0.05), eta=0, shard_groups=4, shard_seconds=60.0)

    async def scenario() -> float:
        with DoorbellListener(root, SHARDS_TOPIC) as trainer_bell:
            stop = asyncio.Event()
            task = asyncio.create_task(ctrl.run(stop))
            started = time.monotonic()
            rung = await trainer_bell.wait_async(10.0)
            waited = time.monotonic() - started
            assert rung and sorted(written_groups(root_dir)) == [0, 1]
            stop.set()
            await task
            assert ctrl.stats.shards_written == 1
            return waited

    assert asyncio.run(scenario()) < 5.0  # not the 60 s shard timer
    assert sorted(written_groups(root_dir)) == [0, 1]  # nothing lost or written twice


def test_a_published_version_is_loaded_when_the_trainer_rings_and_admits_at_once(tmp_path: Path) -> None:
    """With a 30 s weight poll, the doorbell alone brings the new version: it is loaded and
    the next batch admitted well before any poll would have seen it."""
    from asyncrl.storage.doorbell import WEIGHTS_TOPIC, Doorbell

    root_dir = tmp_path / "run"
    generator = ScriptedGenerator()
    ctrl = controller(root_dir, generator, eta=0, weight_poll_seconds=30.0, admit_poll_seconds=30.0)

    async def scenario() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(ctrl.run(stop))
        await asyncio.sleep(0.5)
        assert ctrl.stats.admitted == 2  # eta = 0: one batch while on version 0
        publish(root_dir, 1, tmp_path)
        started = time.monotonic()
        Doorbell(open_root(str(root_dir)), WEIGHTS_TOPIC).ring()
        while ctrl.stats.admitted < 4 and time.monotonic() - started < 10.0:
            await asyncio.sleep(0.01)
        waited = time.monotonic() - started
        while ctrl.stats.groups_written < 4 and time.monotonic() - started < 10.0:
            await asyncio.sleep(0.01)  # a stop cuts groups in flight: let the admitted ones finish
        stop.set()
        await task
        return waited

    assert asyncio.run(scenario()) < 5.0
    assert generator.updates == [1]
    assert sorted(written_groups(root_dir)) == [0, 1, 2, 3]


def test_a_new_version_is_fetched_before_the_update_pauses_generation(tmp_path: Path) -> None:
    """``weight_prefetch`` (the scheduler's fetch onto its servers' host) runs for the new
    version before the update, whose load then only reloads it."""
    root_dir = tmp_path / "run"
    generator = ScriptedGenerator()
    events: list[tuple[str, int]] = []
    ctrl = RolloutController(
        settings(), open_root(str(root_dir)), PromptSchedule(records(20), seed=0),
        generator=generator, episodes=single_turn(settings(), generator),
        weight_loader=lambda version: (lambda address: events.append(("load", version))),
        weight_prefetch=lambda version: events.append(("prefetch", version)),
    )  # fmt: skip
    publish(root_dir, 1, tmp_path)
    asyncio.run(run_for(ctrl, 0.5))
    assert events == [("prefetch", 1), ("load", 1)] and generator.updates == [1]


class RecordingScorer:
    """Scores every request 1.0 and keeps it, to see where each row's samples were sent."""

    def __init__(self) -> None:
        self.requests: list[RewardRequest] = []

    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        self.requests.extend(requests)
        return [RewardResult(1.0, Reason.OK) for _ in requests]


def test_a_mixed_batch_goes_to_each_row_s_reward_and_the_shards_keep_the_task(tmp_path: Path) -> None:
    from asyncrl.tasks.reward.types import CodeTests, StdioCase

    tests = CodeTests(stdio=(StdioCase("1\n", "1\n"),))
    mixed = [
        PromptRecord(prompt_id="m", prompt="M1", answer="7"),
        PromptRecord(prompt_id="c", prompt="C2", answer="", task="code", tests=tests),
        PromptRecord(prompt_id="p", prompt="P3", answer="ref", task="judge", fields={"rubric": "short"}),
    ]
    scorer = RecordingScorer()
    config, generator = settings(batch_groups=3, shard_groups=3, eta=0), ScriptedGenerator()
    ctrl = RolloutController(
        config, open_root(str(tmp_path / "run")), PromptSchedule(mixed, seed=0), generator=generator,
        episodes=single_turn(config, generator, scorer), weight_loader=lambda version: (lambda address: None),
    )
    asyncio.run(run_for(ctrl, 1.0))
    by_prompt = {r.response[-1]: r for r in scorer.requests}  # the scripted output is the reversed prompt
    assert (by_prompt["M"].kind, by_prompt["M"].reference) == ("math", "7")
    assert (by_prompt["C"].kind, by_prompt["C"].reference) == ("code", tests)
    assert (by_prompt["P"].kind, by_prompt["P"].plugin, by_prompt["P"].reference) == ("plugin", "judge", "ref")
    assert by_prompt["P"].metadata == {"rubric": "short"}
    reader = ShardReader(open_root(str(tmp_path / "run")), RUN_ID)
    tasks = {s.prompt_id: s.task for shard in reader.list_shards() for g in reader.read_groups(shard) for s in g}
    assert tasks == {"m": "math", "c": "code", "p": "judge"}
    summary = ctrl.stats.summary()
    assert summary["samples/code"] == 3 and summary["reward_mean/judge"] == 1.0 and summary["reward_wait_s"] >= 0.0
    assert summary["reasons/code/ok"] == 3 and summary["reasons/math/ok"] == 3


def shard_admissions(root_dir: Path) -> dict[str, tuple[int, int]]:
    """Group id -> (version, updates) of its admission, as the shards holding it record it."""
    from asyncrl.storage.admissions import read_admissions

    reader = ShardReader(open_root(str(root_dir)), RUN_ID)
    found: dict[str, tuple[int, int]] = {}
    for shard in reader.list_shards():
        records = read_admissions(reader.read(shard).schema.metadata, shard.name)
        assert records is not None, f"{shard.name} has no admission records"
        found |= {gid: (a.version, a.updates) for gid, a in records.items()}
    return found


def test_each_shard_records_its_groups_admissions_and_a_restart_keeps_them(tmp_path: Path) -> None:
    """Groups 0-3 are admitted on version 0 (group 1 hangs, so 1-3 are unwritten at the stop);
    the restarted controller, its servers on version 1, generates 1-3 again under their saved
    admission (version 0) and admits 4-5 on version 1 (no lineage: 1 update)."""
    from asyncrl.tasks.scheduler.gate_state import load_admissions

    root_dir = tmp_path / "run"
    schedule = PromptSchedule(records(20), seed=0)
    asyncio.run(run_for(controller(root_dir, ScriptedGenerator(hang_on=frozenset({ord(schedule.record(1).prompt[0])}))), 0.6))
    saved = load_admissions(open_root(str(root_dir)))
    assert saved is not None and {saved[k].version for k in (1, 2, 3)} == {0}
    assert shard_admissions(root_dir) == {"g00000000": (0, 0)}

    publish(root_dir, 1, tmp_path)
    generator = ScriptedGenerator()
    generator.current_version = 1
    asyncio.run(run_for(controller(root_dir, generator), 0.6))
    assert shard_admissions(root_dir) == {f"g{k:08d}": (0, 0) for k in range(4)} | {"g00000004": (1, 1), "g00000005": (1, 1)}
    reader = ShardReader(open_root(str(root_dir)), RUN_ID)
    tokens = {g[0].group_id: min(s.token_versions[0] for s in g) for shard in reader.list_shards() for g in reader.read_groups(shard)}
    assert tokens == {f"g{k:08d}": 0 if k == 0 else 1 for k in range(6)}  # generated again on version 1, admitted on 0
