"""The rollout controller: admits prompt groups through the staleness gate, has their
episodes produce and score their rows (single-turn samples or agent episodes, one
interface: :class:`~asyncrl.tasks.scheduler.protocols.GroupEpisodes`), writes trajectory
shards, and pushes every newly published weight version to the servers.

Exactly-once across restarts: group k is always prompt `PromptSchedule.record(k)` with id
`g{k:08d}`; the admitted count is persisted (`scheduler/state.json`) *before* group k is
dispatched, and shards (indexed in ``scheduler/written.json``) are the truth of what was
produced, so a restart re-dispatches admitted, unwritten groups without admitting them again. The
state also keeps each unwritten group's admission (the servers' weights then), which its
shard then carries (:mod:`asyncrl.storage.admissions`): the audit's second staleness count.
The gate admits group k (kept groups only) only while floor(k / B) <= i + eta, and groups are
written in admission order, never a shard across a batch boundary, so the trainer trains
group k at step floor(k / B): no sample is staler than eta. Filtered groups are recorded,
then released. The groups of a quarantined shard are released and admitted again, once
(:meth:`RolloutController._admit_one`). Proof, trade-offs, filtering, episodes:
``docs/internals/scheduler.md``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from asyncrl.tasks.algo.adaptive_eta import AdaptiveEta, AdaptiveState
from asyncrl.tasks.algo.staleness_gate import StalenessGate
from asyncrl.storage.admissions import Admission
from asyncrl.storage.doorbell import SHARDS_TOPIC, WEIGHTS_TOPIC, Doorbell, DoorbellListener
from asyncrl.storage import fs
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weight_lineage import VersionUpdates, read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.scheduler.controller_settings import ControllerSettings
from asyncrl.tasks.scheduler.controller_stats import ControllerStats
from asyncrl.tasks.scheduler.filtered import (
    NO_EPISODE_KEPT,
    all_equal_rewards,
    count_filtered,
    filtered_record_path,
    save_filtered,
    save_left_out,
)
from asyncrl.tasks.scheduler.gate_state import (
    AdmittedRegeneration,
    Regenerations,
    load_adaptive_state,
    load_admissions,
    load_gate_state,
    load_regenerations,
    save_gate_state,
)
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule, group_id, group_index
from asyncrl.tasks.agent.episodes import GroupGenerator
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.turn_journal import TurnJournal
from asyncrl.tasks.scheduler.journal_writer import JournalWriter
from asyncrl.tasks.scheduler.protocols import GroupEpisodes
from asyncrl.tasks.scheduler.written_index import (
    WrittenGroups,
    learn_quarantines,
    load_written_groups,
    save_written_groups,
)

LOG = logging.getLogger("asyncrl.scheduler")
QUARANTINE_POLL_SECONDS = 5.0
"""How often a running controller lists ``quarantine/`` for newly quarantined shards."""


class RolloutController:
    """Runs the admit -> generate -> score -> write loop until stopped."""

    def __init__(
        self,
        settings: ControllerSettings,
        root: RunRoot,
        prompts: PromptSchedule,
        generator: GroupGenerator,
        episodes: GroupEpisodes,
        weight_loader: Callable[[int], Callable[[Any], Any]],
        weight_prefetch: Callable[[int], object] | None = None,
        journal: SampleJournal | None = None,
        turns: TurnJournal | None = None,
    ) -> None:
        self.settings = settings
        self.root = root
        self.prompts = prompts
        self.generator = generator
        self.episodes = episodes
        """Produces each admitted group's rows (:mod:`asyncrl.tasks.agent.episodes`)."""
        self.weight_loader = weight_loader
        self.weight_prefetch = weight_prefetch
        """Fetches a version onto the servers' host before its update pauses generation
        (:meth:`~asyncrl.tasks.inference.weight_loader.ServerWeightLoader.prefetch`); None: the
        load fetches it during the pause."""
        self.journal = JournalWriter(root, journal, settings.rollout, turns) if journal is not None else None
        """Journals the samples of the unwritten groups (the generator's book, which the episodes
        fill) and, in an agent run, their episodes' completed turns (``turns``, the recording
        endpoint's book); None: a killed scheduler generates its groups in flight again from
        their prompts."""
        self.weights = WeightStore(root)
        self.version_updates = VersionUpdates(root)
        self.writer = ShardWriter(root, settings.run_id)
        self.written: WrittenGroups | None = None
        """The written-groups index (loaded when :meth:`run` starts)."""
        self._write_lock = asyncio.Lock()
        self.stats = ControllerStats()
        saved = load_gate_state(root)
        regenerations = load_regenerations(root)
        self._regen_admitted = regenerations.admitted
        """Regenerations admitted since the run began (:meth:`_admit_one`): the gate counts them
        beside the new groups, ``scheduler/state.json`` apart."""
        self._regen_saved = regenerations.in_flight
        """The regenerations the saved state names as admitted (those still unwritten are
        dispatched again when :meth:`run` starts)."""
        self._regen_in_flight: dict[int, AdmittedRegeneration] = {}
        """Admitted regenerations not yet written, by group, in admission order."""
        self.quarantine_poll_seconds = QUARANTINE_POLL_SECONDS
        if saved is not None:
            saved = dataclasses.replace(saved, admitted=saved.admitted + regenerations.admitted)
        self._gate_version = _GeneratorUpdates(generator, self.version_updates)
        self.gate = StalenessGate(settings.batch_groups, settings.rollout.eta, self._gate_version, state=saved)
        self._admissions: dict[int, Admission] = {}
        """Admission record of each group admitted and not yet written or left out (saved with
        the state, written into the group's shard)."""
        self._saved_admissions = load_admissions(root) or {}
        self.adaptive: AdaptiveEta | None = None
        """The effective bound's controller (``rollout.adaptive_staleness``); its state is
        loaded when :meth:`run` starts."""
        self._order: deque[int] = deque()
        """Dispatched groups not yet written, in admission order: the order they are written in."""
        self._done: dict[int, list[Sample] | None] = {}
        """Finished groups waiting for their turn to be written, by index (None: filtered)."""
        self._done_at: dict[int, float] = {}
        """When each group of ``_done`` finished (the shard timer)."""
        self._failure: BaseException | None = None
        self._version_changed = asyncio.Event()
        """Set when the servers move to a new version: the gate may admit again."""
        self._shards_bell = Doorbell(root, SHARDS_TOPIC)
        self._weights_listener: DoorbellListener | None = None

    @property
    def regenerated(self) -> int:
        """Groups of quarantined shards admitted again by this controller."""
        return self.stats.regenerated_groups

    async def run(self, stop: asyncio.Event) -> ControllerStats:
        """Work until `stop` is set (or `max_groups` are admitted and produced).

        On stop, the finished groups at the head of the admission order are written and
        groups still generating are cancelled; they and the finished groups behind them are
        in no shard, so a later run of the same root regenerates them (``wasted_tokens``)."""
        in_flight: set[asyncio.Task[None]] = set()
        streamed_before = sum(self.generator.streamed_tokens().values())
        self._weights_listener = await asyncio.to_thread(DoorbellListener, self.root, WEIGHTS_TOPIC)
        watcher = self._start(self._watch_weights(stop), "weight-watcher")
        flusher = self._start(self._flush_periodically(stop), "shard-flusher")
        quarantines = journaling = None
        try:
            written = await asyncio.to_thread(load_written_groups, self.root, self.settings.run_id)
            if await asyncio.to_thread(learn_quarantines, self.root, written):
                await asyncio.to_thread(save_written_groups, self.root, written)
            self.written = written
            await self._start_adaptive()
            left_out = await asyncio.to_thread(count_filtered, self.root, self.written, self._fresh_admitted())
            if left_out + await asyncio.to_thread(self._count_regenerations_left_out):
                await asyncio.to_thread(save_written_groups, self.root, self.written)
            # durable records (see the module docstring): filtered groups, and quarantined ones
            self.gate.release(self.written.filtered + self.written.quarantined_groups)
            unwritten = self._unwritten_admitted()
            if self.journal is not None:
                await self.journal.resume({group_id(index) for index in unwritten})
                journaling = self._start(self.journal.run(stop), "journal-writer")
            for index in unwritten:
                self.stats.resubmitted_after_restart += 1
                self._admissions[index] = self._saved_admissions.get(index) or self._admission(index)
                self._dispatch(index, in_flight, regeneration=index in self._regen_in_flight)
            quarantines = self._start(self._watch_quarantines(stop), "quarantine-watcher")
            await self._admit_loop(stop, in_flight)
            # Admissions are over (max_groups reached): finish the groups in flight,
            # unless stopped first; a stopped group is regenerated by the next run.
            while in_flight and not stop.is_set():
                self._raise_failure()
                await asyncio.wait(set(in_flight), timeout=0.5)
            self._raise_failure()
            await self._flush(partial=True)
        finally:
            self.stats.finished_at = time.monotonic()
            # Finished but behind a group that was still generating: not written (write order,
            # docs/internals/scheduler.md), generated again by the next run.
            self.stats.discarded_tokens += sum(s.model_token_count for g in self._done.values() if g for s in g)
            self.stats.streamed_tokens = sum(self.generator.streamed_tokens().values()) - streamed_before
            stop.set()
            helpers = [task for task in (watcher, flusher, quarantines, journaling) if task is not None]
            for task in (*in_flight, *helpers):
                task.cancel()
            await asyncio.gather(*in_flight, *helpers, return_exceptions=True)
            if self.journal is not None and journaling is not None:
                try:  # the next run goes on from the groups cut here
                    await self.journal.write()
                except Exception as exc:  # noqa: BLE001 - the stop goes on; the journal's last write stands
                    LOG.warning("the journal's last write failed (%r): the next run resumes from the one before", exc)
                self.stats.journal = self.journal.figures()
            await asyncio.to_thread(self._weights_listener.close)
            self._weights_listener = None
        self._raise_failure()
        return self.stats

    def _save_state(self) -> None:
        state = self.gate.state()
        save_gate_state(
            self.root,
            dataclasses.replace(state, admitted=state.admitted - self._regen_admitted),  # new groups only
            None if self.adaptive is None else self.adaptive.state(),
            Regenerations(self._regen_admitted, tuple(self._regen_in_flight.values())),
            self._admissions,
        )

    def _admission(self, index: int | None = None) -> Admission:
        """The servers' weights now, label and update count (the gate's i); with ``index``, a
        group re-dispatched whose admission no saved state recorded (an older scheduler's)."""
        admission = Admission(self.generator.current_version, self._gate_version.current_version())
        if index is not None:
            LOG.warning("group %s: no admission record saved; recorded at weight version %d", group_id(index),
                        admission.version)  # fmt: skip
        return admission

    def _fresh_admitted(self) -> int:
        """New groups admitted (ids g0 .. g{n-1}): the gate's admissions less the regenerations."""
        return self.gate.stats().admitted - self._regen_admitted

    async def _start_adaptive(self) -> None:
        """Go on from the saved effective bound, else start at eta reading from the servers' version."""
        config = self.settings.rollout.adaptive_staleness
        if config is None:
            return
        saved = await asyncio.to_thread(load_adaptive_state, self.root)
        if saved is None:
            saved = AdaptiveState(self.settings.rollout.eta, self.generator.current_version, 0)
        self.adaptive = AdaptiveEta(config, self.settings.rollout.eta, saved)
        self.gate.set_eta(self.adaptive.eta)
        self.stats.adaptive = self.adaptive.summary()

    async def _read_drift(self, latest: int) -> None:
        """Feed the adaptive bound the step figures of the versions published since the last
        one read, in order (their lineage; a version without figures counts as a step
        without drift measured), and apply its bound to the gate."""
        adaptive = self.adaptive
        if adaptive is None or latest <= adaptive.version:
            return
        before = adaptive.eta
        for version in range(adaptive.version + 1, latest + 1):
            lineage = await asyncio.to_thread(read_lineage, self.root, version)
            if lineage is None:
                continue  # not published by the trainer (or not kept): nothing measured
            metrics = lineage.get("metrics")
            step = lineage.get("step")
            adaptive.observe(version, step if isinstance(step, int) else 0, metrics if isinstance(metrics, dict) else {})
        adaptive.version = max(adaptive.version, latest)
        self.stats.adaptive = adaptive.summary()
        if adaptive.eta != before:
            self.gate.set_eta(adaptive.eta)
            self._save_state()
            if adaptive.eta > before:
                self._version_changed.set()  # the gate may admit again

    def _count_regenerations_left_out(self) -> int:
        """Count in the index the admitted regenerations left out (their record saved, the
        index not: a kill in between), as :func:`count_filtered` does for new groups; returns
        how many. A group of ``regenerate`` was in a shard since any earlier record, so a record
        is its regeneration's. One existence check per admitted regeneration still unwritten."""
        written = self.written
        assert written is not None
        found = [r.group for r in self._regen_saved if written.regenerate.get(r.group) == r.shard_seq
                 and fs.exists(self.root, filtered_record_path(r.group))]  # fmt: skip
        written.add(found)
        written.filtered += len(found)
        return len(found)

    def _unwritten_admitted(self) -> list[int]:
        """The admitted groups to dispatch again after a restart, in admission order: the new
        groups no shard holds, and the regenerations the saved state names as admitted whose
        group is still to be generated again for the same quarantined shard, each put back
        at its place among the new groups (after the ``after`` first ones)."""
        written = self.written
        assert written is not None
        order = [((k, 1, 0), k) for k in written.missing_below(self._fresh_admitted())]
        for position, regen in enumerate(self._regen_saved):
            if written.regenerate.get(regen.group) == regen.shard_seq:
                self._regen_in_flight[regen.group] = regen
                order.append(((regen.after, 0, position), regen.group))
        return [index for _, index in sorted(order)]

    async def _admit_loop(self, stop: asyncio.Event, in_flight: set[asyncio.Task[None]]) -> None:
        limit, cap = self.settings.max_groups, self.settings.rollout.max_groups_in_flight
        while not stop.is_set():
            self._raise_failure()
            all_admitted = limit is not None and self._admitted_kept() >= limit
            if all_admitted and not in_flight:
                return
            if all_admitted or (cap is not None and len(in_flight) >= cap):
                # Wait for a group to finish: at max_groups it may yet be filtered out and
                # another admitted instead; at the cap it makes room for the next one.
                await asyncio.wait(set(in_flight), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                continue
            if not self.gate.try_admit():
                # Woken by the next weight update (the only thing that opens the gate);
                # the poll interval is a fallback.
                self._version_changed.clear()
                if not self.gate.try_admit():
                    await _wait_either(stop, self._version_changed, self.settings.admit_poll_seconds)
                    continue
            self._admit_one(in_flight)

    def _admit_one(self, in_flight: set[asyncio.Task[None]]) -> None:
        """Dispatch the group the gate just admitted: the oldest group of a quarantined shard
        waiting to be generated again, else the next new group; its admission is saved first.

        How the gate counts a quarantined shard's groups: when the quarantine is learnt
        (:meth:`_learn_quarantines`), each of its groups is released (it will not be trained,
        like a filtered group), and its regeneration is a new admission under the same rule at
        the current version: Nr - 1 = admissions - releases before it, floor((Nr - 1) / B) <=
        i + e. Staleness stays within eta: the regeneration is written after every group
        admitted before it (write order is admission order) and the trainer's position of a
        group only counts groups it trains, so as for any admission its position j <= Nr - 1
        (the releases of the groups before it happen before it is trained, or j is smaller
        still) and the trainer, taking at least B groups a step, trains it by step
        floor(j / B) + 1. The admission counts in ``max_groups`` like a new group, so the run
        still produces as many kept groups."""
        written = self.written
        assert written is not None
        regen = next(((k, seq) for k, seq in written.regenerate.items() if k not in self._regen_in_flight), None)
        if regen is None:
            index = self._fresh_admitted() - 1
            self._admissions[index] = self._admission()
            self._save_state()  # before dispatch: see module docstring
            self.stats.admitted += 1
            self._dispatch(index, in_flight)
            return
        index, seq = regen
        self._regen_admitted += 1
        self._regen_in_flight[index] = AdmittedRegeneration(index, seq, self._fresh_admitted())
        self._admissions[index] = self._admission()
        self._save_state()  # before dispatch, as for a new group
        self.stats.regenerated_groups += 1
        LOG.info("group %s (of quarantined shard %d) admitted again", group_id(index), seq)
        self._dispatch(index, in_flight, regeneration=True)

    async def _learn_quarantines(self) -> None:
        """Un-write and release the groups of the shards quarantined since the last look
        (:func:`learn_quarantines`); the gate then admits them again (:meth:`_admit_one`)."""
        async with self._write_lock:
            if self.written is None:
                return
            written = copy.deepcopy(self.written)  # the admission reads the index meanwhile
            found = await asyncio.to_thread(learn_quarantines, self.root, written)
            if found:
                await asyncio.to_thread(save_written_groups, self.root, written)  # durable before released
                self.written = written
                self.gate.release(len(found))
                self._version_changed.set()  # the gate may admit again
            else:
                self.written.quarantined = written.quarantined  # seen, none to regenerate

    async def _watch_quarantines(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _wait(stop, self.quarantine_poll_seconds)
            if not stop.is_set():
                await self._learn_quarantines()

    def _admitted_kept(self) -> int:
        """Groups admitted and not released by filtering (what ``max_groups`` counts)."""
        stats = self.gate.stats()
        return stats.admitted - stats.released

    def _dispatch(self, index: int, in_flight: set[asyncio.Task[None]], regeneration: bool = False) -> None:
        """Start producing group ``index``; new groups go out in index order, a regeneration
        (:meth:`_admit_one`) wherever it was admitted."""
        if index in self._done or index in self._order:
            raise RuntimeError(f"group {index} dispatched while it is being produced")
        fresh = [k for k in self._order if k not in self._regen_in_flight]
        if not regeneration and fresh and index <= fresh[-1]:
            raise RuntimeError(f"group {index} dispatched after group {fresh[-1]}: groups go out in admission order")
        self._order.append(index)
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
        """Group ``index``'s rows from its episodes (either kind: one path), then left out
        (none kept, or dynamic filtering) or queued for its turn to be written."""
        record = self.prompts.record(index)
        samples = await self.episodes.produce(group_id(index), record, self.stats)
        if not samples:
            await asyncio.to_thread(save_left_out, self.root, index, record.prompt_id, NO_EPISODE_KEPT, [])
            self._leave_out(index)
            LOG.warning("group %s left out: none of its %d episodes could be kept", group_id(index),
                        self.settings.sampling.n_samples)  # fmt: skip
        elif self.settings.rollout.dynamic_filter and all_equal_rewards(samples):
            await asyncio.to_thread(save_filtered, self.root, samples)  # durable before it is released
            self._leave_out(index)
            self.stats.filtered_tokens += sum(s.model_token_count for s in samples)
            LOG.info("group %s left out by dynamic filtering: all %d rewards are %g", group_id(index), len(samples),
                     samples[0].reward)  # fmt: skip
        else:
            self._done[index] = samples
        self._done_at[index] = time.monotonic()
        await self._flush()

    def _leave_out(self, index: int) -> None:
        """Group ``index`` (its record saved) goes in no shard: release it from the gate."""
        if self.journal is not None:
            self.journal.forget([group_id(index)])
        self.gate.release()
        self._admissions.pop(index, None)
        self.stats.filtered_groups += 1
        self._version_changed.set()  # the gate may admit again
        self._done[index] = None

    def _take_writable(self, partial: bool) -> list[tuple[list[list[Sample]], list[int]]]:
        """Take the shards to write now off the buffer, each as (its groups, the filtered
        groups before them): the finished groups at the head of the admission order, cut
        after every kept group that completes a batch (the groups in shards reach a multiple
        of B), so no shard straddles two of the trainer's steps. Whole batches are taken at
        once; the rest of the head only with ``partial``, when it holds ``shard_groups`` kept
        groups, or when it holds filtered groups alone (nothing to write but the index)."""
        assert self.written is not None
        batch = self.settings.batch_groups
        kept = self.written.in_shards
        pieces: list[list[int]] = []
        piece: list[int] = []
        for index in self._order:
            if index not in self._done:
                break  # the head of the line is still generating
            piece.append(index)
            if self._done[index] is None:
                continue  # filtered: in no shard
            kept += 1
            if kept % batch == 0:
                pieces.append(piece)
                piece = []
        piece_kept = sum(1 for k in piece if self._done[k] is not None)
        if piece and (partial or piece_kept == 0 or piece_kept >= self.settings.rollout.shard_groups):
            pieces.append(piece)
        for _ in range(sum(len(p) for p in pieces)):
            self._order.popleft()
        taken = []
        for p in pieces:
            groups = [self._done.pop(k) for k in p]
            for k in p:
                self._done_at.pop(k, None)
            taken.append(([g for g in groups if g is not None], [k for k, g in zip(p, groups) if g is None]))
        return taken

    async def _flush(self, partial: bool = False) -> None:
        """Write the finished groups whose turn has come (:meth:`_take_writable`), one shard per
        piece (groups are never split).

        Pieces are taken inside the write lock, so shards are published in admission order
        (the write runs in a thread, so the event loop keeps streaming tokens); if a write
        fails the controller fails and a restart regenerates its groups, since no shard holds
        them. Each write is followed by saving the written-groups index (see
        :func:`load_written_groups`): three PUTs per shard (claim, shard, index). The
        trainer's doorbell is rung as soon as a shard is published."""
        async with self._write_lock:
            written = self.written
            if written is None:
                return
            for groups, filtered in self._take_writable(partial):
                written.add(filtered)  # their records are durable (written when they were filtered)
                written.filtered += len(filtered)
                for index in filtered:
                    self._regen_in_flight.pop(index, None)
                if groups:
                    admissions = {g[0].group_id: self._admissions[group_index(g[0].group_id)] for g in groups}
                    shard = await asyncio.to_thread(self.writer.write_groups, groups, admissions)
                    self.stats.groups_written += len(groups)
                    self.stats.shards_written += 1
                    self.stats.written_tokens += sum(s.model_token_count for g in groups for s in g)
                    indices = {group_index(group[0].group_id) for group in groups}
                    for index in indices:
                        self._admissions.pop(index, None)
                    written.add(indices)
                    written.next_seq = max(written.next_seq, shard.seq + 1)
                    for index in indices:
                        self._regen_in_flight.pop(index, None)
                    if self.journal is not None:
                        self.journal.forget([group_id(index) for index in indices])
                    await asyncio.to_thread(self._shards_bell.ring)  # the trainer looks at once
                    LOG.info("wrote %s (%d groups)", shard.name, len(groups))
                await asyncio.to_thread(save_written_groups, self.root, written)

    async def _flush_periodically(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _wait(stop, min(1.0, self.settings.rollout.shard_seconds))
            oldest = min(self._done_at.values(), default=None)
            if oldest is not None and time.monotonic() - oldest >= self.settings.rollout.shard_seconds:
                await self._flush(partial=True)

    async def _watch_weights(self, stop: asyncio.Event) -> None:
        """Push each newly published version to every server (fetch it onto their host
        where :attr:`weight_prefetch` can, then pause, load, resume), as soon as the trainer
        rings the weights doorbell (``weight_poll_seconds`` is the fallback)."""
        while not stop.is_set():
            latest = await asyncio.to_thread(self.weights.latest)
            if latest is not None:
                # Its update count (lineage; cached per version), read off the event loop: the
                # gate asks for it next.
                await asyncio.to_thread(self.version_updates, latest)
            if latest is not None and latest > self.generator.current_version:
                if self.weight_prefetch is not None:  # generation goes on meanwhile
                    await asyncio.to_thread(self.weight_prefetch, latest)
                stats = await self.generator.update_weights(latest, self.weight_loader(latest))
                self._version_changed.set()
                # after the wake-up: the lineage read must not hold up admission; a bound it
                # lowers applies from the next admission (every one is within eta regardless)
                await self._read_drift(latest)
                self.stats.updates.append(stats)
                LOG.info("rollout now on weight version %d (stall %.2fs)", latest, stats.stall_s)
                continue  # a version published during the update is loaded at once
            if stop.is_set():
                break
            if self._weights_listener is None:
                await _wait(stop, self.settings.rollout.weight_poll_seconds)
            else:
                await _first_of(stop.wait(), self._weights_listener.wait_async(self.settings.rollout.weight_poll_seconds))


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


async def _first_of(*waits: Coroutine[Any, Any, object]) -> None:
    """Return when the first of ``waits`` returns; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_either(stop: asyncio.Event, event: asyncio.Event, seconds: float) -> None:
    """Wait until ``stop`` or ``event`` is set, at most ``seconds``."""
    try:
        await asyncio.wait_for(_first_of(stop.wait(), event.wait()), timeout=seconds)
    except TimeoutError:
        pass
