"""The RL training loop: wait for B groups, record, train, publish, checkpoint; resume.

Per step k: take the first-written unconsumed shards holding >= B groups
(:mod:`asyncrl.tasks.trainer.feed`), record them in the ledger as step k before anything is
published and retire them, run the RL step (:func:`run_rl_step`), publish version i + 1 with
its lineage, and checkpoint every ``checkpoint_every`` steps. Rank 0 alone reads and writes
the run root; all ranks train the same input. A restart loads the newest complete checkpoint
c and rolls back the ledger after c.step; versions published since are kept and labels go
on from the latest, so versions stay strictly increasing while labels may run ahead of
updates; the first version it publishes names c's version as its parent (the weights it
resumed from, :func:`resumed_state`). So staleness counts the updates a version's lineage records
(:func:`asyncrl.tasks.trainer.staleness.sample_staleness`), never label differences. Step by step
and resume: ``docs/internals/trainer.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.trainer import TrainerConfig
from asyncrl.storage.doorbell import SHARDS_TOPIC, WEIGHTS_TOPIC, Doorbell, DoorbellListener
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.weight_lineage import LINEAGE_FILE, VersionUpdates  # LINEAGE_FILE: also imported from here
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.trainer.checkpoint import (
    CheckpointState,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from asyncrl.tasks.trainer.data_parallel import barrier, broadcast_from_rank0
from asyncrl.tasks.trainer.engine import TrainEngine, save_hf_weights
from asyncrl.tasks.trainer.feed import StepInput
from asyncrl.tasks.trainer.metrics import MetricsSink
from asyncrl.tasks.trainer.retention import RetentionPolicy, prune_after_publish
from asyncrl.tasks.trainer.reference import ReferencePolicy
from asyncrl.tasks.trainer.step import run_rl_step
from asyncrl.tasks.trainer.staleness import UpdateCount, sample_staleness
from asyncrl.tasks.trainer.step_source import PendingShards, StepSource
from asyncrl.tasks.trainer.rl_settings import RLSettings

logger = logging.getLogger(__name__)


def stale_tokens(step_input: StepInput, max_staleness: int | None, trainer_updates: int, updates_of: UpdateCount) -> int:
    """Generated (model) tokens of the samples the step drops as staler than ``max_staleness``
    (the rule of :func:`asyncrl.tasks.trainer.step.prepare_step`): generated, then thrown away;
    environment tokens of multi-turn samples were not generated and do not count. None in a
    healthy run, where the scheduler's write order keeps every sample within the bound
    (:mod:`asyncrl.tasks.scheduler.controller`); a restart can still cause some."""
    if max_staleness is None:
        return 0
    return sum(
        sample.model_token_count
        for group in step_input.groups
        for sample in group
        if sample_staleness(sample, trainer_updates, updates_of) > max_staleness
    )


class TrainerWaitTimeout(TimeoutError):
    """Not enough trajectory groups arrived in time."""


@dataclass(frozen=True)
class LoopSettings:
    """How the loop runs: batch size in groups, step budget, checkpoint cadence, waiting."""

    batch_groups: int
    max_steps: int
    """Total steps of the run, counted across restarts."""
    checkpoint_every: int
    keep_checkpoints: int = 2
    poll_interval_s: float = 1.0
    """Longest wait between looks for shards; the scheduler's doorbell ends a wait as soon as a shard is written."""
    wait_timeout_s: float | None = None
    """Give up (:class:`TrainerWaitTimeout`) after waiting this long for one batch; None waits forever."""
    retention: RetentionPolicy | None = None
    """Which published versions to keep after each publish; None prunes nothing."""

    @staticmethod
    def from_config(
        trainer: TrainerConfig, max_staleness: int, poll_interval_s: float = 1.0, wait_timeout_s: float | None = None
    ) -> LoopSettings:
        """The RL trainer's loop: the ``trainer`` section's batch, steps and checkpoint cadence,
        and retention by the run's staleness bound and ``trainer.keep_versions``."""
        return LoopSettings(
            batch_groups=trainer.batch_groups,
            max_steps=trainer.max_steps,
            checkpoint_every=trainer.checkpoint_every,
            poll_interval_s=poll_interval_s,
            wait_timeout_s=wait_timeout_s,
            retention=RetentionPolicy(max_staleness=max_staleness, keep_versions=trainer.keep_versions),
        )


@dataclass(frozen=True)
class TrainerState:
    step: int
    """Steps done: the training steps the trainer's weights have received, the reference of
    staleness (not ``version``, which runs ahead of it after a rollback)."""
    version: int
    """The newest version label of the run when the trainer last published or resumed: it
    publishes ``version + 1`` next."""
    parent: int | None = None
    """The version whose weights the trainer holds, when not ``version``: right after a resume
    from a checkpoint older than the newest published version (:func:`resumed_state`)."""

    @property
    def holds(self) -> int:
        """The version the trainer's weights were published as: the parent of its next version."""
        return self.version if self.parent is None else self.parent


def resumed_state(store: WeightStore, checkpoint: CheckpointState) -> TrainerState:
    """The state of a trainer resumed from ``checkpoint``: its steps; labels go on from the
    newest complete version (a killed trainer may have published past the checkpoint); and
    the weights it holds are the checkpoint's version, the parent of the next version (not
    the newest label: those weights were trained further, on a branch the resume discards).
    One read of the newest version."""
    latest = store.newest_complete()
    label = max(checkpoint.version, -1 if latest is None else latest)
    return TrainerState(checkpoint.step, label, None if label == checkpoint.version else checkpoint.version)


def step_lineage(state: TrainerState, run_id: str, shards: Sequence[str], figures: dict[str, float]) -> dict[str, object]:
    """The lineage of the version published for the step after ``state``: its parent is the
    version whose weights the step started from (:attr:`TrainerState.holds`)."""
    return {"parent_version": state.holds, "step": state.step + 1, "run_id": run_id, "shards": list(shards),
            "metrics": figures}  # fmt: skip


@dataclass(frozen=True)
class StartReport:
    """How :meth:`RLTrainer.start` found the run root."""

    state: TrainerState
    resumed_from: int | None
    """Checkpoint step loaded, or None for a fresh start."""
    rolled_back: tuple[int, ...]
    """Ledger steps deleted because the checkpoint does not contain them."""
    published_initial: bool


def publish_weights(
    store: WeightStore,
    engine: TrainEngine,
    version: int,
    lineage: dict[str, object],
    work_dir: Path,
    retention: RetentionPolicy | None = None,
) -> None:
    """Write the engine's weights as an HF directory and publish it as ``version``.

    Collective: every rank calls it (under ZeRO 3 the weights are gathered from all ranks,
    :func:`~asyncrl.tasks.trainer.engine.save_hf_weights`); rank 0 alone touches the
    staging directory and the store, and prunes older versions under ``retention``."""
    writer = engine.rank == 0
    staging = Path(work_dir) / "publish" / f"v{version}"
    if writer:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        save_hf_weights(engine, staging, {LINEAGE_FILE: json.dumps({"version": version, **lineage}, indent=1)})
        if writer:
            store.publish(version, staging)
            prune_after_publish(store, version, retention)
    finally:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)


class RLTrainer:
    """Runs RL steps on one engine against one run root (see the module docstring)."""

    def __init__(
        self,
        root: RunRoot,
        run_id: str,
        engine: TrainEngine,
        rl: RLSettings,
        loop: LoopSettings,
        work_dir: Path,
        metrics: MetricsSink,
        reference: ReferencePolicy | None = None,
        source: StepSource | None = None,
    ) -> None:
        """``source``: where each step's shards come from (default: the ones the scheduler
        writes to ``root``, :class:`~asyncrl.tasks.trainer.step_source.PendingShards`)."""
        self._root = root
        self._reference = reference
        self._run_id = run_id
        self._engine = engine
        self._rl = rl
        self._loop = loop
        self._work_dir = Path(work_dir)
        self._metrics = metrics
        self._ledger = Ledger(root)
        self._store = WeightStore(root)
        self._source = source or PendingShards(root, run_id, engine.vocab_size, rl.micro_batch_tokens)
        self._updates = VersionUpdates(self._source.samples_root)  # a replay: the original's versions
        self._state: TrainerState | None = None
        self._weights_bell = Doorbell(root, WEIGHTS_TOPIC)

    @property
    def state(self) -> TrainerState:
        if self._state is None:
            raise RuntimeError("RLTrainer.start() has not run")
        return self._state

    def start(self) -> StartReport:
        """Resume from the newest complete checkpoint, or start fresh (see the module docstring)."""
        checkpoint = latest_checkpoint(self._root)
        writer = self._engine.rank == 0
        published_initial = False
        if checkpoint is not None:
            load_checkpoint(self._root, self._engine, checkpoint.step, self._work_dir)
            rolled_back = self._ledger.rollback_after(checkpoint.step, self._source.restore) if writer else []
            if writer:
                self._source.retire_recorded(self._ledger)
            barrier()
            state = resumed_state(self._store, checkpoint)
        else:
            # Ledger entries without any checkpoint (checkpoints deleted by hand): start over.
            rolled_back = self._ledger.rollback_after(0, self._source.restore) if writer else []
            barrier()
            latest = self._store.newest_complete()
            barrier()
            if latest is None:
                publish_weights(
                    self._store, self._engine, 0, {"parent_version": None, "step": 0}, self._work_dir, self._loop.retention
                )
                published_initial, latest = True, 0
            state = TrainerState(0, latest)
            save_checkpoint(self._root, self._engine, CheckpointState(0, latest), self._work_dir)
        if rolled_back:
            logger.warning("resumed at step %d: ledger steps %s rolled back, their shards will be trained again",
                           state.step, rolled_back)
        self._state = state
        return StartReport(
            state=state,
            resumed_from=None if checkpoint is None else checkpoint.step,
            rolled_back=tuple(rolled_back),
            published_initial=published_initial,
        )

    def next_input(self) -> StepInput | None:
        """The next step's input, or None if fewer than B groups are waiting."""
        return self._source.next_input(self.state.step + 1, self._loop.batch_groups)

    def train_step(self, step_input: StepInput) -> dict[str, float]:
        """Record, train, publish and maybe checkpoint one step; return its metrics (the
        whole step's, on every rank). Collective: every rank passes the same input."""
        started = time.perf_counter()
        state = self.state
        step, version = state.step + 1, state.version + 1
        writer = self._engine.rank == 0
        if writer:
            self._ledger.record(step, step_input.shards)
            # After the entry: a kill in between leaves a recorded step whose shards are still
            # waiting; its checkpoint does not exist yet, so the next start rolls it back.
            self._source.consume(step_input.shards)
        barrier()
        self._source.forget(step_input.shards)
        result = run_rl_step(
            self._engine, step_input.groups, self._rl, state.step, updates_of=self._updates, reference=self._reference
        )

        figures = {
            **result.metrics(self._rl.pass_k),
            "version": float(version),
            "shards": float(len(step_input.shards)),
            "wasted_tokens": float(stale_tokens(step_input, self._rl.max_staleness, state.step, self._updates)),
            "learning_rate": self._engine.learning_rate(),
        }
        publish_started = time.perf_counter()
        # The step's figures travel with its weights: a run whose trainer is on another
        # machine logs them from here (asyncrl.tasks.tracking.lineage_recorder).
        lineage = step_lineage(state, self._run_id, step_input.shards, figures)
        publish_weights(self._store, self._engine, version, lineage, self._work_dir, self._loop.retention)
        if writer:
            self._weights_bell.ring()  # the scheduler loads it at once
        barrier()
        self._state = TrainerState(step, version)
        publish_time = time.perf_counter() - publish_started

        checkpoint_time = 0.0
        if step % self._loop.checkpoint_every == 0:
            checkpoint_started = time.perf_counter()
            save_checkpoint(self._root, self._engine, CheckpointState(step, version), self._work_dir)
            if writer:
                prune_checkpoints(self._root, self._loop.keep_checkpoints)
            checkpoint_time = time.perf_counter() - checkpoint_started
        metrics = {
            **figures,
            "publish_time_s": publish_time,
            "checkpoint_time_s": checkpoint_time,
            "step_time_s": time.perf_counter() - started,
        }
        if writer:
            self._metrics.log(step, metrics)
        return metrics

    def _poll(self, should_stop: Callable[[], bool] | None, waiting_since: float | None) -> tuple[str, StepInput | None]:
        """Rank 0's look at the run root: ("stop", None), ("train", input) or ("wait", None);
        :class:`TrainerWaitTimeout` once the wait for one batch exceeds the timeout."""
        if should_stop is not None and should_stop():
            return "stop", None
        step_input = self.next_input()
        if step_input is not None:
            return "train", step_input
        timeout = self._loop.wait_timeout_s
        if timeout is not None and waiting_since is not None and time.monotonic() - waiting_since > timeout:
            raise TrainerWaitTimeout(
                f"waited {timeout:g} s for {self._loop.batch_groups} prompt groups of run "
                f"{self._run_id!r} in {self._root.uri}; "
                f"{self._source.waiting_groups()} unconsumed"
            )
        return "wait", None

    def run(self, should_stop: Callable[[], bool] | None = None) -> TrainerState:
        """Train until ``max_steps`` steps are done (or ``should_stop()``), waiting for data:
        a wait ends when the scheduler rings the shards doorbell, or after ``poll_interval_s``.

        With several ranks, rank 0 polls (and alone calls ``should_stop``) and broadcasts
        each outcome, including an exception such as :class:`TrainerWaitTimeout`, which
        every rank then raises; the other ranks wait in that broadcast, at most one poll
        interval at a time."""
        if self._state is None:
            self.start()
        listens = self._engine.rank == 0
        with DoorbellListener(self._root, SHARDS_TOPIC) if listens else contextlib.nullcontext() as shards_bell:
            waiting_since: float | None = None
            while self.state.step < self._loop.max_steps:
                action, step_input = broadcast_from_rank0(lambda: self._poll(should_stop, waiting_since))
                if action == "stop":
                    break
                if step_input is None:
                    waiting_since = waiting_since or time.monotonic()
                    if shards_bell is not None:
                        shards_bell.wait(self._loop.poll_interval_s)
                    continue
                waiting_since = None
                self.train_step(step_input)
        return self.state
