"""The rollout controller: admits prompt groups through the staleness gate, generates
them on the rollout servers, scores them, writes trajectory shards, and pushes every
newly published weight version to the servers.

Plain asyncio over narrow protocols (a group generator, a reward scorer); the scheduler
process (`tasks/scheduler/main.py`) only wires real components into it.

Exactly-once across restarts: group k (k = 0, 1, ...) is always prompt
`PromptSchedule.record(k)` and always has id `g{k:08d}`. The gate's admitted count is
persisted (`scheduler/state.json`) *before* group k is dispatched, and shards are the
truth of what was produced: a restarted controller re-dispatches the admitted groups
that no shard holds (they were in flight or buffered), without admitting them again,
so neither the staleness bound nor the exactly-once rule can break.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.tasks.scheduler.staleness_gate import GateState, StalenessGate
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.storage.weight_lineage import VersionUpdates
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.loader import PromptRecord
from asyncrl.tasks.reward.types import RewardRequest, RewardResult
from asyncrl.tasks.rollout.samples import SampleOutput, UpdateStats

LOG = logging.getLogger("asyncrl.scheduler")


class GroupGenerator(Protocol):
    """What the controller needs of the rollout client."""

    @property
    def current_version(self) -> int: ...

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> list[SampleOutput]: ...

    async def update_weights(self, version: int, load: Callable[[Any], Any]) -> UpdateStats: ...


class RewardScorer(Protocol):
    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]: ...


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ControllerSettings:
    run_id: str
    batch_groups: int
    eta: int
    n_samples: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate to the budget: no end-of-sequence or stop token ends a sample."""
    shard_groups: int = 4
    shard_seconds: float = 10.0
    weight_poll_seconds: float = 0.5
    admit_poll_seconds: float = 0.05
    seed: int = 0
    max_groups: int | None = None
    """Admit at most this many groups in total (None: until stopped)."""


def group_id(index: int) -> str:
    return f"g{index:08d}"


def group_index(gid: str) -> int:
    if not (gid.startswith("g") and gid[1:].isdigit()):
        raise ValueError(f"group id {gid!r} was not written by the scheduler (expected g########)")
    return int(gid[1:])


class PromptSchedule:
    """Group k -> prompt: epoch e = k // N visits all N prompts in a permutation seeded
    by (seed, e), so the order is reproducible and each epoch sees every prompt once."""

    def __init__(self, records: Sequence[PromptRecord], seed: int) -> None:
        if not records:
            raise ValueError("the prompt dataset is empty")
        self._records = list(records)
        self._seed = seed
        self._orders: dict[int, list[int]] = {}

    def record(self, index: int) -> PromptRecord:
        epoch, position = divmod(index, len(self._records))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._records)))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all the controller needs
        return self._records[order[position]]


def sample_budget(record: PromptRecord, max_new_tokens: int) -> int:
    """Output-token budget of each sample of ``record``: min(record.max_new_tokens, max_new_tokens),
    or ``max_new_tokens`` when the prompt sets none."""
    return max_new_tokens if record.max_new_tokens is None else min(record.max_new_tokens, max_new_tokens)


def load_gate_state(root: RunRoot) -> GateState | None:
    try:
        raw = fs.read_bytes(root, paths.SCHEDULER_STATE)
    except FileNotFoundError:
        return None
    try:
        return GateState.from_json(json.dumps(json.loads(raw)["gate"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def save_gate_state(root: RunRoot, state: GateState) -> None:
    payload = {"gate": json.loads(state.to_json()), "saved_at": time.time()}
    fs.put_atomic_replace(root, paths.SCHEDULER_STATE, json.dumps(payload).encode())


def written_group_indices(root: RunRoot, run_id: str) -> set[int]:
    """Indices of the groups some shard of this run already holds."""
    reader = ShardReader(root, run_id)
    written: set[int] = set()
    for shard in reader.list_shards():
        table = reader.read(shard)
        written.update(group_index(g) for g in set(table.column("group_id").to_pylist()))
    return written


@dataclass
class ControllerStats:
    admitted: int = 0
    resubmitted_after_restart: int = 0
    groups_written: int = 0
    shards_written: int = 0
    samples: int = 0
    output_tokens: int = 0
    reward_sum: float = 0.0
    reward_reasons: dict[str, int] = field(default_factory=dict)
    updates: list[UpdateStats] = field(default_factory=list)
    skipped_prompts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    """When the controller stopped (None while it runs): rates are over its lifetime only,
    not the shutdown of the servers that follows."""

    def summary(self) -> dict[str, float]:
        """Counts and rates over elapsed = finished_at (or now) - started_at:
        gen_tokens_per_s = output_tokens / elapsed, weight_sync_stall_fraction = stall / elapsed."""
        end = time.monotonic() if self.finished_at is None else self.finished_at
        elapsed = max(end - self.started_at, 1e-9)
        stall = sum(u.stall_s for u in self.updates)
        return {
            "elapsed_s": elapsed,
            "admitted": self.admitted,
            "groups_written": self.groups_written,
            "shards_written": self.shards_written,
            "samples": self.samples,
            "output_tokens": self.output_tokens,
            "gen_tokens_per_s": self.output_tokens / elapsed,
            "reward_mean": self.reward_sum / self.samples if self.samples else 0.0,
            "weight_updates": len(self.updates),
            "weight_sync_stall_s": stall,
            "weight_sync_stall_fraction": stall / elapsed,
            "skipped_prompts": self.skipped_prompts,
        }


class RolloutController:
    """Runs the admit -> generate -> score -> write loop until stopped."""

    def __init__(
        self,
        settings: ControllerSettings,
        root: RunRoot,
        prompts: PromptSchedule,
        render: Callable[[PromptRecord], str],
        codec: TextCodec,
        generator: GroupGenerator,
        scorer: RewardScorer,
        weight_loader: Callable[[int], Callable[[Any], Any]],
    ) -> None:
        self.settings = settings
        self.root = root
        self.prompts = prompts
        self.render = render
        self.codec = codec
        self.generator = generator
        self.scorer = scorer
        self.weight_loader = weight_loader
        self.weights = WeightStore(root)
        self.version_updates = VersionUpdates(root)
        self.writer = ShardWriter(root, settings.run_id)
        self.stats = ControllerStats()
        self.gate = StalenessGate(
            settings.batch_groups,
            settings.eta,
            _GeneratorUpdates(generator, self.version_updates),
            state=load_gate_state(root),
        )
        self._finished: list[list[Sample]] = []
        self._oldest_finished_at: float | None = None
        self._failure: BaseException | None = None

    async def run(self, stop: asyncio.Event) -> ControllerStats:
        """Work until `stop` is set (or `max_groups` are admitted and produced).

        On stop, finished groups are written and groups still generating are cancelled:
        no shard holds them, so a later run of the same root regenerates them."""
        in_flight: set[asyncio.Task[None]] = set()
        watcher = self._start(self._watch_weights(stop), "weight-watcher")
        flusher = self._start(self._flush_periodically(stop), "shard-flusher")
        try:
            for index in self._unwritten_admitted():
                self.stats.resubmitted_after_restart += 1
                self._dispatch(index, in_flight)
            await self._admit_loop(stop, in_flight)
            # Admissions are over (max_groups reached): finish the groups in flight,
            # unless stopped first; a stopped group is regenerated by the next run.
            while in_flight and not stop.is_set():
                self._raise_failure()
                await asyncio.wait(set(in_flight), timeout=0.5)
            self._raise_failure()
            await self._flush()
        finally:
            self.stats.finished_at = time.monotonic()
            stop.set()
            for task in (*in_flight, watcher, flusher):
                task.cancel()
            await asyncio.gather(*in_flight, watcher, flusher, return_exceptions=True)
        self._raise_failure()
        return self.stats

    def _unwritten_admitted(self) -> list[int]:
        admitted = self.gate.stats().admitted
        written = written_group_indices(self.root, self.settings.run_id)
        return [k for k in range(admitted) if k not in written]

    async def _admit_loop(self, stop: asyncio.Event, in_flight: set[asyncio.Task[None]]) -> None:
        limit = self.settings.max_groups
        while not stop.is_set() and (limit is None or self.gate.stats().admitted < limit):
            self._raise_failure()
            if not self.gate.try_admit():
                await _wait(stop, self.settings.admit_poll_seconds)
                continue
            index = self.gate.stats().admitted - 1
            save_gate_state(self.root, self.gate.state())  # before dispatch: see module docstring
            self.stats.admitted += 1
            self._dispatch(index, in_flight)

    def _dispatch(self, index: int, in_flight: set[asyncio.Task[None]]) -> None:
        task = self._start(self._produce_group(index), f"group-{index}")
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    def _start(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task whose failure fails the controller (checked by `_raise_failure`)."""
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(self._note_failure)
        return task

    def _note_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _produce_group(self, index: int) -> None:
        record = self.prompts.record(index)
        prompt_ids = self.codec.encode(self.render(record))
        if len(prompt_ids) > self.settings.max_prompt_tokens:
            raise ValueError(
                f"prompt {record.prompt_id} has {len(prompt_ids)} tokens, over data.max_prompt_tokens "
                f"= {self.settings.max_prompt_tokens}"
            )
        outputs = await self.generator.generate_group(
            prompt_ids,
            self.settings.n_samples,
            sample_budget(record, self.settings.max_new_tokens),
            self.settings.temperature,
            self.settings.top_p,
            ignore_eos=self.settings.ignore_eos,
            stop_token_ids=() if self.settings.ignore_eos else self.settings.stop_token_ids,
        )
        texts = [self.codec.decode(o.output_token_ids) for o in outputs]
        results = await self.scorer.score(
            [RewardRequest(kind="math", response=t, reference=record.answer) for t in texts]
        )
        samples = [
            Sample(
                prompt_id=record.prompt_id,
                group_id=group_id(index),
                prompt_token_ids=prompt_ids,
                output_token_ids=o.output_token_ids,
                behaviour_logprobs=o.behaviour_logprobs,
                token_versions=o.token_versions,
                reward=r.reward,
                finish_reason=o.finish_reason,
                submit_time=o.timings.submitted_at,
                finish_time=o.timings.finished_at,
            )
            for o, r in zip(outputs, results, strict=True)
        ]
        for output, result in zip(outputs, results, strict=True):
            self.stats.samples += 1
            self.stats.output_tokens += len(output.output_token_ids)
            self.stats.reward_sum += result.reward
            reason = str(result.reason)
            self.stats.reward_reasons[reason] = self.stats.reward_reasons.get(reason, 0) + 1
        self._finished.append(samples)
        if self._oldest_finished_at is None:
            self._oldest_finished_at = time.monotonic()
        if len(self._finished) >= self.settings.shard_groups:
            await self._flush()

    async def _flush(self) -> None:
        """Write every finished group as one shard (groups are never split).

        The groups are taken from the buffer before the write (in a thread, so the
        event loop keeps streaming tokens); if the write fails the controller fails and
        a restart regenerates them, since no shard holds them."""
        if not self._finished:
            return
        groups, self._finished, self._oldest_finished_at = self._finished, [], None
        shard = await asyncio.to_thread(self.writer.write_groups, groups)
        self.stats.groups_written += len(groups)
        self.stats.shards_written += 1
        LOG.info("wrote %s (%d groups)", shard.name, len(groups))

    async def _flush_periodically(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _wait(stop, min(1.0, self.settings.shard_seconds))
            oldest = self._oldest_finished_at
            if oldest is not None and time.monotonic() - oldest >= self.settings.shard_seconds:
                await self._flush()

    async def _watch_weights(self, stop: asyncio.Event) -> None:
        """Push each newly published version to every server (pause, load, resume)."""
        while not stop.is_set():
            latest = await asyncio.to_thread(self.weights.latest)
            if latest is not None and latest > self.generator.current_version:
                # Read its update count (lineage) here, off the event loop: the gate asks for it next.
                await asyncio.to_thread(self.version_updates, latest)
                stats = await self.generator.update_weights(latest, self.weight_loader(latest))
                self.stats.updates.append(stats)
                LOG.info("rollout now on weight version %d (stall %.2fs)", latest, stats.stall_s)
            await _wait(stop, self.settings.weight_poll_seconds)


class _GeneratorUpdates:
    """The gate's i: the training steps received by the weights the rollout servers generate
    with (that version, not the newest published one, so a sample's first token is never
    older than the gate assumed), read from the version's lineage
    (:func:`asyncrl.storage.weight_lineage.lineage_updates`).

    Steps, not the version label, because the trainer measures staleness in steps: after a
    trainer restart from checkpoint step s, the killed trainer's labels up to k stay
    published and the resumed trainer's label k + j holds s + j steps. Admitting against
    the label would admit (k - s) * B groups that the resumed trainer reaches only more
    than eta steps after their first token; against steps the gate waits instead until the
    resumed trainer has caught up with what was already admitted. Without a rollback the
    two are the same count. What a rollback cannot undo: groups admitted before it whose
    tokens the resumed trainer's weights (fewer steps) sample, because they were in flight
    or are generated again after a scheduler restart, may lag more than eta steps when
    they are trained; the trainer then drops them by its rule."""

    def __init__(self, generator: GroupGenerator, updates: Callable[[int], int]) -> None:
        self._generator = generator
        self._updates = updates

    def current_version(self) -> int:
        return self._updates(self._generator.current_version)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
