"""Supervising OS process groups: the rollout servers and the trainer each run in a
session of their own, so one signal reaches every process they spawned."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

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
