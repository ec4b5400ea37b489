"""The `train` flow: asynchronous RL with every component as a concurrent Prefect run —
task runs `rollout-server-{k}`, `reward-service`, `trainer` and (with
``pipeline.eval_every``) `evaluator`, and the `scheduler` child flow run — each supervised
and restarted on a crash (:mod:`asyncrl.tasks.launch.rl`). A component that ``placement``
puts on a deployment runs as flow runs of the `component` flow on that deployment's work
pool (:mod:`asyncrl.flows.prefect_api.remote_component`).

States tell the truth: Running while up, Failed past the restart budget (the others are
then Cancelled and the flow fails naming the component; only the evaluator's failure is a
warning), Completed on a normal end. Cancelling the flow run stops every component, and its
hooks kill whatever process groups are still recorded. Details: ``docs/internals/flows.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, wait

from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.scheduler import scheduler
from asyncrl.flows.prefect_api.artifacts import StepProgressArtifact, publish_training_report
from asyncrl.flows.prefect_api.events import prefect_alarm, prefect_fleet_change
from asyncrl.flows.prefect_api.remote_component import remote_components
from asyncrl.tasks.launch.context import RunContext, open_run_context, system_metrics
from asyncrl.tasks.launch.kinds import ComponentKind
from asyncrl.tasks.launch.rl import (
    RLRunSettings,
    RunStop,
    TrainResult,
    restart_policy,
    run_rl,
)
from asyncrl.tasks.pipeline.progress import StageProgress
from asyncrl.tasks.tracking.run_report import log_run_report
from asyncrl.tasks.pipeline.stages import eval_results_to_json
from asyncrl.flows.prefect_api.prefect_reporting import event_reporter, kill_run_processes, outcome_state
from asyncrl.tasks.launch.supervisor import ComponentOutcome


@task(cache_policy=NO_CACHE)
def component(work: Callable[[], ComponentOutcome], stop: RunStop) -> Any:  # noqa: ANN401 - a dict or a State
    """One component for the life of the run (named per component by :class:`PrefectRunner`)."""
    return outcome_state(work(), stop)


@task(name="scheduler", cache_policy=NO_CACHE)
def scheduler_child(config: RunConfig, work: Callable[[], ComponentOutcome], stop: RunStop) -> Any:  # noqa: ANN401
    """Runs the `scheduler` flow as a child flow run beside the other components; this task
    run takes the child's final state (Cancelled when the run stopped it for a cancel or a
    failure elsewhere, not Failed)."""
    return scheduler.with_options(flow_run_name=f"{config.name}-scheduler")(config, work=work, stop=stop, return_state=True)


class PrefectRunner:
    """Submits each component's supervision as a task run named after it; the scheduler's as
    the `scheduler` child flow."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.futures: list[PrefectFuture[Any]] = []

    def __call__(self, name: str, kind: ComponentKind, work: Callable[[], ComponentOutcome], stop: RunStop) -> None:
        if kind == "scheduler":
            submitted = scheduler_child.with_options(task_run_name="scheduler").submit(self.config, work, stop)
        else:
            submitted = component.with_options(name=kind, task_run_name=name).submit(work, stop)
        self.futures.append(submitted)


def run_train(
    config: RunConfig, context: RunContext, progress: Callable[[int, int, dict[str, float]], None] | None = None
) -> TrainResult:
    """The RL phase with one Prefect run per component (must run inside a flow)."""
    runner = PrefectRunner(config)
    settings = RLRunSettings(restart_policy(config), remote=remote_components(context.paths))
    try:
        return run_rl(config, context.paths, settings, runner, context=context, on_event=event_reporter(config.name), progress=progress,
                      on_canary=prefect_alarm(config.name), run_logger=get_run_logger(),
                      on_fleet=prefect_fleet_change(config.name))  # fmt: skip
    finally:
        wait(runner.futures)


@flow(name="train", log_prints=True, on_cancellation=[kill_run_processes], on_crashed=[kill_run_processes])
def train(config: RunConfig, mlflow_owned: bool = True) -> dict[str, Any]:
    """Asynchronous RL until `trainer.max_steps` steps are trained; resumes a run root that
    has steps already. ``mlflow_owned``: end the run's MLflow run with the flow (the pipeline
    passes False: it owns the MLflow run and ends it after evaluation)."""
    logger = get_run_logger()
    apply_storage_credentials(config.storage)
    context = open_run_context(config)
    artifact = StepProgressArtifact(config.name, config.trainer.max_steps)
    stage = StageProgress(context.paths.work_dir, "train", config.trainer.max_steps, "steps")

    def progress(step: int, total: int, metrics: dict[str, float]) -> None:
        reward = metrics.get("reward_mean", float("nan"))
        logger.info("RL step %d/%d: reward %.3f", step, total, reward)
        artifact(step, total)
        stage.update(step, f"reward {reward:.3f}")

    try:
        # The pipeline that runs this flow records the system metrics and the plots itself.
        with system_metrics(context) if mlflow_owned else nullcontext():
            result = run_train(config, context, progress)
        if mlflow_owned:
            log_run_report(context.lineage, config.name)
    except BaseException as exc:
        # A cancelled run (Prefect's SIGTERM -> TerminationSignal) or Ctrl-C is KILLED, not FAILED.
        context.lineage.end("FAILED" if isinstance(exc, Exception) else "KILLED")
        raise
    stage.finish(f"{result.steps} steps, weight version {result.final_version}")
    if mlflow_owned:
        context.lineage.end()
    logger.info("trained %d steps to version %d in %.0f s; restarts: %s", result.steps, result.final_version,
                result.wall_s, result.restarts)  # fmt: skip
    publish_training_report(config.name, result.step_metrics, result.scheduler, result.wall_s, result.final_version,
                            result.evaluations, result.optional_failures.get("evaluator"), result.overlap)  # fmt: skip
    return {
        "steps": result.steps,
        "final_version": result.final_version,
        "wall_s": result.wall_s,
        "mlflow_run_id": result.mlflow_run_id,
        "logged_models": {str(k): v for k, v in result.logged_models.items()},
        "restarts": result.restarts,
        "scheduler": result.scheduler,
        "evaluations": eval_results_to_json(result.evaluations),
        "optional_failures": result.optional_failures,
        "overlap": result.overlap,
    }

