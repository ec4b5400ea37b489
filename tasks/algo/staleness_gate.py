"""Admission control for rollout requests under the AReaL staleness rule.

The scheduler asks the gate before it sends each prompt group to the rollout
servers; the gate only counts admissions and compares them with the current
policy version, which it reads from an injected :class:`VersionSource`.

The policy version i is counted in training steps: the steps the current policy's
weights have received, which is what the trainer measures staleness in. In a run whose
trainer never rolled back that is the version label; after a rollback the labels run
ahead of it, and the rollout controller's source reads the steps from each version's
lineage (see ``_GeneratorUpdates`` in :mod:`asyncrl.tasks.scheduler.controller`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class VersionSource(Protocol):
    """Anything that can tell the current policy version i, in training steps (see the module docstring)."""

    def current_version(self) -> int: ...


def max_admissions(version: int, batch_groups: int, eta: int) -> int:
    """Total number of prompt groups that may have been admitted at ``version``.

    A new group (making Nr admitted groups in total, itself included) is
    admitted only if ``floor((Nr - 1) / B) <= i + eta``, with i the current
    policy version and B = ``batch_groups``.  Since Nr - 1 < (i + eta + 1) * B
    is the same condition, the admitted total is bounded by::

        capacity(i) = (i + eta + 1) * B
    """
    _check_config(batch_groups, eta)
    _check_version(version)
    return (version + eta + 1) * batch_groups


@dataclass(frozen=True)
class GateState:
    """The part of a :class:`StalenessGate` that must survive a restart."""

    admitted: int
    batch_groups: int
    eta: int

    def __post_init__(self) -> None:
        for name in ("admitted", "batch_groups", "eta"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"GateState.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.admitted < 0:
            raise ValueError(f"GateState.admitted must be >= 0, got {self.admitted}")
        _check_config(self.batch_groups, self.eta)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GateState:
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"GateState JSON is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"GateState JSON must be an object, got {type(raw).__name__}")
        expected = {"admitted", "batch_groups", "eta"}
        missing = sorted(expected - raw.keys())
        extra = sorted(raw.keys() - expected)
        if missing or extra:
            raise ValueError(f"GateState JSON fields: missing {missing}, unexpected {extra}")
        return cls(admitted=raw["admitted"], batch_groups=raw["batch_groups"], eta=raw["eta"])


@dataclass(frozen=True)
class GateStats:
    """A snapshot of the gate, taken under its lock."""

    admitted: int
    version: int
    capacity: int
    eta: int
    batch_groups: int
    released: int = 0
    """Admitted groups released because they will not be trained (dynamic filtering)."""
    eta_limit: int | None = None
    """The configured bound; ``eta`` is the effective one (:meth:`StalenessGate.set_eta`)."""


class StalenessGate:
    """Admits prompt groups so that no trained group is more than ``eta`` versions stale.

    Rule: with current policy version i, Nr = number of prompt groups admitted
    so far INCLUDING the one being admitted and B = ``batch_groups``, admit only
    if ``floor((Nr - 1) / B) <= i + eta``; equivalently the admitted total never
    exceeds ``capacity(i) = (i + eta + 1) * B``.  eta = 0 is synchronous RL.

    Released admissions (dynamic filtering, DAPO style): a group that is not trained
    (its rewards are all equal) is released (:meth:`release`) and no longer counts: Nr is
    then admitted - released + 1 for the new group, so it counts only the groups that may
    be trained, as AReaL counts rejected rollouts. The rule still holds for every trained
    group: let group k (admission order, from 0) be the j-th trained group, j = k minus
    the groups before k that are released in the end. When k was admitted, only groups
    before it could have been released, so Nr - 1 = k - (released so far) >= j and
    floor(j / B) <= floor((Nr - 1) / B) <= i + eta; the trainer trains it at step
    floor(j / B) (trained groups are written in admission order, B per step), at most eta
    steps after i. A release must be made durable by the caller before it is counted (the
    controller records the filtered group first), so a restart never counts a group as
    released that it then trains.

    Effective bound (adaptive staleness, :mod:`~asyncrl.tasks.algo.adaptive_eta`):
    :meth:`set_eta` sets e with 0 <= e <= eta and the rule admits against e,
    floor((Nr - 1) / B) <= i + e. Every admission satisfies it with some e <= eta, so the
    bound eta holds for every group whatever e did; lowering e withdraws nothing already
    admitted. GateState keeps the configured eta; the controller saves e beside it.

    The count is part of :class:`GateState`; a gate restored from a saved state
    keeps counting from the saved total, so a restart cannot reopen capacity that
    was already used (staleness stays <= eta across checkpoint recovery). Releases
    are not in the state: the controller counts them again from its durable records
    when it starts.
    """

    def __init__(
        self,
        batch_groups: int,
        eta: int,
        version_source: VersionSource,
        state: GateState | None = None,
    ) -> None:
        _check_config(batch_groups, eta)
        admitted = 0
        if state is not None:
            if state.batch_groups != batch_groups:
                # The bound counts admissions in units of B; reinterpreting an old
                # count with another B would let staleness run past eta.
                raise ValueError(
                    f"saved gate state has batch_groups={state.batch_groups} but the gate is "
                    f"configured with batch_groups={batch_groups}; B cannot change on resume"
                )
            admitted = state.admitted
        self._batch_groups = batch_groups
        self._eta = eta
        self._effective_eta = eta
        self._source = version_source
        self._admitted = admitted
        self._released = 0
        self._lock = threading.Lock()

    def capacity(self, version: int) -> int:
        """Total admissions allowed at ``version``: (version + e + 1) * B, e the effective bound."""
        return max_admissions(version, self._batch_groups, self._effective_eta)

    def set_eta(self, eta: int) -> None:
        """Admit against the effective bound ``eta`` from now on (0 <= eta <= the configured one)."""
        if isinstance(eta, bool) or not isinstance(eta, int) or not 0 <= eta <= self._eta:
            raise ValueError(f"effective eta must be an int in [0, {self._eta}] (the configured bound), got {eta!r}")
        with self._lock:
            self._effective_eta = eta

    def try_admit(self) -> bool:
        """Admit one prompt group if the rule allows it (atomic check-and-increment)."""
        with self._lock:
            version = self._read_version()
            if self._admitted - self._released + 1 > self.capacity(version):
                return False
            self._admitted += 1
            return True

    def release(self, count: int = 1) -> None:
        """Stop counting ``count`` admitted groups that will not be trained (see the class docstring)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"release count must be an int >= 0, got {count!r}")
        with self._lock:
            if self._released + count > self._admitted:
                raise ValueError(
                    f"cannot release {count} more groups: {self._released} of {self._admitted} admitted are released"
                )
            self._released += count

    def wait_admit(self, timeout: float | None = None, poll_interval: float = 0.05) -> bool:
        """Block until one group is admitted (True) or ``timeout`` seconds pass (False).

        The version changes outside the gate, so the gate polls it every
        ``poll_interval`` seconds.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.try_admit():
                return True
            if deadline is None:
                time.sleep(poll_interval)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll_interval, left))

    def stats(self) -> GateStats:
        with self._lock:
            version = self._read_version()
            return GateStats(
                admitted=self._admitted,
                version=version,
                capacity=self.capacity(version),
                eta=self._effective_eta,
                batch_groups=self._batch_groups,
                released=self._released,
                eta_limit=self._eta,
            )

    def state(self) -> GateState:
        with self._lock:
            return GateState(admitted=self._admitted, batch_groups=self._batch_groups, eta=self._eta)

    def _read_version(self) -> int:
        version = self._source.current_version()
        _check_version(version)
        return version


def _check_config(batch_groups: int, eta: int) -> None:
    if not isinstance(batch_groups, int) or isinstance(batch_groups, bool) or batch_groups < 1:
        raise ValueError(f"batch_groups (B, prompt groups per training step) must be an int >= 1, got {batch_groups!r}")
    if not isinstance(eta, int) or isinstance(eta, bool) or eta < 0:
        raise ValueError(f"eta (maximum staleness in versions) must be an int >= 0, got {eta!r}")


def _check_version(version: int) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"policy version must be an int >= 0, got {version!r}")
