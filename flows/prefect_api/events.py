"""Prefect events a run emits (for automations): the mismatch canary's alarm, the changes of
its rollout server fleet and the promotion gate's decision."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.tasks.launch.canary import EVENT, CanaryAlarm
from asyncrl.tasks.launch.fleet import FleetChange
from asyncrl.tasks.pipeline.promotion import PromotionDecision

FLEET_EVENT = "asyncrl.fleet.changed"
PROMOTION_EVENT = "asyncrl.promotion.{outcome}"
"""``asyncrl.promotion.promoted`` or ``asyncrl.promotion.rejected``."""


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


def prefect_fleet_change(run_name: str) -> Callable[[FleetChange], None]:
    """The Prefect event ``asyncrl.fleet.changed`` on resource ``asyncrl.run.<run name>``, with
    the fleet's size and who joined or left: the fleet over time in the UI's event feed."""

    def report(change: FleetChange) -> None:
        from prefect.events import emit_event  # looked up per call: tests patch the prefect modules

        emit_event(
            event=FLEET_EVENT,
            resource={"prefect.resource.id": f"asyncrl.run.{run_name}", "prefect.resource.name": run_name},
            payload={"rollout_servers": len(change.servers), "servers": list(change.servers),
                     "joined": list(change.joined), "left": list(change.left), "version": change.version},
        )  # fmt: skip

    return report


def emit_promotion(run_name: str, model: str, decision: PromotionDecision) -> None:
    """The Prefect event ``asyncrl.promotion.promoted`` / ``.rejected`` on resource
    ``asyncrl.model.<model>`` (the registered model's name), related to the run, with the
    decision's figures."""
    from prefect.events import emit_event

    emit_event(
        event=PROMOTION_EVENT.format(outcome=decision.outcome),
        resource={"prefect.resource.id": f"asyncrl.model.{model}", "prefect.resource.name": model},
        related=[{"prefect.resource.id": f"asyncrl.run.{run_name}", "prefect.resource.role": "run"}],
        payload={"candidate": decision.candidate, "incumbent": decision.incumbent, "reason": decision.reason,
                 **decision.tags()},
    )  # fmt: skip
