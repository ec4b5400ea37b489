"""The scheduler's persisted admission state (``scheduler/state.json``): the staleness gate's
counts and the adaptive bound's state, saved before a group is dispatched so a restart never
admits a group twice (module docstring of :mod:`asyncrl.tasks.scheduler.controller`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from asyncrl.tasks.algo.adaptive_eta import AdaptiveState
from asyncrl.tasks.algo.staleness_gate import GateState
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot


def _scheduler_state(root: RunRoot) -> dict[str, Any] | None:
    """The scheduler state file as a JSON object (None: none saved); ``ValueError`` names it if corrupt."""
    try:
        raw = json.loads(fs.read_bytes(root, paths.SCHEDULER_STATE))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state (not a JSON object)")
    return raw


def load_gate_state(root: RunRoot) -> GateState | None:
    raw = _scheduler_state(root)
    if raw is None:
        return None
    try:
        return GateState.from_json(json.dumps(raw["gate"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def load_adaptive_state(root: RunRoot) -> AdaptiveState | None:
    """The adaptive staleness state saved beside the gate's (None: none saved)."""
    raw = _scheduler_state(root)
    if raw is None or raw.get("adaptive") is None:
        return None
    try:
        return AdaptiveState.from_dict(raw["adaptive"])
    except ValueError as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def save_gate_state(root: RunRoot, state: GateState, adaptive: AdaptiveState | None = None) -> None:
    payload: dict[str, Any] = {"gate": json.loads(state.to_json()), "saved_at": time.time()}
    if adaptive is not None:
        payload["adaptive"] = adaptive.to_dict()
    fs.put_atomic_replace(root, paths.SCHEDULER_STATE, json.dumps(payload).encode())
