"""The scheduler's persisted admission state (``scheduler/state.json``): the staleness gate's
counts, the adaptive bound's state, the regenerations admitted (groups of quarantined
shards admitted again) and the admission record of each group admitted and not yet written
(:class:`~asyncrl.storage.admissions.Admission`, which the group's shard then carries), saved
before a group is dispatched so a restart never admits a group twice and a group generated
again after a restart keeps the version it was admitted at (module docstring of
:mod:`asyncrl.tasks.scheduler.controller`).

``gate.admitted`` counts the new groups admitted (ids ``g0`` .. ``g{admitted-1}``, what the
audit reads); the gate itself counted ``gate.admitted + regenerations.admitted``
admissions (:class:`Regenerations`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from asyncrl.tasks.algo.adaptive_eta import AdaptiveState
from asyncrl.tasks.algo.staleness_gate import GateState
from asyncrl.storage import fs, paths
from asyncrl.storage.admissions import Admission
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


@dataclass(frozen=True)
class AdmittedRegeneration:
    """A group of a quarantined shard admitted again and not yet written when the state was saved."""

    group: int
    shard_seq: int
    """The quarantined shard it replaces (a group quarantined twice is regenerated twice)."""
    after: int
    """New groups admitted before it: its place in the admission order, kept by a restart."""


@dataclass(frozen=True)
class Regenerations:
    """The admissions of groups of quarantined shards (see
    :func:`asyncrl.tasks.scheduler.written_index.learn_quarantines`)."""

    admitted: int = 0
    """Regenerations admitted since the run began: the gate counted each as an admission."""
    in_flight: tuple[AdmittedRegeneration, ...] = ()
    """Those admitted and not yet written, in admission order."""

    def to_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "in_flight": [[r.group, r.shard_seq, r.after] for r in self.in_flight]}

    @staticmethod
    def from_dict(raw: Any) -> Regenerations:
        admitted = raw["admitted"]
        in_flight = tuple(AdmittedRegeneration(int(g), int(s), int(a)) for g, s, a in raw["in_flight"])
        if isinstance(admitted, bool) or not isinstance(admitted, int) or admitted < len(in_flight):
            raise ValueError(f"regenerations: {admitted!r} admitted, {len(in_flight)} in flight")
        return Regenerations(admitted, in_flight)


def load_regenerations(root: RunRoot) -> Regenerations:
    """The regenerations saved beside the gate's state (none: nothing saved, or a state saved
    before quarantined shards were regenerated)."""
    raw = _scheduler_state(root)
    if raw is None or raw.get("regenerations") is None:
        return Regenerations()
    try:
        return Regenerations.from_dict(raw["regenerations"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def load_admissions(root: RunRoot) -> dict[int, Admission] | None:
    """Group index -> admission record of the groups admitted and unwritten when the state was
    saved; None when the state keeps no records (none saved, or saved by a scheduler that
    did not record admissions: then its shards have none either)."""
    raw = _scheduler_state(root)
    if raw is None or raw.get("admissions") is None:
        return None
    try:
        return {int(index): Admission(*pair) for index, pair in raw["admissions"].items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{root.display(paths.SCHEDULER_STATE)}: corrupt scheduler state ({exc})") from None


def save_gate_state(
    root: RunRoot,
    state: GateState,
    adaptive: AdaptiveState | None = None,
    regenerations: Regenerations | None = None,
    admissions: Mapping[int, Admission] | None = None,
) -> None:
    """Replace ``scheduler/state.json`` (one PUT): ``state`` counts the new groups admitted
    (the module docstring); ``admissions`` (the groups admitted and unwritten, O(groups in
    flight)) is saved even when empty: it says the run records admissions."""
    payload: dict[str, Any] = {"gate": json.loads(state.to_json()), "saved_at": time.time()}
    if adaptive is not None:
        payload["adaptive"] = adaptive.to_dict()
    if regenerations is not None and regenerations.admitted:
        payload["regenerations"] = regenerations.to_dict()
    if admissions is not None:
        payload["admissions"] = {str(index): [a.version, a.updates] for index, a in sorted(admissions.items())}
    fs.put_atomic_replace(root, paths.SCHEDULER_STATE, json.dumps(payload).encode())
