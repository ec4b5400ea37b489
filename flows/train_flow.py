"""The `train` flow: rollout servers, reward pool, trainer and scheduler run together as
long-lived concurrent tasks until the trainer has done `trainer.max_steps` steps.

If any component fails, the others are stopped (process groups killed) and the run
fails with that component's error; a cancelled run leaves no process behind (every
supervisor kills its process group in a `finally`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from prefect import flow, get_run_logger

from asyncrl.configs.loading import public_dict
from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.lineage_recorder import LineageRecorder, file_ref
from asyncrl.flows.run_artifacts import StepProgressArtifact, publish_training_report
from asyncrl.flows.run_setup import prepare_run

# load_codec is imported from here by the pipeline flow and the e2e benchmark.
from asyncrl.flows.run_components import (
    load_codec,
    rl_trainer_launch,
    run_scheduler,
    server_configs,
    serving_weights,
)
from asyncrl.storage.lineage import RunLineage
from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.reward.pool import RewardPool
from asyncrl.tasks.rollout.prefect_tasks import supervise_rollout_server
from asyncrl.tasks.rollout.server import RolloutServerHandle
from asyncrl.tasks.trainer.process import supervise_trainer

__all__ = ["ComponentFailed", "RunSupervisor", "TrainResult", "load_codec", "train", "train_run"]


class ComponentFailed(RuntimeError):
    """A component of the run failed; the message names it and carries its error."""


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_version: int
    wall_s: float
    mlflow_run_id: str
    logged_models: dict[int, str]
    scheduler: dict[str, float]
    step_metrics: dict[int, dict[str, float]]
    """The trainer's metrics of each step (reward, staleness, throughput, ...)."""
    ready_at: float = 0.0
    """Unix time at which every rollout server was healthy and the scheduler started: the
    start of the RL phase (the step metrics' ``time`` is on the same clock)."""


class RunSupervisor:
    """Runs the components in threads; the first failure stops all of them."""

    def __init__(self, max_workers: int) -> None:
        self.stop = threading.Event()
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="asyncrl")
        self.futures: dict[Future[Any], str] = {}

    def start(self, name: str, work: Callable[[], Any]) -> Future[Any]:
        future = self.executor.submit(work)
        self.futures[future] = name
        return future

    def raise_first_failure(self) -> None:
        for future, name in self.futures.items():
            if future.done() and future.exception() is not None and not self.stop.is_set():
                raise ComponentFailed(f"{name} failed: {future.exception()}") from future.exception()

    def wait_any_failure(self, until: Future[Any], poll_s: float = 1.0, on_poll: Callable[[], None] | None = None) -> Any:
        """Wait for `until`; raise as soon as any component fails."""
        while True:
            wait(list(self.futures), timeout=poll_s, return_when=FIRST_EXCEPTION)
            for future, name in self.futures.items():
                if future.done() and future.exception() is not None:
                    raise ComponentFailed(f"{name} failed: {future.exception()}") from future.exception()
            if on_poll is not None:
                on_poll()
            if until.done():
                return until.result()

    def shutdown(self) -> None:
        self.stop.set()
        self.executor.shutdown(wait=True, cancel_futures=True)


def train_run(config: RunConfig, lineage: RunLineage | None = None, progress: Callable[[int, int], None] | None = None) -> TrainResult:
    """The whole asynchronous RL run, as plain Python (the flow below wraps it)."""
    started = time.monotonic()
    paths = prepare_run(config)
    prompts = load_prompts(config.data.train_path)
    lineage = lineage or RunLineage.start(
        config.tracking.mlflow_uri, config.tracking.experiment, config.name, public_dict(config)
    )
    lineage.log_dataset(file_ref(config.data.train_path, Path(config.data.train_path).name))
    launch = rl_trainer_launch(config, paths)
    recorder = LineageRecorder(lineage, paths.root, cast(Path, launch.metrics_file))  # always set for RL
    supervisor = RunSupervisor(max_workers=config.rollout.num_servers + 3)
    handles: list[RolloutServerHandle | None] = [None] * config.rollout.num_servers
    ready = [threading.Event() for _ in handles]
    try:
        with RewardPool(config.reward) as pool:
            model_dir, initial_version = serving_weights(config, paths)
            for index, server_config in enumerate(server_configs(config, paths, model_dir)):
                def on_ready(handle: RolloutServerHandle, index: int = index) -> None:
                    handles[index] = handle
                    ready[index].set()

                supervisor.start(
                    f"rollout server {index}",
                    lambda c=server_config, i=index, cb=on_ready: supervise_rollout_server(
                        c, config.storage.root, config.storage.options, f"server-{i}",
                        poll_interval_s=2.0, stop=supervisor.stop, on_ready=cb,
                    ),
                )
            trainer = supervisor.start("trainer", lambda: supervise_trainer(launch, stop=supervisor.stop))
            while not all(event.is_set() for event in ready):
                supervisor.raise_first_failure()
                time.sleep(0.5)
            ready_at = time.time()
            supervisor.start(
                "scheduler",
                lambda: run_scheduler(
                    config, paths, [h for h in handles if h is not None], pool, prompts, supervisor.stop, initial_version
                ),
            )

            reported = [0]

            def poll() -> None:
                recorder.poll()
                step = max(recorder.metrics_by_step, default=0)
                if progress is not None and step > reported[0]:
                    reported[0] = step
                    progress(step, config.trainer.max_steps)

            supervisor.wait_any_failure(trainer, on_poll=poll)
            poll()  # the last step's metrics and version
    except BaseException as exc:
        # A cancelled run (Prefect's SIGTERM -> TerminationSignal) or Ctrl-C is KILLED, not FAILED.
        lineage.end("FAILED" if isinstance(exc, Exception) else "KILLED")
        raise
    finally:
        supervisor.shutdown()
    scheduler_stats = next(
        (f.result().summary() for f, name in supervisor.futures.items() if name == "scheduler" and f.exception() is None),
        {},
    )
    lineage.log_metrics(config.trainer.max_steps, {f"rollout_{k}": v for k, v in scheduler_stats.items()})
    lineage.end()
    final_version = max(recorder.logged_versions) if recorder.logged_versions else 0
    return TrainResult(
        steps=max(recorder.metrics_by_step) if recorder.metrics_by_step else 0,
        final_version=final_version,
        wall_s=time.monotonic() - started,
        mlflow_run_id=lineage.run_id,
        logged_models=dict(recorder.logged_versions),
        scheduler=scheduler_stats,
        step_metrics=dict(recorder.metrics_by_step),
        ready_at=ready_at,
    )


@flow(name="train", log_prints=True)
def train(config: RunConfig) -> dict[str, Any]:
    """Asynchronous RL: rollout servers, reward pool, trainer and scheduler until
    `trainer.max_steps` steps are trained. Parameters are the validated run config."""
    logger = get_run_logger()
    progress_artifact = StepProgressArtifact(config.name, config.trainer.max_steps)

    def progress(step: int, total: int) -> None:
        logger.info("step %d/%d", step, total)
        progress_artifact(step, total)

    result = train_run(config, progress=progress)
    logger.info("trained %d steps to version %d in %.0f s", result.steps, result.final_version, result.wall_s)
    publish_training_report(config.name, result.step_metrics, result.scheduler, result.wall_s, result.final_version)
    return {
        "steps": result.steps,
        "final_version": result.final_version,
        "wall_s": result.wall_s,
        "mlflow_run_id": result.mlflow_run_id,
    }
