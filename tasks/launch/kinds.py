"""The kinds of long-lived components a run has, and their names (task runs, logs,
heartbeats, restarts are all keyed by these names)."""

from __future__ import annotations

from typing import Literal

ComponentKind = Literal["rollout-server", "reward-service", "trainer", "scheduler", "evaluator"]


def component_name(kind: ComponentKind, index: int = 0) -> str:
    """``rollout-server-{index}`` for a rollout server, the kind itself for the others."""
    return f"rollout-server-{index}" if kind == "rollout-server" else kind
