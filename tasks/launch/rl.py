"""The asynchronous RL phase of a run as plain Python: every component (rollout servers,
reward service, trainer, scheduler, and with ``pipeline.eval_every`` the evaluator) under
its own :func:`~asyncrl.tasks.launch.supervisor.supervise`, started through a
:class:`ComponentRunner`: plain threads here and in `asyncrl chaos`, one Prefect task run
each (the scheduler as a child flow run) in the `train` flow.

The run ends when the trainer has trained ``trainer.max_steps`` steps (and the drain and the
evaluator are done); then every component is stopped. A component failing past its restart
budget stops the others and its :class:`~asyncrl.tasks.launch.supervisor.ComponentFailed`
is raised; every process group is killed on the way out. Only the evaluator (:data:`OPTIONAL`)
fails with a warning: training is not lost because evaluation failed.
See ``docs/internals/launch.md``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.evaluations import EvaluationStore
from asyncrl.tasks.data.train_files import choose_train_files, load_train_prompts
from asyncrl.tasks.system.process_group import group_alive
from asyncrl.tasks.reward.service_registry import TOKEN_ENV
from asyncrl.tasks.launch.components import (
    Component,
    evaluator_component,
    reward_component,
    run_rollout_component,
    scheduler_component,
    sigkill_group,
    trainer_component,
)
from asyncrl.tasks.launch.bound_watch import METRIC as BOUND_METRIC
from asyncrl.tasks.launch.bound_watch import EffectiveBoundWatch
from asyncrl.tasks.launch.canary import CanaryAlarm, MismatchCanary, log_alarm
from asyncrl.tasks.launch.fleet import METRIC as FLEET_METRIC
from asyncrl.tasks.launch.fleet import FleetChange, FleetWatch
from asyncrl.tasks.placement.launch_settings import trainer_launch
from asyncrl.tasks.launch.context import RunContext, open_run_context
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.tasks.launch.kinds import ComponentKind
from asyncrl.storage.evaluations import EvalResult
from asyncrl.tasks.tracking.lineage_recorder import BackgroundPoller, LineageRecorder, read_evaluations
from asyncrl.tasks.tracking.train_history import train_datasets
from asyncrl.tasks.launch.supervisor import (
    ComponentEvent,
    ComponentFailed,
    ComponentOutcome,
    ComponentStatus,
    RestartPolicy,
    supervise,
)
from asyncrl.tasks.scheduler.cycle_stats import CYCLE_STATS_FILE, combine_cycle_stats, read_cycle_stats
from asyncrl.tasks.algo.overlap import overlap_figures, phase_steps, rl_phase_wall_s, training_busy_s
from asyncrl.storage.weights import final_step_published

LOG = logging.getLogger("asyncrl.run")
PROCESS_GROUPS_FILE = "process-groups.json"
METRICS_FILE = "trainer-metrics.jsonl"
"""The trainer's step metrics in the run's work directory (one JSON line a step)."""
OPTIONAL = frozenset({"evaluator"})
"""Components whose failure past their restart budget does not fail the run."""
ENDS_ON_ITS_OWN = frozenset({"trainer", "scheduler", "evaluator"})
"""Components whose supervision may end before the run does (their normal end)."""


class RunStop:
    """The run's one stop signal, with why it was given: ``finished`` (a normal end: the
    components that were stopped are Completed) or anything else (they are Cancelled)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = "finished"

    def request(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()

    @property
    def cancelled(self) -> bool:
        return self.event.is_set() and self.reason != "finished"


class ComponentRunner(Protocol):
    """Starts ``work`` (one component's supervision) concurrently and returns at once."""

    def __call__(self, name: str, kind: ComponentKind, work: Callable[[], ComponentOutcome], stop: RunStop) -> None: ...


def thread_runner(name: str, kind: ComponentKind, work: Callable[[], ComponentOutcome], stop: RunStop) -> None:
    """A thread per component (`asyncrl chaos`, benchmarks); the run waits on its futures."""
    threading.Thread(target=work, name=f"asyncrl-{name}", daemon=True).start()


class ProcessGroupFile:
    """The live components' process groups, in ``process-groups.json`` of the run's work
    directory, so that a flow's cancel or crash hook (which runs in the worker after the flow
    process is gone) can kill them: :func:`kill_recorded_groups`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._groups: dict[str, int] = {}

    def update(self, name: str, pgid: int | None) -> None:
        with self._lock:
            if pgid is None or pgid <= 0:
                self._groups.pop(name, None)
            else:
                self._groups[name] = pgid
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._groups))
            tmp.replace(self.path)


def kill_recorded_groups(work_dir: Path, file_name: str = PROCESS_GROUPS_FILE) -> list[int]:
    """SIGKILL every process group recorded in ``work_dir``'s ``file_name`` (a
    :class:`ProcessGroupFile`) that still exists; return those killed."""
    path = work_dir / file_name
    try:
        groups = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    killed = []
    for pgid in set(groups.values()):
        if isinstance(pgid, int) and pgid > 0 and group_alive(pgid):
            sigkill_group(pgid)
            killed.append(pgid)
    return killed


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_version: int
    wall_s: float
    mlflow_run_id: str | None
    logged_models: dict[int, str]
    scheduler: dict[str, float]
    """The scheduler's figures over all its cycles (:func:`combine_cycle_stats`)."""
    step_metrics: dict[int, dict[str, float]]
    """The trainer's metrics of each step (reward, staleness, throughput, ...)."""
    restarts: dict[str, int]
    """Restarts per component name."""
    ready_at: float = 0.0
    """Unix time at which every rollout server was ready: the start of the RL phase (the step
    metrics' ``time`` is on the same clock)."""
    evaluations: dict[int, EvalResult] = field(default_factory=dict)
    """Evaluation during training: weight version -> its held-out result (``evaluations/``)."""
    optional_failures: dict[str, str] = field(default_factory=dict)
    """Optional components (:data:`OPTIONAL`) that failed past their restarts -> why."""
    overlap: dict[str, float] = field(default_factory=dict)
    """What asynchrony bought this RL phase (:func:`~asyncrl.tasks.algo.overlap.overlap_figures`):
    ``generation_busy_s``, ``training_busy_s``, ``rl_wall_s`` and ``overlap_factor`` =
    (generation busy + training busy) / RL wall time; see :func:`_phase_overlap`."""


@dataclass
class RLRunSettings:
    policy: RestartPolicy
    drain: bool = False
    """Wait until the scheduler has written every admitted group (chaos audits need it)."""
    remote: RemoteFactory | None = None
    """Makes the components that ``config.placement`` puts on other machines (the train flow's
    Prefect deployments); None: every component must be local."""
    drain_timeout_s: float = 300.0
    poll_s: float = 0.5


def restart_policy(config: RunConfig) -> RestartPolicy:
    """The supervisor's policy from the config's ``run`` section."""
    run = config.run
    return RestartPolicy(
        max_restarts=run.max_restarts, backoff_s=run.restart_backoff_s, start_timeout_s=run.component_start_timeout_s
    )


class RemoteFactory(Protocol):
    """Makes component ``kind`` (replica ``index``) of a run on another machine."""

    def __call__(
        self, config: RunConfig, paths: RunPaths, kind: ComponentKind, index: int, drain: bool, stop: RunStop | None
    ) -> Component: ...


def run_components(
    config: RunConfig, paths: RunPaths, drain: bool, stop: RunStop | None = None, remote: RemoteFactory | None = None
) -> list[tuple[ComponentKind, Component]]:
    """The run's components in start order: servers, reward service, trainer, scheduler, each
    local or remote (made by ``remote``) as ``config.placement`` says. The local reward
    service and scheduler share a token (``ASYNCRL_REWARD_TOKEN`` if set, else a fresh one
    per run); a remote scheduler runs with its own reward service, so there is none here.
    ``stop``: the run's stop signal (a remote component stopped by a finished run ends
    Completed, by a cancelled or failed one Cancelled)."""
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    placement = config.placement
    remote_scheduler = placement.scheduler != "local"
    placed_remotely = [k for k in ("rollout_server", "trainer", "scheduler") if getattr(placement, k) != "local"]
    if placed_remotely and remote is None:
        raise ValueError(
            f"placement.{placed_remotely[0]}: a component on another machine runs only under the train flow "
            "(asyncrl run, or a Prefect deployment); set it to local here"
        )
    components: list[tuple[ComponentKind, Component]] = [
        ("rollout-server", remote(config, paths, "rollout-server", i, drain, stop)
         if placement.rollout_server != "local" else run_rollout_component(i, config, paths))
        for i in range(config.inference.num_servers)
    ]  # fmt: skip
    if not remote_scheduler:
        components.append(("reward-service", reward_component(paths, token)))
    components.append(
        ("trainer", remote(config, paths, "trainer", 0, drain, stop) if placement.trainer != "local"
         else trainer_component(trainer_launch(config, paths)))
    )  # fmt: skip
    components.append(
        ("scheduler", remote(config, paths, "scheduler", 0, drain, stop) if remote_scheduler
         else scheduler_component(config, paths, drain=drain, reward_token=token))
    )  # fmt: skip
    if config.pipeline.eval_every:
        components.append(("evaluator", evaluator_component(config, paths)))  # always local, on its own server
    return components




def run_rl(
    config: RunConfig,
    paths: RunPaths,
    settings: RLRunSettings,
    runner: ComponentRunner,
    context: RunContext | None = None,
    on_event: Callable[[ComponentEvent], None] | None = None,
    progress: Callable[[int, int, dict[str, float]], None] | None = None,
    tick: Callable[[dict[str, ComponentStatus]], None] | None = None,
    on_canary: Callable[[CanaryAlarm], None] = log_alarm,
    run_logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
    on_fleet: Callable[[FleetChange], None] | None = None,
) -> TrainResult:
    """The RL phase (see the module docstring). ``context`` gives the MLflow run that the
    steps, versions and restarts are logged to (None: no MLflow, as in chaos); ``tick`` is
    called each poll with the components' statuses (the chaos kill plan); ``on_canary``
    gets the mismatch canary's alarms (:mod:`~asyncrl.tasks.launch.canary`; checked on the
    steps the MLflow recorder reads, so not without ``context``); ``run_logger`` (the flow
    run's logger; default this module's) gets the changes of an adaptive staleness bound
    (:mod:`~asyncrl.tasks.launch.bound_watch`, also logged to MLflow, so not without ``context``)
    and the changes of the registered rollout servers, which ``on_fleet`` also gets
    (:mod:`~asyncrl.tasks.launch.fleet`: servers joining and leaving the running run)."""
    started = time.monotonic()
    if config.data.train_folder:  # kept if the pipeline chose them; a train run of its own takes every file
        choose_train_files(config.data, config.seed, paths.root, earlier=frozenset)
    # a bad data file fails before anything starts
    prompts = load_train_prompts(config.data, paths.root, plugins=config.reward.plugins)
    if not prompts:
        raise ValueError(f"{config.data.train_path}: no prompts")
    recorder = None
    if context is not None:
        datasets = train_datasets(config.data, paths.root)  # a folder's chosen files, a mixture and its sources
        for ref in datasets:
            context.lineage.log_dataset(ref)
        recorder = LineageRecorder(context.lineage, paths.root, paths.work_dir / METRICS_FILE, datasets,
                                   follow_evaluations=config.pipeline.eval_every > 0)  # fmt: skip
        recorder.adopt_logged_versions()
    if final_step_published(paths.root, config.trainer.max_steps):
        # A re-run of a finished run: nothing to train, no component to start.
        LOG.info("the run root already holds the weights of step %d: nothing to train", config.trainer.max_steps)
        if recorder is not None:
            recorder.poll()
        return _result(config, paths, recorder, {}, started, 0.0)
    groups = ProcessGroupFile(paths.work_dir / PROCESS_GROUPS_FILE)
    cycles_before = len(read_cycle_stats(paths.work_dir / CYCLE_STATS_FILE))  # earlier phases' (a resumed run)
    stop = RunStop()
    failures: dict[str, str] = {}
    statuses: dict[str, ComponentStatus] = {}
    futures: dict[str, Future[ComponentOutcome]] = {}

    def handle(event: ComponentEvent) -> None:
        groups.update(event.component, None if event.kind == "stopped" else event.pgid)
        if on_event is not None:
            on_event(event)
        elif event.kind in ("restarting", "failed"):
            LOG.warning("%s %s: %s", event.component, event.kind, event.detail)

    for kind, component in run_components(config, paths, settings.drain, stop, settings.remote):
        statuses[component.name] = ComponentStatus(component.name)
        futures[component.name] = _launch(runner, kind, component, stop, settings.policy, handle, statuses)
    ready_at = 0.0
    reported = 0
    canary = MismatchCanary(config.tracking.mismatch_canary, on_canary)
    bound_watch = None
    if context is not None and config.rollout.adaptive_staleness is not None:
        lineage = context.lineage
        bound_watch = EffectiveBoundWatch(paths.root, config.rollout.eta,
                                          lambda step, value: lineage.log_metrics(step, {BOUND_METRIC: value}),
                                          logger=run_logger or LOG)  # fmt: skip

    def log_fleet_size(step: int, size: float) -> None:
        if context is not None:
            context.lineage.log_metrics(step, {FLEET_METRIC: size})

    fleet = FleetWatch(paths.root, log_fleet_size, on_fleet, logger=run_logger or LOG)
    poller = BackgroundPoller(recorder.poll, settings.poll_s) if recorder is not None else None
    try:
        while True:
            _raise_first_failure(futures, stop, failures)
            if not ready_at and all(s.ready for n, s in statuses.items() if n.startswith("rollout-server")):
                ready_at = time.time()
            if recorder is not None and poller is not None:
                poller.check()
                canary.observe_new(recorder.metrics_by_step)
            if bound_watch is not None:
                bound_watch.check()
            fleet.check()
            if progress is not None:
                step, metrics = _last_step(paths.work_dir / METRICS_FILE, recorder)
                if step > reported:
                    reported = step
                    progress(step, config.trainer.max_steps, metrics)
            if tick is not None:
                tick(statuses)
            if futures["trainer"].done():
                _raise_first_failure(futures, stop, failures)  # the trainer may have failed since the check above
                if settings.drain:
                    _wait_drained(futures, settings, stop, failures)
                _wait_evaluator(futures, config.pipeline.training_eval.finish_timeout_s, settings.poll_s, stop, failures,
                                paths)  # fmt: skip
                break
            wait(list(futures.values()), timeout=settings.poll_s, return_when=FIRST_EXCEPTION)
        if recorder is not None and poller is not None:
            poller.finish()  # the last step's metrics and version
            canary.observe_new(recorder.metrics_by_step)
        if bound_watch is not None:
            bound_watch.check(force=True)
    except BaseException as exc:
        stop.request("cancelled" if not isinstance(exc, Exception) else f"failed: {exc}")
        raise
    finally:
        if poller is not None:
            poller.stop()
        stop.request("finished")
        wait(list(futures.values()), timeout=120.0)
        # Also when the run fails (a component past its budget): its restarts are then most wanted.
        restarts = {name: s.restarts for name, s in statuses.items()}
        if context is not None:
            _log_restarts(context, config.trainer.max_steps, restarts, failing=stop.cancelled)
    return _result(config, paths, recorder, restarts, started, ready_at, failures, cycles_before)


def _log_restarts(context: RunContext, step: int, restarts: dict[str, int], failing: bool) -> None:
    """``restarts/<component>`` into the run's MLflow run. On the way out of a failing run an
    MLflow error is only logged, so that it does not hide the run's own error."""
    try:
        context.lineage.log_metrics(step, {f"restarts/{k}": float(v) for k, v in restarts.items()})
    except Exception:
        if not failing:
            raise
        LOG.warning("the restarts were not logged to MLflow", exc_info=True)


def _result(
    config: RunConfig,
    paths: RunPaths,
    recorder: LineageRecorder | None,
    restarts: dict[str, int],
    started: float,
    ready_at: float,
    failures: dict[str, str] | None = None,
    cycles_before: int = 0,
) -> TrainResult:
    """The run's result from what it left: the recorder's versions, metrics and evaluations
    (without a recorder, the evaluations in the run root), the scheduler's cycle figures and
    the phase's overlap figures (:func:`_phase_overlap`; both logged to MLflow with the run's
    last step, the overlap only once the phase began: ``ready_at`` > 0)."""
    cycles = read_cycle_stats(paths.work_dir / CYCLE_STATS_FILE)
    scheduler_stats = combine_cycle_stats(cycles)
    if not scheduler_stats:
        LOG.warning("the scheduler recorded no cycle figures in %s", paths.work_dir / CYCLE_STATS_FILE)
    elif recorder is not None:
        recorder.lineage.log_metrics(config.trainer.max_steps, {f"rollout_{k}": v for k, v in scheduler_stats.items()})
    logged = dict(recorder.logged_versions) if recorder is not None else {}
    metrics = dict(recorder.metrics_by_step) if recorder is not None else {}
    overlap = _phase_overlap(cycles[cycles_before:], metrics or _file_metrics(paths.work_dir / METRICS_FILE), ready_at)
    if recorder is not None and ready_at > 0:
        recorder.lineage.log_metrics(config.trainer.max_steps, overlap)
    if ready_at > 0:
        LOG.info("RL phase: generation busy %.0f s, training busy %.0f s, wall %.0f s: overlap factor %.2f",
                 overlap["generation_busy_s"], overlap["training_busy_s"], overlap["rl_wall_s"],
                 overlap["overlap_factor"])  # fmt: skip
    if recorder is not None:
        evaluations = dict(recorder.evaluations)
    else:
        evaluations = read_evaluations(paths.root) if config.pipeline.eval_every else {}
    return TrainResult(
        steps=max(metrics) if metrics else _last_step(paths.work_dir / METRICS_FILE, None)[0],
        final_version=max(logged) if logged else _latest_version(paths),
        wall_s=time.monotonic() - started,
        mlflow_run_id=None if recorder is None else recorder.lineage.run_id,
        logged_models=logged,
        scheduler=scheduler_stats,
        step_metrics=metrics,
        restarts=restarts,
        ready_at=ready_at,
        evaluations=evaluations,
        optional_failures=dict(failures or {}),
        overlap=overlap,
    )


def _phase_overlap(
    cycles: list[dict[str, float]], step_metrics: dict[int, dict[str, float]], ready_at: float
) -> dict[str, float]:
    """The RL phase's :func:`~asyncrl.tasks.algo.overlap.overlap_figures`: generation busy =
    the ``generation_busy_s`` of the scheduler cycles this phase ran (``cycles``, summed by
    :func:`combine_cycle_stats` over the scheduler's restarts), training busy = the
    :func:`~asyncrl.tasks.algo.overlap.training_busy_s` of the steps this phase trained
    (:func:`~asyncrl.tasks.algo.overlap.phase_steps`), wall = from ``ready_at`` to the last of
    them (:func:`~asyncrl.tasks.algo.overlap.rl_phase_wall_s`). All zero when the phase never
    began (``ready_at`` <= 0)."""
    steps = phase_steps(step_metrics, ready_at)
    generation = combine_cycle_stats(cycles).get("generation_busy_s", 0.0) if ready_at > 0 else 0.0
    return overlap_figures(generation, training_busy_s(steps), rl_phase_wall_s(steps, ready_at))


def _file_metrics(metrics_file: Path) -> dict[int, dict[str, float]]:
    """The step metrics of the trainer's metrics file (a run without a recorder), by step."""
    from asyncrl.tasks.trainer.metrics import read_jsonl_metrics

    records = read_jsonl_metrics(metrics_file) if metrics_file.exists() else []
    return {
        int(r.get("step", 0) or 0): {k: float(v) for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
        for r in records
    }


def train_run(config: RunConfig, settings: RLRunSettings | None = None) -> TrainResult:
    """The RL phase outside Prefect (benchmarks): the run's context, its components in
    threads, the MLflow run ended with the outcome."""
    context = open_run_context(config)
    try:
        result = run_rl(config, context.paths, settings or RLRunSettings(restart_policy(config)), thread_runner,
                        context=context)  # fmt: skip
    except BaseException as exc:
        context.lineage.end("FAILED" if isinstance(exc, Exception) else "KILLED")
        raise
    context.lineage.end()
    return result


def _launch(
    runner: ComponentRunner,
    kind: ComponentKind,
    component: Component,
    stop: RunStop,
    policy: RestartPolicy,
    on_event: Callable[[ComponentEvent], None],
    statuses: dict[str, ComponentStatus],
) -> Future[ComponentOutcome]:
    """Hand the component's supervision to ``runner``; the returned future holds its outcome
    or its error (the run waits on these, whatever runs them)."""
    future: Future[ComponentOutcome] = Future()
    future.set_running_or_notify_cancel()

    def work() -> ComponentOutcome:
        try:
            outcome = supervise(component, stop.event, policy, on_event, statuses[component.name])
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.set_result(outcome)
        return outcome

    runner(component.name, kind, work, stop)
    return future


def _raise_first_failure(
    futures: dict[str, Future[ComponentOutcome]], stop: RunStop, failures: dict[str, str]
) -> None:
    """Raise the first component failure, except an optional component's (:data:`OPTIONAL`):
    that one is logged, kept in ``failures`` (name -> first line of the reason) and its
    future dropped, and the run goes on."""
    for name, future in list(futures.items()):
        if future.done() and future.exception() is not None:
            error = future.exception()
            if name in OPTIONAL:
                del futures[name]
                failures[name] = str(error).splitlines()[0]
                LOG.warning("%s failed; the run goes on without it: %s", name, error)
                continue
            if isinstance(error, ComponentFailed):
                raise error
            raise ComponentFailed(name, f"its supervisor raised {error!r}", 0, "") from error
        if future.done() and name not in ENDS_ON_ITS_OWN and not stop.event.is_set():
            raise ComponentFailed(name, "its supervisor ended while the run was going on", 0, "")


def _wait_drained(
    futures: dict[str, Future[ComponentOutcome]], settings: RLRunSettings, stop: RunStop, failures: dict[str, str]
) -> None:
    """The trainer is done: wait (bounded) for the scheduler to write every admitted group."""
    scheduler = futures["scheduler"]
    deadline = time.monotonic() + settings.drain_timeout_s
    while not scheduler.done():
        _raise_first_failure(futures, stop, failures)
        if time.monotonic() > deadline:
            raise ComponentFailed(
                "scheduler", f"did not drain within {settings.drain_timeout_s:.0f} s after the trainer finished", 0, ""
            )
        wait([scheduler], timeout=settings.poll_s)
    _raise_first_failure(futures, stop, failures)


def _wait_evaluator(
    futures: dict[str, Future[ComponentOutcome]],
    timeout_s: float,
    poll_s: float,
    stop: RunStop,
    failures: dict[str, str],
    paths: RunPaths,
) -> None:
    """The trainer is done: give the evaluator (if any, and alive) up to ``timeout_s`` to
    evaluate its last version and end on its own; past that the run stops it with the others,
    and a version it is evaluating then is abandoned (said here, from its state)."""
    deadline = time.monotonic() + timeout_s
    while "evaluator" in futures and not futures["evaluator"].done() and time.monotonic() < deadline:
        wait([futures["evaluator"]], timeout=min(poll_s, max(0.0, deadline - time.monotonic())))
        _raise_first_failure(futures, stop, failures)
    if "evaluator" not in futures or futures["evaluator"].done():
        return
    state = EvaluationStore(paths.root).state()
    if state is not None and state.current is not None:
        LOG.warning("the evaluator is stopped %.0f s after the last step (pipeline.training_eval.finish_timeout_s): "
                    "its evaluation of version %d is abandoned", timeout_s, state.current)  # fmt: skip
    else:
        LOG.info("the evaluator is stopped with the run: it was evaluating no version")


def _last_step(metrics_file: Path, recorder: LineageRecorder | None) -> tuple[int, dict[str, float]]:
    """The newest trainer step and its metrics (from the recorder, else the metrics file)."""
    if recorder is not None and recorder.metrics_by_step:
        step = max(recorder.metrics_by_step)
        return step, recorder.metrics_by_step[step]
    from asyncrl.tasks.trainer.metrics import read_jsonl_metrics

    records = read_jsonl_metrics(metrics_file) if metrics_file.exists() else []
    if not records:
        return 0, {}
    last = records[-1]
    return int(last.get("step", 0) or 0), {k: float(v) for k, v in last.items() if isinstance(v, (int, float))}


def _latest_version(paths: RunPaths) -> int:
    from asyncrl.storage.weights import WeightStore

    return cast(int, WeightStore(paths.root).latest() or 0)
