"""Heartbeats of components that run as remote flow runs: ``components/{component}/{replica}.json``.

The flow run of a remote component rewrites its heartbeat every ``placement.heartbeat_s``
seconds (its start id, flow run, host, pid, readiness, time written), so the `train` flow's
supervisor can tell a component that is up from one whose machine is gone without a final
state (a heartbeat older than ``placement.heartbeat_timeout_s``). The start id is fresh per
start, so a predecessor's last heartbeat never counts for its successor. The other way,
``components/{component}/{replica}.stop`` asks one start to stop because its run finished
(:func:`request_stop`). One small object per replica, replaced in place: the work per
heartbeat does not grow with the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot


@dataclass(frozen=True)
class Heartbeat:
    """One replica's latest word."""

    component: str
    replica: int
    start_id: str
    """Identifies the start (one `run_deployment` call) this flow run serves."""
    flow_run_id: str
    hostname: str
    pid: int
    ready: bool
    at: float = field(default_factory=time.time)
    """Unix time it was written (the writer's clock)."""

    def age_s(self, now: float | None = None) -> float:
        """Seconds since it was written (clocks of the machines are assumed to agree to well
        under the heartbeat timeout)."""
        return (time.time() if now is None else now) - self.at


def write_heartbeat(root: RunRoot, beat: Heartbeat) -> None:
    """Replace the replica's heartbeat with ``beat`` (one atomic write)."""
    relpath = paths.component_heartbeat(beat.component, beat.replica)
    fs.put_atomic_replace(root, relpath, json.dumps(asdict(beat), sort_keys=True).encode())


def read_heartbeat(root: RunRoot, component: str, replica: int) -> Heartbeat | None:
    """The replica's latest heartbeat, or None if it has none (or an unreadable one, which
    counts as none: the next write replaces it)."""
    try:
        content = fs.read_json_object(root, paths.component_heartbeat(component, replica))
    except ValueError:
        return None
    if content is None:
        return None
    try:
        return Heartbeat(**content)
    except TypeError:
        return None


def delete_heartbeat(root: RunRoot, component: str, replica: int) -> None:
    """Remove the replica's heartbeat (its flow run ended), if any."""
    fs.delete(root, paths.component_heartbeat(component, replica), missing_ok=True)


def request_stop(root: RunRoot, component: str, replica: int, start_id: str) -> None:
    """Ask the flow run of start ``start_id`` of the replica to stop (its run finished)."""
    fs.put_atomic_replace(root, paths.component_stop_request(component, replica), json.dumps({"start_id": start_id}).encode())


def stop_requested(root: RunRoot, component: str, replica: int, start_id: str) -> bool:
    """Whether the replica's run asked the flow run of start ``start_id`` to stop (a request
    for another start does not count)."""
    try:
        content = fs.read_json_object(root, paths.component_stop_request(component, replica))
    except ValueError:
        return False
    return content is not None and content.get("start_id") == start_id


def clear_stop_request(root: RunRoot, component: str, replica: int) -> None:
    fs.delete(root, paths.component_stop_request(component, replica), missing_ok=True)
