"""Supervising OS process groups: the rollout servers and the trainer each run in a
session of their own, so one signal reaches every process they spawned; each may be
pinned to CPUs that all its processes inherit."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from asyncrl.configs.cpus import machine_cpus

_PR_SET_PDEATHSIG = 1


def die_with_parent_hook(sig: signal.Signals) -> Callable[[], None] | None:
    """A `preexec_fn` asking Linux to send `sig` to the child when the *thread* that
    started it exits (`PR_SET_PDEATHSIG`), so a supervisor killed outright leaves no
    orphan. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl  # resolved before fork
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def usable_cpus() -> frozenset[int]:
    """The CPU ids this process may run on (its affinity mask; every CPU of the machine
    where the platform has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return machine_cpus()


def child_setup_hook(
    die_signal: signal.Signals | None, cpu_cores: Sequence[int] | None, session_nice: int | None = None
) -> Callable[[], None] | None:
    """The ``preexec_fn`` of a supervised child: :func:`die_with_parent_hook` (when
    ``die_signal`` is given), ``sched_setaffinity`` to ``cpu_cores`` (when given) and
    :func:`lower_own_session_priority` (when ``session_nice`` is given), all before ``exec``,
    so the child and every process it spawns (vLLM's engine core, the trainer's workers)
    inherit them. None when there is nothing to do."""
    die = die_with_parent_hook(die_signal) if die_signal is not None else None
    cores = frozenset(cpu_cores) if cpu_cores is not None else None  # built before the fork
    if cores is None and session_nice is None:
        return die

    def hook() -> None:
        if die is not None:
            die()
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if session_nice is not None:
            lower_own_session_priority(session_nice)

    return hook


def check_session_nice(nice: int | None, field: str) -> int | None:
    """``nice`` if None or an int in [0, 19] (lowering priority needs no privilege), else
    ``ValueError`` naming ``field``."""
    if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19):
        raise ValueError(f"{field} must be an int in [0, 19] or None, got {nice!r}")
    return nice


def lower_own_session_priority(nice: int) -> None:
    """Run in a new session's leader before ``exec``: nice value ``nice`` for the process
    (inherited by all it spawns) and, where the kernel groups sessions for scheduling
    (Linux autogroup, ``/proc/self/autogroup``), for the session's group.

    With autogroup, per-process nice values only order processes inside one session;
    between sessions the CPU is shared by group. Seen on a 2-vCPU VM: vLLM's engine core
    busy-polls its worker, and processes of other sessions (the driver, a test) went
    without CPU for seconds at a time; a session nice of 10 on the server removed that.
    Only system calls (no Python locks): safe between fork and exec.
    """
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        fd = os.open("/proc/self/autogroup", os.O_WRONLY)
    except OSError:
        return  # no autogroup: the process nice value is what orders the CPU
    try:
        os.write(fd, str(nice).encode())
    finally:
        os.close(fd)


def spawn_session(
    command: Sequence[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    cores: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` in a new session (its pid is the process group id) that gets SIGKILL
    if this process dies, optionally pinned to ``cores``; stdout and stderr are appended to
    ``log_path`` after a ``$ command`` line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=child_setup_hook(signal.SIGKILL, cores),  # noqa: PLW1509 - system calls only
        )


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` exists (`killpg(pgid, 0)`)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(process: subprocess.Popen[bytes], grace_s: float, reap_wait_s: float = 10.0) -> int:
    """SIGTERM the group led by `process`, SIGKILL it after `grace_s`, and wait until no
    process of the group is left (orphaned grandchildren included); return the leader's status."""
    pgid = process.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, reap_wait_s)):
        if not group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(pgid):
            process.poll()  # reap the leader so it stops counting as alive
            time.sleep(0.05)
    return process.wait()


def read_log_tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except FileNotFoundError:
        return ""
