"""The operating-system side of a sandboxed run: bwrap's system-directory and prlimit
arguments, the unsandboxed mode's rlimits, in-memory files, killing a process group, and
supervising a run's output and wall time until it ends.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time

from asyncrl.configs.reward import SandboxLimits
from asyncrl.tasks.reward.sandbox_outcome import Capture
from asyncrl.tasks.reward.environ import SANDBOX_HOME


SANDBOX_DIR = "/sandbox"
WORK_DIR = SANDBOX_HOME
SHM_DIR = "/dev/shm"
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
READ_CHUNK = 65536


def supervise(
    proc: subprocess.Popen[bytes], status_r: int, limits: SandboxLimits, start: float, kill_group_on_exit: bool
) -> tuple[Capture, int | None]:
    """Read stdout/stderr/status until the process exits, killing its group on a limit.

    Returns the capture and the exit status (negative: killed by that signal).
    """
    assert proc.stdout is not None and proc.stderr is not None
    capture = Capture(bytearray(), bytearray(), bytearray())
    pidfd = os.pidfd_open(proc.pid)
    streams = {proc.stdout.fileno(): ("stdout", capture.stdout), proc.stderr.fileno(): ("stderr", capture.stderr)}
    streams[status_r] = ("status", capture.status)
    selector = selectors.DefaultSelector()
    try:
        for fd in streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        selector.register(pidfd, selectors.EVENT_READ)
        deadline = start + limits.wall_s
        while len(selector.get_map()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                capture.timed_out = True
                kill_group(proc.pid)
                break
            for key, _ in selector.select(left):
                fd = int(key.fd)
                if fd == pidfd:
                    capture.exited = True
                    selector.unregister(pidfd)
                    if kill_group_on_exit:
                        kill_group(proc.pid)  # children left behind would hold the pipes open
                    continue
                name, buffer = streams[fd]
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(fd)
                    continue
                buffer += chunk
                if name != "status" and len(buffer) > limits.output_bytes:
                    del buffer[limits.output_bytes :]
                    capture.overflow = name
                    kill_group(proc.pid)
            if capture.overflow:
                break
        proc.wait()
    finally:
        selector.close()
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    return capture, proc.returncode


def kill_group(pgid: int) -> None:
    """SIGKILL a process group; with bwrap its pid namespace, and every process in it, dies too."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def system_dir_args() -> list[str]:
    """Mirror the host's /bin, /lib*... : a symlink stays a symlink (into /usr), a real dir is bound read-only."""
    args: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def prlimit_argv(prlimit: str, limits: SandboxLimits) -> list[str]:
    """prlimit arguments: soft=hard for every limit except CPU, whose hard limit is one second later
    (SIGXCPU first, so a CPU timeout is told apart from other kills)."""
    return [
        prlimit,
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_mb << 20}",
        f"--nproc={limits.nproc}",
        f"--nofile={limits.nofile}",
        f"--fsize={limits.fsize_mb << 20}",
        "--core=0",
        "--",
    ]


def apply_rlimits(limits: SandboxLimits) -> None:
    """The unsandboxed mode's limits. No RLIMIT_NPROC: outside a user namespace it would count
    every process of the host user (and root is exempt anyway)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.fsize_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def memfd(name: str, content: bytes, owned: list[int]) -> int:
    """An anonymous in-memory file holding ``content``, positioned at its start."""
    fd = os.memfd_create(f"asyncrl-{name}")
    owned.append(fd)
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def json_lines(data: bytes) -> list[dict[str, object]]:
    """bwrap's --json-status-fd output: one JSON object per line."""
    out: list[dict[str, object]] = []
    for line in data.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line:
            out.append(json.loads(line))
    return out
