"""A sandbox in which the tests of one program run one after the other: bubblewrap started
once with the driver (``sandbox_driver.py``) as pid 1, one framed request and answer per
test over a socket, and the host's own deadline on each answer (``DRIVER_SLACK_S``).
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.configs.reward import SandboxLimits
from asyncrl.tasks.reward.sandbox_cgroup_fs import CgroupUnavailable, SandboxCgroup
from asyncrl.tasks.reward.sandbox_driver import READY, REPLY
from asyncrl.tasks.reward.seccomp import build_filter, native_arch
from asyncrl.tasks.reward.types import Reason
from asyncrl.tasks.reward.sandbox_outcome import (
    Capture,
    RunOutcome,
    STDERR_SHOWN,
    SandboxFile,
    SandboxUnavailable,
    classify,
    escape_controls,
)
from asyncrl.tasks.reward.sandbox_process import READ_CHUNK, SANDBOX_DIR, WORK_DIR, kill_group, memfd, prlimit_argv

if TYPE_CHECKING:
    from asyncrl.tasks.reward.sandbox import Sandbox


_STDERR_KEPT = 65536
_MAX_FRAME = 1 << 16
_STOP_WAIT_S = 5.0
DRIVER_FILE = ".asyncrl-driver.py"
"""The driver's file name in /sandbox (``sandbox_driver.py``); no program file may take it."""
DRIVER_START_S = 30.0
"""How long a session waits for its sandbox's driver to be ready."""
DRIVER_SLACK_S = 5.0
"""Time over ``limits.wall_s`` a session waits for the answer of one test (the driver's own
wall-time kill, reaping and the transfer of the output come first)."""


class SandboxSession:
    """One bubblewrap sandbox in which the tests of ONE program run one after the other.

    The sandbox is the one ``Sandbox.run`` builds (same namespaces, file system, seccomp
    filter, environment, uid), holding the program's files and the driver
    (``sandbox_driver.py``), which runs as its pid 1 and starts each test as its own process
    with the per-test limits (rlimits through prlimit, wall time, output caps), kills whatever
    the test left behind before answering, and reports how it ended. The outcome of a test is
    classified here by ``classify`` exactly as a one-test run's is, so the reasons are the same.

    With cgroup caps (``Sandbox.caps``, v2 or v1) the sandbox, driver included, lives in one cgroup
    made when it starts and removed when it ends: its memory, pids and CPU limits bound all
    the processes of all its tests together (one test at a time runs), and a failed test during
    which the OOM killer struck there is a ``memory`` failure.

    The host watches the driver too: a test that gets no answer within ``limits.wall_s`` +
    DRIVER_SLACK_S is a timeout and the whole sandbox is killed; the next ``run`` starts a fresh
    sandbox. A sandbox that does not start (no ``ready`` from the driver within
    DRIVER_START_S), or a driver that ends unexpectedly, gives ``sandbox_unavailable``.
    The sandbox starts on the first ``run`` and ends on ``close`` (or at the end of a with-block).

    ``limits``: each test's limits, by default the sandbox's ``config.limits``. Needs
    bubblewrap: in the unsandboxed mode each test is its own ``Sandbox.run``.
    """

    def __init__(self, sandbox: Sandbox, files: Sequence[SandboxFile], limits: SandboxLimits | None = None) -> None:
        if DRIVER_FILE in {f.name for f in files}:
            raise ValueError(f"SandboxSession: {DRIVER_FILE!r} is the driver's file name")
        self.sandbox = sandbox
        self.files = list(files)
        self.limits = limits if limits is not None else sandbox.config.limits
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._pidfd = -1
        self._buffer = bytearray()
        self._stderr = bytearray()
        self._eof = False
        self._cgroup: SandboxCgroup | None = None
        self._status_r = -1
        self._oom_before = 0

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, main: str, stdin: bytes = b"") -> RunOutcome:
        """Run ``main`` (one of the files) with ``stdin`` as one test; never raises for what the program does."""
        if main not in {f.name for f in self.files}:
            raise ValueError(f"SandboxSession.run: main file {main!r} is not among {[f.name for f in self.files]}")
        bwrap = self.sandbox._bwrap
        if bwrap is None:
            raise SandboxUnavailable("SandboxSession: needs bubblewrap (the unsandboxed mode runs each test with run())")
        try:
            self.sandbox.check()
        except SandboxUnavailable as exc:
            return RunOutcome(Reason.SANDBOX_UNAVAILABLE, str(exc), None, b"", b"", 0.0, True)
        if self._proc is None:
            failed = self._start(bwrap)
            if failed is not None:
                return failed
        assert self._sock is not None
        owned: list[int] = []
        self._oom_before = self._oom_kills()
        start = time.monotonic()
        try:
            stdin_fd = memfd("stdin", stdin, owned)
            socket.send_fds(self._sock, [_frame(main.encode())], [stdin_fd])
        except OSError:
            return self._driver_ended(time.monotonic() - start)
        finally:
            for fd in owned:
                os.close(fd)
        deadline = start + self.limits.wall_s + DRIVER_SLACK_S
        reply = self._receive_frame(deadline)
        if reply is None:
            return self._no_answer(deadline, time.monotonic() - start)
        try:
            has_status, code, timed_out, overflow_code, wall, n_out, n_err = REPLY.unpack(reply)
            overflow = ("", "stdout", "stderr")[overflow_code]
            if not (n_out <= self.limits.output_bytes and n_err <= self.limits.output_bytes):
                raise ValueError(f"output sizes {n_out}, {n_err} over the cap")
        except (struct.error, IndexError, ValueError) as exc:
            self._stop(kill=True)
            return RunOutcome(
                Reason.SANDBOX_UNAVAILABLE, f"the sandbox driver answered {reply[:64]!r} ({exc})", None, b"", b"",
                time.monotonic() - start, True,
            )  # fmt: skip
        if not self._fill(n_out + n_err, deadline):
            return self._no_answer(deadline, time.monotonic() - start)
        stdout = bytes(self._buffer[:n_out])
        stderr = bytes(self._buffer[n_out : n_out + n_err])
        del self._buffer[: n_out + n_err]
        status = code if has_status else None
        capture = Capture(bytearray(stdout), bytearray(stderr), bytearray(), timed_out, overflow, exited=True)
        reason, detail = classify(status, capture, wall, self.limits, self._oom_kills() > self._oom_before)
        return RunOutcome(reason, detail, status, stdout, stderr, wall, True)

    def close(self) -> None:
        """End the sandbox: the driver sees the socket close and exits, and every process with it."""
        self._stop(kill=False)

    # -- internals ------------------------------------------------------------------------

    def _start(self, bwrap: str) -> RunOutcome | None:
        """Start bwrap with the driver as pid 1 (in the sandbox's cgroup, if any) and wait for its
        ``ready``; the failure, if any."""
        limits = self.limits
        try:
            cgroup = self.sandbox.new_cgroup(limits)
        except CgroupUnavailable as exc:
            return RunOutcome(Reason.SANDBOX_UNAVAILABLE, str(exc), None, b"", b"", 0.0, True)
        owned: list[int] = []
        driver = SandboxFile(DRIVER_FILE, self.sandbox.driver_source)
        start = time.monotonic()
        host_sock, driver_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        status_r = block_w = -1
        proc: subprocess.Popen[bytes] | None = None
        cgroup_error: str | None = None
        try:
            data_fds = self.sandbox._data_fds([*self.files, driver], owned)
            seccomp_fd = memfd("seccomp", build_filter(native_arch()), owned)
            passed = [driver_sock.fileno(), seccomp_fd, *(fd for fd, _ in data_fds)]
            cgroup_args: list[str] = []
            block_r = -1
            if cgroup is not None:  # bwrap names its sandbox on the status fd, then waits on the block fd
                status_r, status_w = os.pipe()
                block_r, block_w = os.pipe()
                owned += [status_w, block_r]
                passed += [status_w, block_r]
                cgroup_args = ["--json-status-fd", str(status_w)]
            argv = [
                *self.sandbox._bwrap_argv(bwrap, limits, data_fds, seccomp_fd, block_r),
                *cgroup_args,
                "--as-pid-1",  # the driver is init: no test can kill it
                "--",
                self.sandbox.python, "-I", "-S", f"{SANDBOX_DIR}/{DRIVER_FILE}",
                str(driver_sock.fileno()), repr(limits.wall_s), str(limits.output_bytes), WORK_DIR, self.sandbox.python,
                *prlimit_argv(self.sandbox.config.prlimit, limits),
            ]  # fmt: skip
            proc = self.sandbox._popen_bwrap(argv, subprocess.DEVNULL, subprocess.DEVNULL, passed)
            for fd in owned:
                os.close(fd)
            owned.clear()
            if cgroup is not None:
                cgroup_error = self.sandbox.release(proc, cgroup, status_r, block_w)
        except BaseException:
            host_sock.close()
            if proc is not None:
                kill_group(proc.pid)  # before its block fd closes, which would let it run outside the cgroup
                proc.wait()
                if proc.stderr is not None:
                    proc.stderr.close()
            for fd in (status_r, block_w):
                if fd >= 0:
                    os.close(fd)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            driver_sock.close()
            for fd in owned:
                os.close(fd)
        if block_w >= 0:
            os.close(block_w)  # released (or bwrap killed): the fd has done its work
        assert proc.stderr is not None
        self._cgroup, self._status_r = cgroup, status_r
        self._proc, self._sock = proc, host_sock
        self._pidfd = os.pidfd_open(proc.pid)
        self._buffer, self._stderr, self._eof = bytearray(), bytearray(), False
        self._selector = selectors.DefaultSelector()
        os.set_blocking(proc.stderr.fileno(), False)
        for fd in (host_sock.fileno(), proc.stderr.fileno(), self._pidfd):
            self._selector.register(fd, selectors.EVENT_READ)
        ready = self._receive_frame(start + DRIVER_START_S) if cgroup_error is None else None
        if ready == READY:
            return None
        status = self._stop(kill=True)
        if cgroup_error is not None:
            return RunOutcome(Reason.SANDBOX_UNAVAILABLE, cgroup_error, status, b"", b"", time.monotonic() - start, True)
        message = escape_controls(bytes(self._stderr).decode("utf-8", "replace").strip()[-STDERR_SHOWN:])
        if ready is None and status is not None and status < 0 and not message:
            message = f"no answer from the sandbox driver within {DRIVER_START_S} s"
        return RunOutcome(
            Reason.SANDBOX_UNAVAILABLE,
            f"bubblewrap could not start the sandbox (exit status {status}): {message or 'no message'}",
            status, b"", b"", time.monotonic() - start, True,
        )  # fmt: skip

    def _receive_frame(self, deadline: float) -> bytes | None:
        """The next frame from the driver, or None (no answer by ``deadline``, or the driver ended)."""
        if not self._fill(4, deadline):
            return None
        length = int.from_bytes(self._buffer[:4], "big")
        if length > _MAX_FRAME or not self._fill(4 + length, deadline):
            return None
        payload = bytes(self._buffer[4 : 4 + length])
        del self._buffer[: 4 + length]
        return payload

    def _fill(self, size: int, deadline: float) -> bool:
        """Read from the driver until ``size`` bytes are buffered; False at the deadline or its end.
        bwrap's stderr (the driver's own errors) is kept, its last _STDERR_KEPT bytes."""
        assert self._sock is not None and self._selector is not None and self._proc is not None
        stderr = self._proc.stderr
        assert stderr is not None
        while len(self._buffer) < size:
            if self._eof:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in self._selector.select(left):
                fd = int(key.fd)
                if fd == self._sock.fileno():
                    chunk = self._sock.recv(READ_CHUNK)
                    if not chunk:
                        self._eof = True
                    self._buffer += chunk
                elif fd == self._pidfd:
                    self._selector.unregister(fd)  # bwrap ended: read what the socket still holds
                else:
                    chunk = os.read(fd, READ_CHUNK)
                    if not chunk:
                        self._selector.unregister(fd)
                    self._stderr += chunk
                    del self._stderr[:-_STDERR_KEPT]
        return True

    def _no_answer(self, deadline: float, wall_s: float) -> RunOutcome:
        """The outcome of a test the driver did not answer: a timeout when the deadline passed
        (the sandbox is killed; the next run starts another), else the driver ended."""
        if not self._eof and time.monotonic() >= deadline:
            self._stop(kill=True)
            return RunOutcome(
                Reason.TIMEOUT, f"wall time limit of {self.limits.wall_s} s exceeded; sandbox killed", None, b"", b"",
                wall_s, True,
            )  # fmt: skip
        return self._driver_ended(wall_s)

    def _driver_ended(self, wall_s: float) -> RunOutcome:
        oom_killed = self._oom_kills() > self._oom_before
        status = self._stop(kill=True)
        if oom_killed:
            return RunOutcome(
                Reason.MEMORY,
                f"memory limit of {self.limits.memory_mb} MiB for the whole sandbox (its cgroup's memory limit): the OOM "
                "killer ended the sandbox's driver; sandbox killed", status, b"", b"", wall_s, True,
            )  # fmt: skip
        message = escape_controls(bytes(self._stderr).decode("utf-8", "replace").strip()[-STDERR_SHOWN:])
        return RunOutcome(
            Reason.SANDBOX_UNAVAILABLE,
            f"the sandbox driver ended unexpectedly (bwrap exit status {status}): {message or 'no message'}",
            status, b"", b"", wall_s, True,
        )  # fmt: skip

    def _stop(self, kill: bool) -> int | None:
        """Close the socket (the driver exits), SIGKILL bwrap's group if ``kill`` or if it does not
        end within _STOP_WAIT_S; bwrap's exit status (None when no sandbox was running)."""
        proc = self._proc
        if proc is None:
            return None
        if self._sock is not None:
            self._sock.close()
        if kill:
            kill_group(proc.pid)
        try:
            status = proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            status = proc.wait()
        if self._selector is not None:
            self._selector.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
        if proc.stderr is not None:
            proc.stderr.close()
        if self._status_r >= 0:
            os.close(self._status_r)
        if self._cgroup is not None:
            self._cgroup.remove()
        self._proc, self._sock, self._selector, self._pidfd = None, None, None, -1
        self._cgroup, self._status_r = None, -1
        return status

    def _oom_kills(self) -> int:
        """OOM kills in the sandbox's cgroup so far (0 without one)."""
        return self._cgroup.oom_kills() if self._cgroup is not None else 0


def _frame(payload: bytes) -> bytes:
    """A driver protocol frame: 4-byte big-endian length, then the payload (sandbox_driver.py)."""
    return len(payload).to_bytes(4, "big") + payload
