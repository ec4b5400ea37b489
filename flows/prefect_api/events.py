"""Prefect events a run emits: the mismatch canary's alarm (for automations)."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.tasks.launch.canary import EVENT, CanaryAlarm


def prefect_alarm(run_name: str) -> Callable[[CanaryAlarm], None]:
    """The reaction inside a flow run: a warning in the run's log and a Prefect event
    ``asyncrl.mismatch.canary`` on resource ``asyncrl.run.<run name>`` (for automations)."""

    def report(alarm: CanaryAlarm) -> None:
        from prefect import get_run_logger  # looked up per call: tests patch the prefect modules
        from prefect.events import emit_event

        get_run_logger().warning("%s", alarm.message())
        emit_event(
            event=EVENT,
            resource={"prefect.resource.id": f"asyncrl.run.{run_name}", "prefect.resource.name": run_name},
            payload={
                "step": alarm.step,
                "tokens": alarm.tokens,
                "crossed": {name: {"value": v, "threshold": t} for name, (v, t) in alarm.crossed.items()},
            },
        )

    return report
