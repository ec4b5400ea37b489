"""The one supervisor of a run's components: start, wait until ready, watch, restart on an
unexpected exit, stop. The `train` flow runs one :func:`supervise` per component (each in a
Prefect task run), the `scheduler` flow runs it for the scheduler, and `asyncrl chaos` is
the same supervisors plus a thread that SIGKILLs process groups.

A component that exits unexpectedly (any exit that its ``finished(code)`` does not call its
normal end), or that is not ready within ``start_timeout_s``, is stopped and started
again after a backoff of ``min(backoff_s * 2**(r-1), backoff_max_s)`` seconds before the
r-th restart, up to ``max_restarts`` restarts over the run; one more failure raises
:class:`ComponentFailed` naming the component, its exit status and its log tail. Each
component resumes from storage on its own start (see :mod:`asyncrl.tasks.launch.components`),
so a restart loses no step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from asyncrl.tasks.launch.components import Component, log_tail

EventKind = Literal["started", "ready", "exited", "restarting", "failed", "stopped", "finished"]


class ComponentFailed(RuntimeError):
    """A component failed past its restart budget; the message names it and its last error."""

    def __init__(self, component: str, reason: str, restarts: int, tail: str) -> None:
        super().__init__(
            f"{component} failed after {restarts} restart(s): {reason}\n--- {component} log (last lines) ---\n{tail}"
        )
        self.component = component
        self.reason = reason
        self.restarts = restarts
        self.log_tail = tail


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    """Restarts allowed per component over the run (0: the first crash fails the run)."""
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    start_timeout_s: float = 600.0
    """A component not ready this long after a start counts as crashed."""
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"RestartPolicy.max_restarts must be an int >= 0, got {self.max_restarts!r}")
        for name in ("backoff_s", "backoff_max_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RestartPolicy.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("start_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RestartPolicy.{name} must be > 0, got {getattr(self, name)!r}")

    def backoff(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1-based): min(b * 2**(r-1), b_max)."""
        return min(self.backoff_s * 2 ** (restart - 1), self.backoff_max_s)


@dataclass(frozen=True)
class ComponentEvent:
    component: str
    kind: EventKind
    restarts: int
    pgid: int
    detail: str = ""
    at: float = field(default_factory=time.time)


@dataclass
class ComponentStatus:
    """What other threads may read of a supervised component (written by its supervisor only)."""

    name: str
    ready: bool = False
    restarts: int = 0
    pgid: int = -1
    state: EventKind | None = None
    last_error: str = ""


@dataclass(frozen=True)
class ComponentOutcome:
    component: str
    end: Literal["finished", "stopped"]
    """finished: it exited normally on its own; stopped: the run stopped it."""
    restarts: int
    exit_code: int | None


def supervise(
    component: Component,
    stop: threading.Event,
    policy: RestartPolicy,
    on_event: Callable[[ComponentEvent], None] | None = None,
    status: ComponentStatus | None = None,
) -> ComponentOutcome:
    """Run ``component`` until it finishes or ``stop`` is set (see the module docstring).
    Its process group is always killed on the way out, whatever ends this call."""
    status = status or ComponentStatus(component.name)
    emit = _emitter(component, status, on_event)
    try:
        component.start()
        emit("started")
        deadline = time.monotonic() + policy.start_timeout_s
        while True:
            if stop.wait(policy.poll_s):
                return ComponentOutcome(component.name, "stopped", status.restarts, component.poll())
            code = component.poll()
            if code is None:
                if status.ready:
                    continue
                if component.ready():
                    status.ready = True
                    emit("ready")
                    continue
                if time.monotonic() < deadline:
                    continue
                reason = f"not ready within {policy.start_timeout_s:.0f} s of its start"
            elif component.finished(code):
                emit("finished", f"exit status {code}")
                return ComponentOutcome(component.name, "finished", status.restarts, code)
            else:
                reason = f"exited with status {code}"
            status.ready = False
            status.last_error = reason
            emit("exited", reason)
            tail = log_tail(component)
            component.stop()
            if status.restarts >= policy.max_restarts:
                emit("failed", reason)
                raise ComponentFailed(component.name, reason, status.restarts, tail)
            status.restarts += 1
            emit("restarting", f"restart {status.restarts} of {policy.max_restarts} after: {reason}")
            if stop.wait(policy.backoff(status.restarts)):
                return ComponentOutcome(component.name, "stopped", status.restarts, code)
            component.start()
            emit("started")
            deadline = time.monotonic() + policy.start_timeout_s
    finally:
        component.stop()
        status.ready = False
        emit("stopped")


def _emitter(
    component: Component, status: ComponentStatus, on_event: Callable[[ComponentEvent], None] | None
) -> Callable[..., None]:
    def emit(kind: EventKind, detail: str = "") -> None:
        status.state = kind
        status.pgid = component.pgid()
        if on_event is not None:
            on_event(ComponentEvent(component.name, kind, status.restarts, status.pgid, detail))

    return emit
