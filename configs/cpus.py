"""CPU ids as config values: which CPUs this machine has, and the check of a ``cpu_cores`` field."""

from __future__ import annotations

import os
from collections.abc import Sequence


def machine_cpus() -> frozenset[int]:
    """The CPU ids of this machine: 0 .. os.cpu_count() - 1."""
    return frozenset(range(os.cpu_count() or 1))


def check_cpu_cores(cores: Sequence[int] | None, field: str) -> tuple[int, ...] | None:
    """``cores`` as a sorted tuple of distinct CPU ids, or None (no pinning).

    ``ValueError`` naming ``field`` for an empty list, a value that is not an int >= 0, a
    CPU this machine does not have, or a platform without ``sched_setaffinity``. (Checked against the machine, not this process's
    affinity: a process pinned elsewhere, e.g. the trainer re-reading the run config, must
    accept the rollout's CPUs.)"""
    if cores is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{field}: pinning to CPUs needs Linux (sched_setaffinity); leave it null here")
    if isinstance(cores, (str, bytes)) or len(cores) == 0:
        raise ValueError(f"{field}: expected a non-empty list of CPU ids (ints >= 0) or null, got {cores!r}")
    for core in cores:
        if isinstance(core, bool) or not isinstance(core, int) or core < 0:
            raise ValueError(f"{field}: CPU ids are ints >= 0, got {core!r}")
    machine = machine_cpus()
    missing = sorted(set(cores) - machine)
    if missing:
        raise ValueError(
            f"{field}: CPU {', '.join(map(str, missing))} does not exist on this machine "
            f"(CPUs 0-{max(machine)})"
        )
    return tuple(sorted(set(cores)))
