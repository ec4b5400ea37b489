"""Every trained sample within the staleness bound, none dropped: the rollout controller
writes groups in admission order, batch-aligned, and the trainer's feed takes shards in
written order, so step s trains exactly the s-th admission batch.

The scheduler side is the real controller, gate and storage; the edges are fakes: a
generator whose groups finish out of order (a long tail) and a trainer that only takes
its input through the real :class:`ShardFeed`, records the ledger, retires the shards and
publishes a version per step (with the lineage the audit reads). The same scenario run
with the old rule (each group written as it finishes, shards taken oldest policy first)
drops samples; with the new rule none, the audit stays clean, and a restart, including a
kill between a shard and the index save, keeps every group exactly once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.doorbell import WEIGHTS_TOPIC, Doorbell
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult
from asyncrl.tasks.inference.samples import SampleOutput, SampleTimings, UpdateStats
from asyncrl.chaos.audit import audit_run
from asyncrl.tasks.scheduler import controller as controller_module
from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule, group_index
from controller_settings_builder import flat_controller_settings
from asyncrl.tasks.agent.episodes import SingleTurnEpisodes
from asyncrl.tasks.scheduler.filtered import filtered_groups
from asyncrl.tasks.scheduler.written_index import written_group_indices
from asyncrl.tasks.trainer.feed import ShardFeed, StepInput
from asyncrl.tasks.trainer.staleness import sample_staleness

RUN_ID = "write-order"
B, ETA, N = 2, 1, 2
STEPS = 8
SLOW = {0: 1.5, 5: 1.0}
"""Group index -> seconds it generates; every other group takes FAST seconds."""
FAST = 0.01


class LongTailGenerator:
    """Group k generates for SLOW.get(k, FAST) seconds; its first token carries the version
    at the start, the others the version at the end (a weight update in between). The group
    index is read off the prompt ("Q<k>")."""

    def __init__(self, version: int = 0, slow: dict[int, float] | None = None) -> None:
        self.current_version = version
        self.slow = SLOW if slow is None else slow
        self.streamed = 0

    async def generate_group(
        self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float = 1.0,
        top_p: float = 1.0, *, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
        journal_key: str | None = None,
    ) -> list[SampleOutput]:
        index = int("".join(chr(t) for t in prompt_token_ids[1:]))
        first = self.current_version
        await asyncio.sleep(self.slow.get(index, FAST))
        last = self.current_version
        out = [7, 8, 9]
        self.streamed += n * len(out)
        timings = SampleTimings(time.time(), time.time(), 0, 0, 1)
        return [SampleOutput(out, [-0.5] * 3, [first, last, last], "stop", timings) for _ in range(n)]

    def streamed_tokens(self) -> dict[str, int]:
        return {"fake": self.streamed}

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats:
        self.current_version = version
        return UpdateStats(version, "recompute", 0.0, {}, {}, 0)


class AlternatingScorer:
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        return [RewardResult(float(k % 2), Reason.OK) for k in range(len(requests))]


class CharCodec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def records(count: int) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=f"p{k}", prompt=f"Q{k}", answer="x", solution=None) for k in range(count)]


class InOrderSchedule(PromptSchedule):
    """Group k is prompt k (no shuffle), so the generator can tell which group it serves."""

    def record(self, index: int) -> PromptRecord:
        return PromptRecord(prompt_id=f"p{index}", prompt=f"Q{index}", answer="x", solution=None)


def make_controller(root: RunRoot, generator: LongTailGenerator, cls: type[RolloutController] = RolloutController,
                    max_groups: int | None = STEPS * B, shard_groups: int = B, dynamic_filter: bool = False,
                    scorer: Any = None) -> RolloutController:  # fmt: skip
    settings = flat_controller_settings(
        run_id=RUN_ID, batch_groups=B, eta=ETA, n_samples=N, max_new_tokens=8, max_prompt_tokens=8,
        shard_groups=shard_groups, shard_seconds=0.2, weight_poll_seconds=0.02, admit_poll_seconds=0.01,
        max_groups=max_groups, dynamic_filter=dynamic_filter,
    )  # fmt: skip
    episodes = SingleTurnEpisodes(settings.sampling, lambda r: r.prompt, CharCodec(), generator, scorer or AlternatingScorer())
    return cls(settings, root, InOrderSchedule(records(1), seed=0), generator=generator, episodes=episodes,
               weight_loader=lambda v: (lambda _: None))  # fmt: skip


class CompletionOrderController(RolloutController):
    """The old write rule: every finished group is written at once, in the order groups finish."""

    def _take_writable(self, partial: bool) -> list[tuple[list[list[Sample]], list[int]]]:
        finished = list(self._done)
        self._order = deque(k for k in self._order if k not in self._done)
        self._done_at.clear()
        return [([group], []) for group in (self._done.pop(k) for k in finished) if group is not None]


def take_oldest_policy_first(reader: ShardReader, feed: ShardFeed) -> StepInput | None:
    """The old feed: shards by (min policy version, seq) until they hold >= B groups."""
    names: list[str] = []
    groups: list[tuple[Sample, ...]] = []
    for info in reader.list_pending():
        names.append(info.name)
        groups.extend(tuple(g) for g in reader.read_groups(info))
        if len(groups) >= B:
            return StepInput(tuple(names), tuple(groups))
    return None


class FakeTrainer:
    """Takes B groups per step through the feed, records and retires them, 'trains' (notes each
    sample's staleness), publishes version = step with its lineage and rings the doorbell."""

    def __init__(self, root: RunRoot, tmp_path: Path, old_feed: bool = False, step_s: float = 0.01) -> None:
        self.root, self.tmp_path, self.old_feed, self.step_s = root, tmp_path, old_feed, step_s
        self.reader = ShardReader(root, RUN_ID)
        self.feed = ShardFeed(self.reader, vocab_size=1000, token_budget=10_000)
        self.ledger = Ledger(root)
        self.store = WeightStore(root)
        self.step = len(self.ledger.steps())
        self.staleness: list[int] = []
        self.step_groups: list[list[int]] = []
        if self.store.latest() is None:
            self.publish(0, [])

    def publish(self, version: int, shards: list[str]) -> None:
        local = self.tmp_path / f"weights-{version}-{time.monotonic_ns()}"
        local.mkdir()
        (local / "config.json").write_text("{}")
        (local / "model.safetensors").write_bytes(b"\0" * 16)
        lineage = {"version": version, "parent_version": version - 1 if version else None, "step": version,
                   "shards": shards}  # fmt: skip
        (local / LINEAGE_FILE).write_text(json.dumps(lineage))
        self.store.publish(version, local)
        Doorbell(self.root, WEIGHTS_TOPIC).ring()

    def try_step(self) -> bool:
        taken = take_oldest_policy_first(self.reader, self.feed) if self.old_feed else self.feed.take(B)
        if taken is None:
            return False
        self.step += 1
        self.ledger.record(self.step, taken.shards)
        self.reader.retire(taken.shards)
        self.feed.forget(taken.shards)
        self.step_groups.append([group_index(g[0].group_id) for g in taken.groups])
        self.staleness.extend(sample_staleness(s, self.step - 1) for g in taken.groups for s in g)
        self.publish(self.step, list(taken.shards))
        return True

    async def run(self, steps: int, stop: asyncio.Event | None = None) -> None:
        while self.step < steps and not (stop is not None and stop.is_set()):
            if self.try_step():
                await asyncio.sleep(self.step_s)
            else:
                await asyncio.sleep(0.01)

    def dropped(self) -> int:
        return sum(1 for s in self.staleness if s > ETA)


async def run_both(ctrl: RolloutController, trainer: FakeTrainer, steps: int = STEPS, timeout: float = 30.0) -> None:
    stop = asyncio.Event()
    scheduler = asyncio.create_task(ctrl.run(stop))
    try:
        await asyncio.wait_for(trainer.run(steps), timeout)
    finally:
        stop.set()
        await scheduler


def test_the_old_rule_trains_a_long_tailed_group_too_late(tmp_path: Path) -> None:
    """What the write order fixes: written as they finish and taken oldest policy first, the
    slow groups 0 and 5 are trained steps after their first token and dropped."""
    root = open_root(str(tmp_path / "run"))
    trainer = FakeTrainer(root, tmp_path, old_feed=True)
    asyncio.run(run_both(make_controller(root, LongTailGenerator(), CompletionOrderController), trainer))
    assert trainer.dropped() > 0, trainer.staleness
    assert audit_run(root, RUN_ID, ETA).dropped_stale == trainer.dropped()


def test_every_trained_sample_is_within_eta_and_none_is_dropped(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    trainer = FakeTrainer(root, tmp_path)
    ctrl = make_controller(root, LongTailGenerator())
    asyncio.run(run_both(ctrl, trainer))
    assert trainer.step == STEPS
    # step s trains exactly the s-th admission batch
    assert trainer.step_groups == [[B * s + j for j in range(B)] for s in range(STEPS)]
    assert max(trainer.staleness) <= ETA and trainer.dropped() == 0
    assert max(trainer.staleness) == ETA  # the slow groups do reach the bound: the test bites
    summary = ctrl.stats.summary()
    assert summary["wasted_tokens"] == 0 and summary["written_tokens"] == STEPS * B * N * 3
    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert report.dropped_stale == 0 and max(report.staleness_counts) <= ETA
    assert report.trained_samples == STEPS * B * N


def test_shards_never_straddle_a_batch(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    # Version 0 admits (0 + eta + 1) * B = 4 groups; group 0 finishes last, so all four are
    # ready at once: two shards of one batch each, although shard_groups is 3.
    ctrl = make_controller(root, LongTailGenerator(slow={0: 0.3}), max_groups=4, shard_groups=3)
    asyncio.run(ctrl.run(asyncio.Event()))
    reader = ShardReader(root, RUN_ID)
    shards = sorted(reader.list_shards(), key=lambda info: info.seq)
    held = [[group_index(g[0].group_id) for g in reader.read_groups(info)] for info in shards]
    assert held == [[0, 1], [2, 3]]


def test_a_restarted_scheduler_and_a_kill_between_shard_and_index_keep_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cycle 1 is killed after its third shard is published but before the index names it;
    cycle 2 is stopped while group 5 (slow) is generating, with groups after it finished;
    cycle 3 drains. Every group is trained exactly once, within the bound, and the audit is clean."""
    class Killed(Exception):
        pass

    root = open_root(str(tmp_path / "run"))
    trainer = FakeTrainer(root, tmp_path)
    real_save = controller_module.save_written_groups
    saves = {"n": 0}

    def save_then_die(root_: RunRoot, written: Any) -> None:
        saves["n"] += 1
        if saves["n"] == 3:
            raise Killed("killed between the shard and the index save")
        real_save(root_, written)

    async def cycle(generator: LongTailGenerator, steps: int, stop_after: float | None = None) -> RolloutController:
        ctrl = make_controller(root, generator)
        stop = asyncio.Event()
        scheduler = asyncio.create_task(ctrl.run(stop))
        trainer_task = asyncio.create_task(trainer.run(steps, stop))
        if stop_after is not None:
            await asyncio.sleep(stop_after)
            stop.set()
        try:
            await scheduler
        finally:
            stop.set()
            await trainer_task
        return ctrl

    monkeypatch.setattr(controller_module, "save_written_groups", save_then_die)
    with pytest.raises(Killed):
        asyncio.run(cycle(LongTailGenerator(), STEPS))
    monkeypatch.setattr(controller_module, "save_written_groups", real_save)
    assert saves["n"] == 3  # the third shard is published, the index does not name it
    saved = json.loads(fs.read_bytes(root, paths.SCHEDULER_WRITTEN))
    head = written_group_indices(root, RUN_ID).prefix
    assert saved["prefix"] < head  # ... but its claim does
    # Group 7 hangs: 6 is written (the shard timer), 8.. finish behind it and are not.
    second = asyncio.run(cycle(LongTailGenerator(trainer.store.latest() or 0, slow={head + 1: 30.0}), STEPS,
                               stop_after=1.5))
    assert second.stats.resubmitted_after_restart > 0 and second.stats.discarded_tokens > 0
    assert written_group_indices(root, RUN_ID).prefix == head + 1
    third = asyncio.run(cycle(LongTailGenerator(trainer.store.latest() or 0, slow={}), STEPS))
    assert third.stats.resubmitted_after_restart > 0

    asyncio.run(trainer.run(STEPS))
    assert trainer.step == STEPS
    assert sorted(k for groups in trainer.step_groups for k in groups) == list(range(STEPS * B))
    assert max(trainer.staleness) <= ETA and trainer.dropped() == 0
    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert report.dropped_stale == 0 and report.groups_written == STEPS * B


# ----- dynamic filtering -----


class IndexEchoGenerator(LongTailGenerator):
    """Answers group k with the text of k (so the scorer knows the group)."""

    async def generate_group(
        self, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float = 1.0,
        top_p: float = 1.0, *, ignore_eos: bool = False, stop_token_ids: Sequence[int] = (),
        journal_key: str | None = None,
    ) -> list[SampleOutput]:
        outputs = await super().generate_group(prompt_token_ids, n, max_new_tokens, temperature, top_p)
        echo = list(prompt_token_ids[1:])
        self.streamed += n * (len(echo) - 3)  # the parent counted its 3 tokens per sample
        return [SampleOutput(echo, [-0.5] * len(echo), [o.token_versions[0]] * len(echo), o.finish_reason, o.timings)
                for o in outputs]  # fmt: skip


def filtered_out(index: int) -> bool:
    return index % 3 == 0


class EqualEveryThirdScorer:
    """Groups 0, 3, 6, ... get reward 1 for every sample (no signal: filtered); the others 0, 1, 0, ..."""

    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        index = int(requests[0].response)
        return [RewardResult(1.0 if filtered_out(index) else float(j % 2), Reason.OK) for j in range(len(requests))]


def filtering_controller(root: RunRoot, generator: LongTailGenerator, max_groups: int | None = STEPS * B
                         ) -> RolloutController:  # fmt: skip
    return make_controller(root, generator, max_groups=max_groups, dynamic_filter=True, scorer=EqualEveryThirdScorer())


def test_filtered_groups_are_released_and_never_trained_and_the_rule_holds_for_the_kept(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    trainer = FakeTrainer(root, tmp_path)
    ctrl = filtering_controller(root, IndexEchoGenerator(slow={1: 1.0, 7: 0.8}))
    asyncio.run(run_both(ctrl, trainer))
    trained = [k for groups in trainer.step_groups for k in groups]
    kept = [k for k in range(max(trained) + 1) if not filtered_out(k)]
    assert trained == kept[: STEPS * B]  # kept groups only, in admission order, each once
    assert all(len(groups) == B for groups in trainer.step_groups)
    assert max(trainer.staleness) <= ETA and trainer.dropped() == 0
    gate = ctrl.gate.stats()
    filtered = [k for k in range(gate.admitted) if filtered_out(k)]
    # Nr counts the kept groups only: max_groups kept groups, however many were filtered.
    assert gate.admitted - gate.released == STEPS * B and gate.released == len(filtered)
    summary = ctrl.stats.summary()
    assert summary["filtered_groups"] == len(filtered) and summary["filtered_tokens"] > 0
    assert summary["wasted_tokens"] == 0
    assert filtered_groups(root) == filtered
    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert report.filtered_groups == len(filtered) and report.unwritten_groups == ()
    assert report.groups_written == STEPS * B and report.dropped_stale == 0


def test_a_restart_counts_filtered_groups_again_and_does_not_regenerate_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No trainer: at version 0 the gate admits (0 + eta + 1) * B = 4 kept groups, so 0..5
    with 0 and 3 filtered. The index is never saved in the first cycle (a kill after each
    filtered record), so the second learns the filtered groups from their records alone."""
    root = open_root(str(tmp_path / "run"))

    def no_save(root_: RunRoot, written: Any) -> None:
        raise RuntimeError("killed before the index save")

    monkeypatch.setattr(controller_module, "save_written_groups", no_save)
    first = filtering_controller(root, IndexEchoGenerator(slow={1: 0.5}), max_groups=None)
    with pytest.raises(RuntimeError, match="killed before the index save"):
        asyncio.run(first.run(asyncio.Event()))
    monkeypatch.undo()
    recorded = filtered_groups(root)
    assert 0 in recorded and set(recorded) <= {0, 3}  # group 0 was filtered at once, then the kill
    assert not fs.exists(root, paths.SCHEDULER_WRITTEN)

    second = filtering_controller(root, IndexEchoGenerator(slow={}), max_groups=None)

    async def until_quiet() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.0, stop.set)
        await second.run(stop)

    asyncio.run(until_quiet())
    gate = second.gate.stats()
    assert (gate.admitted, gate.released) == (6, 2)
    assert second.stats.filtered_groups == 2 - len(recorded)  # the recorded ones were not generated again
    assert filtered_groups(root) == [0, 3]
    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert report.filtered_groups == 2 and report.groups_written == 4
    assert sorted(k for k in range(6) if not filtered_out(k)) == [1, 2, 4, 5]


# ----- quarantined shards: generated again, once, within the bound -----


class QuarantiningTrainer(FakeTrainer):
    """Before each look at its input, quarantines the waiting shards that hold a group of
    ``poison`` (group -> how many of its shards to reject), as the trainer's feed does with a
    shard it cannot train on; the scheduler must then produce the group again."""

    def __init__(self, root: RunRoot, tmp_path: Path, poison: dict[int, int]) -> None:
        super().__init__(root, tmp_path)
        self.poison = dict(poison)
        self.rejected: list[str] = []

    def try_step(self) -> bool:
        for info in self.reader.list_pending():
            held = [group_index(g[0].group_id) for g in self.reader.read_groups(info)]
            if any(self.poison.get(k, 0) > 0 for k in held):
                for k in held:
                    self.poison[k] = self.poison.get(k, 0) - 1
                self.reader.quarantine(info)
                self.rejected.append(info.name)
        return super().try_step()


def test_a_quarantined_shard_s_groups_are_generated_again_once_each_and_trained_within_eta(tmp_path: Path) -> None:
    """Group 4's shard is rejected, then the shard of its regeneration too: each quarantine
    makes the scheduler admit the shard's groups again (at the version of the time, through
    the gate), every group is trained exactly once, none staler than eta, and the audit
    counts every quarantined group as generated again."""
    root = open_root(str(tmp_path / "run"))
    trainer = QuarantiningTrainer(root, tmp_path, poison={4: 2})
    ctrl = make_controller(root, LongTailGenerator())
    ctrl.quarantine_poll_seconds = 0.05
    asyncio.run(run_both(ctrl, trainer))
    assert trainer.step == STEPS and len(trainer.rejected) == 2
    trained = sorted(k for groups in trainer.step_groups for k in groups)
    assert trained == list(range(STEPS * B))  # group 4 and its shard-mates: once, from their last regeneration
    assert max(trainer.staleness) <= ETA and trainer.dropped() == 0
    from asyncrl.tasks.scheduler.gate_state import load_gate_state, load_regenerations

    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert report.quarantined_shards == 2 and report.awaiting_regeneration == ()
    assert report.quarantined_groups == report.regenerated_groups == ctrl.regenerated >= 3
    assert report.groups_written == STEPS * B and report.dropped_stale == 0
    state, regens = load_gate_state(root), load_regenerations(root)
    assert state is not None and state.admitted == STEPS * B  # the new groups g0..g15
    assert regens.admitted == ctrl.regenerated and regens.in_flight == ()
    gate = ctrl.gate.stats()  # each regeneration an admission, each quarantined group a release
    assert (gate.admitted, gate.released) == (STEPS * B + ctrl.regenerated, ctrl.regenerated)


def test_a_running_scheduler_admits_a_quarantined_shard_s_groups_again_within_the_gate(tmp_path: Path) -> None:
    """No trainer (version 0): the gate admits (0 + eta + 1) * B = 4 groups. A shard of 2 is
    quarantined: they are released and admitted again, 2 admissions, and no new group."""
    root = open_root(str(tmp_path / "run"))
    ctrl = make_controller(root, LongTailGenerator(slow={}), max_groups=None)
    ctrl.quarantine_poll_seconds = 0.05

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(ctrl.run(stop))
        reader = ShardReader(root, RUN_ID)
        while len(reader.list_pending()) < 2:
            await asyncio.sleep(0.02)
        reader.quarantine(min(reader.list_pending(), key=lambda info: info.seq))
        deadline = time.monotonic() + 10
        while ctrl.regenerated < 2 or len(reader.list_pending()) < 2 or ctrl.stats.groups_written < 6:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # the gate is full: nothing more is admitted
        stop.set()
        await task

    asyncio.run(scenario())
    gate = ctrl.gate.stats()
    assert (gate.admitted, gate.released, gate.capacity) == (6, 2, 4) and ctrl.stats.admitted == 4
    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert (report.admitted, report.groups_written, report.quarantined_groups, report.regenerated_groups) == (4, 4, 2, 2)


def test_a_restarted_scheduler_generates_a_quarantined_shard_again_once(tmp_path: Path) -> None:
    """Cycle 1 writes groups 0..3 and stops; shard [0, 1] is quarantined. Cycle 2 learns it at
    start and admits 0 and 1 again, but is stopped while 0 still generates (1 finished behind
    it, unwritten). Cycle 3 sends both out again without admitting them again; cycle 4 has
    nothing to do. Each group is in exactly one valid shard; the audit counts 2 regenerated."""
    root = open_root(str(tmp_path / "run"))
    first = make_controller(root, LongTailGenerator(slow={}), max_groups=4)
    asyncio.run(first.run(asyncio.Event()))
    reader = ShardReader(root, RUN_ID)
    shards = sorted(reader.list_shards(), key=lambda info: info.seq)
    assert [[group_index(g[0].group_id) for g in reader.read_groups(s)] for s in shards] == [[0, 1], [2, 3]]
    reader.quarantine(shards[0])
    assert audit_run(root, RUN_ID, ETA).awaiting_regeneration == ("g00000000", "g00000001")

    async def cycle(ctrl: RolloutController, stop_after: float | None = None) -> None:
        stop = asyncio.Event()
        if stop_after is not None:
            asyncio.get_running_loop().call_later(stop_after, stop.set)
        await ctrl.run(stop)

    second = make_controller(root, LongTailGenerator(slow={0: 30.0}), max_groups=4)
    asyncio.run(cycle(second, stop_after=0.8))
    assert second.regenerated == 2 and second.stats.admitted == 0
    from asyncrl.tasks.scheduler.gate_state import load_gate_state, load_regenerations

    state, regens = load_gate_state(root), load_regenerations(root)
    assert state is not None and state.admitted == 4 and regens.admitted == 2
    assert [(r.group, r.shard_seq, r.after) for r in regens.in_flight] == [(0, 0, 4), (1, 0, 4)]
    assert written_group_indices(root, RUN_ID).regenerate == {0: 0, 1: 0}

    third_generator = LongTailGenerator(slow={})
    third = make_controller(root, third_generator, max_groups=4)
    asyncio.run(cycle(third))
    assert third.regenerated == 0 and third.stats.resubmitted_after_restart == 2 and third.stats.admitted == 0
    assert third_generator.streamed == 2 * N * 3  # groups 0 and 1, once
    gate = third.gate.stats()
    assert (gate.admitted, gate.released) == (6, 2)

    fourth_generator = LongTailGenerator(slow={})
    fourth = make_controller(root, fourth_generator, max_groups=4)
    asyncio.run(cycle(fourth, stop_after=0.5))
    assert fourth.regenerated == 0 and fourth.stats.resubmitted_after_restart == 0 and fourth_generator.streamed == 0

    held = sorted(group_index(g[0].group_id) for s in reader.list_shards() for g in reader.read_groups(s))
    assert held == [0, 1, 2, 3]
    report = audit_run(root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert (report.quarantined_shards, report.quarantined_groups, report.regenerated_groups) == (1, 2, 2)
    assert report.unwritten_groups == () and report.awaiting_regeneration == ()
