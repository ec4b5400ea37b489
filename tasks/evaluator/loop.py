"""The evaluator's work, from its start to its end:

1. Resume: nothing at or below the newest version recorded in ``evaluations/`` is evaluated
   again; the state is written at once, so retention keeps what it will load.
2. Pick (:func:`~asyncrl.tasks.evaluator.schedule.pick_version`) the newest published multiple
   of K = ``pipeline.eval_every`` above the last one taken; wait, or end after the last step.
3. Evaluate: load it into the evaluator's own vLLM server (started at the first pick) and
   score the held-out subset with its own reward pool.
4. Record the result (put-if-absent: never twice), move the state on, back to 2.

A stop abandons the version in evaluation unrecorded (a restart picks the newest multiple
again). Details: ``docs/internals/evaluator.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from asyncrl.configs.processes import EvaluatorProcessConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.evaluator.schedule import pick_version
from asyncrl.tasks.reward.pool import RewardPool
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.server import RolloutServer, RolloutServerHandle
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
from asyncrl.tasks.placement.launch_settings import evaluator_server_config, server_start_dir
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.storage.evaluations import EvalResult
from asyncrl.tasks.evaluator.held_out import HeldOutTask, held_out_task
from asyncrl.storage.weights import final_step_published

LOG = logging.getLogger("asyncrl.evaluator")
T = TypeVar("T")


class Evaluator:
    """Steps 1, 2 and 4 of the module docstring over one run root, and the loop of step 3
    (:meth:`evaluate_versions`); :func:`serve` runs it all."""

    def __init__(self, config: EvaluatorProcessConfig, paths: RunPaths, stop: threading.Event, poll_s: float = 1.0) -> None:
        if config.pipeline.eval_every < 1:
            raise ValueError(f"pipeline.eval_every: {config.pipeline.eval_every}; the evaluator needs it >= 1")
        self.config = config
        self.paths = paths
        self.stop = stop
        self.poll_s = poll_s
        self.records = EvaluationStore(paths.root)
        self.weights = WeightStore(paths.root)
        done = max(self.records.versions(), default=-1)
        self.after = done
        """Versions at or below this are done or were passed over."""
        self.skipped: list[int] = []
        """Versions passed over since the last record."""
        self.state = EvaluatorState(config.pipeline.eval_every, done)
        self.records.set_state(self.state)
        LOG.info("evaluating every %d versions; %s", self.state.every,
                 f"resuming after version {done}" if done >= 0 else "no version evaluated yet")  # fmt: skip

    def _available(self, version: int) -> bool:
        """Published and not pruned; version 0 always is (the lowest version is never pruned,
        and without one ``model.path`` is version 0)."""
        return version == 0 or fs.exists(self.paths.root, paths.weights_complete_marker(version))

    def next_version(self) -> int | None:
        """Step 2: the next version to evaluate (recorded as ``current`` in the state); None
        once the run's last step is published and nothing is left, or when stopped."""
        max_steps = self.config.trainer.max_steps
        while not self.stop.is_set():
            finished = final_step_published(self.paths.root, max_steps)  # before LATEST: then it covers the end
            pick = pick_version(self.after, self.weights.latest() or 0, self.state.every, self._available)
            self.after = pick.newest if pick.newest is not None else self.after
            if pick.skipped:
                LOG.info("skipping versions %s: evaluation fell behind (or they are no longer published)",
                         list(pick.skipped))  # fmt: skip
                self.skipped.extend(pick.skipped)
            if pick.target is not None:
                self._set_state(current=pick.target)
                return pick.target
            if finished:
                LOG.info("the run's last step (%d) is published and every version up to it is decided: done", max_steps)
                return None
            self.stop.wait(self.poll_s)
        return None

    def model_dir(self, version: int) -> Path:
        """The directory its server starts from to serve ``version`` (:func:`server_start_dir`:
        the version's weights, cached in :attr:`cache_dir`, or a LoRA run's base model)."""
        return server_start_dir(self.config, self.paths, version, self.cache_dir)

    @property
    def cache_dir(self) -> Path:
        """Its own weight cache: the rollout servers prune theirs after each load (older
        versions first), which would pull an older version from under the evaluator."""
        return self.paths.work_dir / "evaluator-weights-cache"

    async def evaluate_versions(
        self, handle: RolloutServerHandle, first: int, task: HeldOutTask, pool: RewardPool
    ) -> None:
        """Step 3 and 4 from ``first`` (the weights the server holds), then every next pick
        loaded in place, until the end or a stop."""
        storage = self.config.storage
        version: int | None = first
        adapters = self.config.trainer.lora is not None  # the server started on the base model
        with ServerWeightLoader(storage.root, storage.options, str(self.cache_dir), adapters=adapters) as loader:
            if adapters:
                await asyncio.to_thread(loader.load, handle, first)
            async with RolloutClient([handle], initial_version=first, adapters=adapters) as client:
                while version is not None:
                    started = time.monotonic()
                    if version != client.current_version:
                        await client.update_weights(version, loader.for_version(version))
                    result = await self._unless_stopped(task.run(client, version, pool), version)
                    if result is None:
                        return
                    self._record(result, time.monotonic() - started)
                    version = await asyncio.to_thread(self.next_version)

    async def _unless_stopped(self, work: Awaitable[T], version: int) -> T | None:
        """``work``'s result, or None (it is cancelled) once the stop is set."""
        running = asyncio.ensure_future(work)
        while not running.done():
            await asyncio.wait({running}, timeout=self.poll_s)
            if self.stop.is_set() and not running.done():
                running.cancel()
                LOG.warning("stopped while evaluating version %d: its evaluation is abandoned", version)
                return None
        return running.result()

    def _record(self, result: EvalResult, seconds: float) -> None:
        """Step 4: the record (the result, its wall time, the versions skipped since the
        last one), then the state."""
        record = {**dataclasses.asdict(result), "wall_s": seconds, "skipped": self.skipped, "evaluated_at": time.time()}
        if not self.records.write(result.version, record):
            LOG.warning("version %d has a record already; it is kept", result.version)
        LOG.info("version %d: held-out pass@1 %.3f (%d prompts x %d samples) in %.1f s", result.version,
                 result.pass_at_1, result.prompts, result.samples_per_prompt, seconds)  # fmt: skip
        self.skipped = []
        self._set_state(done=result.version, current=None)

    def _set_state(self, **changes: int | None) -> None:
        self.state = dataclasses.replace(self.state, **changes)
        self.records.set_state(self.state)


def serve(config: EvaluatorProcessConfig, paths: RunPaths, stop: threading.Event) -> None:
    """The evaluator until the end of the run or a stop (see the module docstring). Its server
    is stopped on the way out, whatever ends it."""
    settings = config.pipeline.training_eval
    evaluator = Evaluator(config, paths, stop)
    first = evaluator.next_version()
    if first is None:
        return
    model_dir = evaluator.model_dir(first)
    server = RolloutServer(evaluator_server_config(config, paths, model_dir))
    server.start()  # from this (the main) thread: the server dies with it
    try:
        task = held_out_task(config, model_dir, settings.prompts, settings.samples)
        with RewardPool(config.reward, workers=settings.reward_workers) as pool:  # starts while vLLM loads
            LOG.info("server %s starting on version %d (log %s)", server.handle.url, first, server.handle.log_path)
            waited = server.wait_healthy(stop=stop)
            if stop.is_set():
                LOG.warning("stopped while its server started: the evaluation of version %d is abandoned", first)
                return
            LOG.info("server up in %.0f s; %d held-out prompts x %d samples per version", waited,
                     len(task.prompts), task.samples_per_prompt)  # fmt: skip
            asyncio.run(evaluator.evaluate_versions(server.handle, first, task, pool))
    finally:
        server.stop()
