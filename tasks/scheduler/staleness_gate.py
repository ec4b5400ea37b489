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


class StalenessGate:
    """Admits prompt groups so that no trained group is more than ``eta`` versions stale.

    Rule: with current policy version i, Nr = number of prompt groups admitted
    so far INCLUDING the one being admitted and B = ``batch_groups``, admit only
    if ``floor((Nr - 1) / B) <= i + eta``; equivalently the admitted total never
    exceeds ``capacity(i) = (i + eta + 1) * B``.  eta = 0 is synchronous RL.

    The count is part of :class:`GateState`; a gate restored from a saved state
    keeps counting from the saved total, so a restart cannot reopen capacity that
    was already used (staleness stays <= eta across checkpoint recovery).
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
        self._source = version_source
        self._admitted = admitted
        self._lock = threading.Lock()

    def capacity(self, version: int) -> int:
        """Total admissions allowed at ``version``: (version + eta + 1) * B."""
        return max_admissions(version, self._batch_groups, self._eta)

    def try_admit(self) -> bool:
        """Admit one prompt group if the rule allows it (atomic check-and-increment)."""
        with self._lock:
            version = self._read_version()
            if self._admitted + 1 > self.capacity(version):
                return False
            self._admitted += 1
            return True

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
                eta=self._eta,
                batch_groups=self._batch_groups,
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
