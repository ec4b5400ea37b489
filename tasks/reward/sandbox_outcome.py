"""What a sandboxed run takes and gives back, and why it failed: the program files, the
outcome, and the classification of a finished run into a reward reason (timeout, output,
memory, process limit, crash) from its exit status and stderr. Shared by the one-shot runs
of :class:`~asyncrl.tasks.reward.sandbox.Sandbox` and the sessions of
:class:`~asyncrl.tasks.reward.sandbox_session.SandboxSession`, so both give the same reasons.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from asyncrl.configs.reward import SandboxLimits
from asyncrl.tasks.reward.types import Reason


STDERR_SHOWN = 600
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
PROCESS_MARKERS = ("BlockingIOError: [Errno 11]", "can't start new thread", "Resource temporarily unavailable")
# Python ignores SIGXFSZ, so an over-size write fails with EFBIG; a full /tmp with ENOSPC.
FILE_MARKERS = ("[Errno 27] File too large", "[Errno 28] No space left on device")
# C0 controls but newline and tab, DEL and the C1 controls (U+0080..U+009F: CSI, OSC...).
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class SandboxUnavailable(Exception):
    """bubblewrap (or what the sandbox needs) is missing and unsandboxed runs are not allowed."""


@dataclass(frozen=True)
class SandboxFile:
    """A file placed read-only at ``/sandbox/<name>``."""

    name: str
    content: bytes

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"SandboxFile.name: {self.name!r} must be a plain file name")


@dataclass(frozen=True)
class RunOutcome:
    """How one program run ended.

    ``reason`` is OK when the program exited with status 0 within every limit (its
    output is still to be checked); otherwise the failure.
    """

    reason: Reason
    detail: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    sandboxed: bool


@dataclass
class Capture:
    stdout: bytearray
    stderr: bytearray
    status: bytearray
    timed_out: bool = False
    overflow: str = ""
    exited: bool = False


def classify(
    exit_code: int | None, capture: Capture, wall_s: float, limits: SandboxLimits, oom_killed: bool = False
) -> tuple[Reason, str]:
    """The failure reason of a finished run (OK for status 0 within every limit).

    In order: wall-time kill -> timeout; output cap -> output_limit; a failed run during
    which the OOM killer ended a process of the sandbox's cgroup (``oom_killed``: its
    memory.max, ``sandbox_cgroup.py``) -> memory; SIGXCPU, or a
    SIGKILL after at least cpu_s of wall time (the hard CPU limit of a program that
    ignored SIGXCPU) -> timeout; SIGXFSZ, EFBIG or a full /tmp -> output_limit; a
    memory error on stderr -> memory; a failed fork -> process_limit; any other
    non-zero status -> crash. bwrap reports a program killed by signal s as 128 + s.
    The stderr markers come from the program itself: it can only choose the label of
    its own failure, never turn it into a pass. The stderr shown in the detail has its
    control characters escaped (escape_controls).
    """
    if capture.timed_out:
        return Reason.TIMEOUT, f"wall time limit of {limits.wall_s} s exceeded; sandbox killed"
    if capture.overflow:
        return Reason.OUTPUT_LIMIT, f"{capture.overflow} exceeded {limits.output_bytes} bytes; sandbox killed"
    if exit_code == 0:
        return Reason.OK, ""
    signum = _signal_of(exit_code)
    tail = escape_controls(bytes(capture.stderr[-STDERR_SHOWN:]).decode("utf-8", "replace").strip())
    if oom_killed:
        how = f"killed by {signal.Signals(signum).name}" if signum else f"exit status {exit_code}"
        return Reason.MEMORY, (
            f"memory limit of {limits.memory_mb} MiB for the whole sandbox (its cgroup's memory limit): the OOM killer "
            f"ended a process; {how}"
        )
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and wall_s >= limits.cpu_s):
        return Reason.TIMEOUT, f"CPU time limit of {limits.cpu_s} s exceeded"
    if signum == signal.SIGXFSZ or any(marker in tail for marker in FILE_MARKERS):
        return Reason.OUTPUT_LIMIT, (
            f"file size limit of {limits.fsize_mb} MiB or /tmp and /dev/shm size of {limits.tmpfs_mb} MiB each: "
            f"{_last_line(tail)}"
        )
    if any(marker in tail for marker in MEMORY_MARKERS):
        return Reason.MEMORY, f"memory limit of {limits.memory_mb} MiB: {_last_line(tail)}"
    if any(marker in tail for marker in PROCESS_MARKERS):
        return Reason.PROCESS_LIMIT, f"process limit of {limits.nproc}: {_last_line(tail)}"
    how = f"killed by {signal.Signals(signum).name}" if signum else f"exit status {exit_code}"
    return Reason.CRASH, f"{how}: {tail}" if tail else how


def _signal_of(exit_code: int | None) -> int:
    """The signal that ended the program: negative status (killed directly) or 128 + s (via bwrap)."""
    if exit_code is None:
        return 0
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 128 + signal.NSIG:
        return exit_code - 128
    return 0


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def escape_controls(text: str) -> str:
    """``text`` with every control character but newline and tab written as ``\\xNN``.

    Covers the C0 controls (ESC, CR, BEL, backspace...), DEL and the C1 controls
    U+0080..U+009F (CSI, OSC: 8-bit escape sequences some terminals obey), so a
    program's output shown in a reason, a log or a terminal can move no cursor, set
    no title and hide nothing.
    """
    return _CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
