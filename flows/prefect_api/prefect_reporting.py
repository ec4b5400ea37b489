"""What the flows tell Prefect about a run's components: a log line and an event per
restart and failure, each component run's final state, and the hook that kills a cancelled
or crashed run's process groups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.events import emit_event
from prefect.states import Cancelled

from asyncrl.tasks.launch.component_host import hosted_groups_file
from asyncrl.flows.prefect_api.remote_component import cancel_flow_runs, read_remote_flow_runs
from asyncrl.tasks.launch.rl import RunStop, kill_recorded_groups
from asyncrl.tasks.launch.supervisor import ComponentEvent, ComponentOutcome


def event_reporter(run_name: str) -> Callable[[ComponentEvent], None]:
    """A Prefect log line and an event (``asyncrl.component.restarting`` / ``.failed``) per
    restart and failure of run ``run_name``'s components, for the UI and automations: the
    resource is ``asyncrl.component.<component>`` labelled ``asyncrl.run``, with the run's
    resource ``asyncrl.run.<run name>`` (the canary's) related as role ``run``, so an
    automation can match one run's components or every run's."""

    def report(event: ComponentEvent) -> None:
        if event.kind not in ("restarting", "failed"):
            return
        get_run_logger().warning("%s %s: %s", event.component, event.kind, event.detail)
        emit_event(
            event=f"asyncrl.component.{event.kind}",
            resource={"prefect.resource.id": f"asyncrl.component.{event.component}", "asyncrl.run": run_name},
            related=[{"prefect.resource.id": f"asyncrl.run.{run_name}", "prefect.resource.role": "run",
                      "prefect.resource.name": run_name}],  # fmt: skip
            payload={"detail": event.detail, "restarts": event.restarts},
        )

    return report


def outcome_state(outcome: ComponentOutcome, stop: RunStop | None) -> Any:  # noqa: ANN401 - a dict or a State
    """What a component's task or flow run returns: Cancelled when the run stopped it for
    another reason than its normal end (a failure elsewhere, a cancel), else its outcome."""
    if outcome.end == "stopped" and stop is not None and stop.cancelled:
        return Cancelled(message=f"{outcome.component} stopped: {stop.reason}")
    return asdict(outcome)


REMOTE_CANCEL_TIMEOUT_S = 60.0


def kill_run_processes(flow: Any, flow_run: Any, state: Any) -> None:  # noqa: ANN401 - Prefect's hook signature
    """Flow hook (cancelled or crashed): SIGKILL the process groups the run recorded and
    cancel the remote components' flow runs it recorded. It runs in the worker after the flow
    process is gone, so it finds them through the run's ``process-groups.json`` and
    ``remote-flow-runs.json`` (named by the ``config`` parameter's work_dir and name)."""
    config = flow_run.parameters.get("config") or {}
    work_dir, name = config.get("work_dir"), config.get("name")
    if work_dir and name:
        kill_recorded_groups(Path(work_dir) / name)
        remote = [run_id for ids in read_remote_flow_runs(Path(work_dir) / name).values() for run_id in ids]
        if remote:
            cancel_flow_runs(remote, REMOTE_CANCEL_TIMEOUT_S, f"run {name} was {state.type.value.lower()}")


def kill_hosted_processes(flow: Any, flow_run: Any, state: Any) -> None:  # noqa: ANN401 - Prefect's hook signature
    """Hook of the `component` flow (cancelled or crashed): SIGKILL the process groups its
    flow run recorded on this machine (``process-groups-{component}-{replica}.json``)."""
    parameters = flow_run.parameters
    config = parameters.get("config") or {}
    work_dir, name = config.get("work_dir"), config.get("name")
    if work_dir and name and parameters.get("kind"):
        file_name = hosted_groups_file(parameters["kind"], int(parameters.get("index", 0)), int(parameters.get("replica", 0)))
        kill_recorded_groups(Path(work_dir) / name, file_name)
