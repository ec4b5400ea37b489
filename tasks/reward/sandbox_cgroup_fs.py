"""The cgroup of one sandbox on cgroupfs, v1 or v2, and what reads and writes its files.

A sandbox's cgroup is one directory per cgroup hierarchy that caps it: on cgroup v2 one
(memory, pids and cpu in the unified hierarchy), on cgroup v1 one in each of the memory, pids
and cpu hierarchies (fewer where a hierarchy combines them). Which directories and which limit
files is decided elsewhere (``sandbox_cgroup.py`` for v2, ``sandbox_cgroup_v1.py`` for v1);
what is here works the same on both: ``cgroup.procs`` takes a process, ``oom_kill`` counts OOM
kills (v2 ``memory.events``, v1 ``memory.oom_control``), ``cgroup.kill`` (v2, Linux 5.14+) or
a SIGKILL to each listed process empties it, and ``rmdir`` removes it.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.reward import SandboxLimits

CONTROLLERS = ("cpu", "memory", "pids")
"""The controllers a sandbox's cgroup needs (its CPU bandwidth, memory and process count)."""
SANDBOXES = "asyncrl-sandboxes"
"""Child of the process's own cgroup holding one cgroup per sandbox (in each v1 hierarchy)."""
CPU_PERIOD_US = 100_000
REMOVE_TIMEOUT_S = 5.0
OOM_FILES = ("memory.events", "memory.oom_control")
"""Where the kernel counts a cgroup's OOM kills (``oom_kill N``): cgroup v2, cgroup v1."""
_names = itertools.count()
logger = logging.getLogger("asyncrl.reward.sandbox")


class CgroupUnavailable(Exception):
    """No cgroup can cap the sandboxes here; the message says why (shown in the caps report)."""


@dataclass(frozen=True)
class LimitFile:
    """One interface file of a sandbox's cgroup and the value written to it when it is made."""

    name: str
    value: str
    only_if_present: bool = False
    """Written only where the kernel has the file (swap accounting: ``memory.swap.max``,
    ``memory.memsw.limit_in_bytes``)."""


@dataclass(frozen=True)
class CgroupParent:
    """A directory under which every sandbox gets a cgroup of its own, and the controllers
    (of CONTROLLERS) whose limits that cgroup carries: all three on cgroup v2, those of its
    hierarchy on cgroup v1."""

    path: str
    controllers: tuple[str, ...]


def cfs_quota_us(limits: SandboxLimits) -> int:
    """CPU time per CPU_PERIOD_US for ``limits.cpus`` CPUs, in microseconds (at least the
    kernel's smallest quota, 1000)."""
    return max(1000, round(limits.cpus * CPU_PERIOD_US))


class SandboxCgroup:
    """The cgroup of one sandbox (its directories, one per hierarchy): made with its limits,
    given the sandbox's first process, read for OOM kills, emptied and removed at the end."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths

    def __str__(self) -> str:
        return ", ".join(str(p) for p in self.paths)

    @classmethod
    def create(cls, layout: Sequence[tuple[Path, Sequence[LimitFile]]], prefix: str = "sandbox") -> SandboxCgroup:
        """``<parent>/<prefix>-<pid>-<n>`` in each parent of ``layout``, its limit files written
        in order; ``CgroupUnavailable`` (with what was made removed again) if not."""
        name = f"{prefix}-{os.getpid()}-{next(_names)}"
        made: list[Path] = []
        for parent, files in layout:
            path = parent / name
            try:
                path.mkdir()
            except OSError as exc:
                cls(*made).remove()
                raise CgroupUnavailable(f"cannot create the sandbox cgroup {path}: {exc.strerror}") from None
            made.append(path)
            try:
                for limit in files:
                    if not limit.only_if_present or (path / limit.name).exists():
                        write(path / limit.name, limit.value)
            except OSError as exc:
                cls(*made).remove()
                raise CgroupUnavailable(f"cannot set the limits of {path}: {exc.filename}: {exc.strerror}") from None
        return cls(*made)

    def add(self, pid: int) -> None:
        """Move process ``pid`` into this cgroup, in every hierarchy (its children to come are born in it)."""
        for path in self.paths:
            write(path / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """Processes of this cgroup the OOM killer ended so far (``oom_kill`` of OOM_FILES)."""
        total = 0
        for path in self.paths:
            for name in OOM_FILES:
                if (path / name).exists():
                    total += counter(path / name, "oom_kill")
                    break
        return total

    def kill(self) -> None:
        """SIGKILL every process in the cgroup: ``cgroup.kill`` (v2, Linux 5.14+), else each
        process listed in any of its ``cgroup.procs``."""
        for path in self.paths:
            if (path / "cgroup.kill").exists():
                try:
                    write(path / "cgroup.kill", "1")
                    continue
                except OSError:
                    pass  # fall back to the processes one by one
            for pid in procs(path):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # already gone

    def remove(self, timeout_s: float = REMOVE_TIMEOUT_S) -> bool:
        """Kill what is left and remove the cgroup's directories (retried while its processes
        die); False, logged, if one is still there after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        left = list(self.paths)
        while True:
            self.kill()
            error = ""
            for path in list(left):
                try:
                    os.rmdir(path)
                    left.remove(path)
                except FileNotFoundError:
                    left.remove(path)
                except OSError as exc:
                    error = exc.strerror
            if not left:
                return True
            if time.monotonic() > deadline:
                logger.warning("sandbox cgroup %s not removed: %s", ", ".join(map(str, left)), error)
                return False
            time.sleep(0.01)


def sweep(parent: Path) -> None:
    """Remove the cgroups of sandboxes whose process is gone (a worker killed mid-run)."""
    try:
        children = [p for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return
    for child in children:
        prefix, _, rest = child.name.partition("-")
        pid = rest.partition("-")[0]
        if prefix in ("sandbox", "probe") and pid.isdigit() and not alive(int(pid)):
            SandboxCgroup(child).remove()


def write(path: Path, text: str) -> None:
    """One write of ``text`` to a cgroup interface file (created in a plain directory, as in tests)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def words(path: Path) -> list[str]:
    """The whitespace-separated words of ``path`` (none if it cannot be read)."""
    try:
        return path.read_text().split()
    except OSError:
        return []


def procs(directory: Path) -> list[int]:
    """The processes listed in a cgroup's ``cgroup.procs``."""
    return [int(word) for word in words(directory / "cgroup.procs") if word.isdigit()]


def counter(path: Path, key: str) -> int:
    """The value of the ``<key> <n>`` line of a cgroup file (``memory.events``, ``pids.events``,
    ``memory.oom_control``); 0 where there is none."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
