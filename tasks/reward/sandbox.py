"""Run untrusted Python inside bubblewrap with resource limits.

Isolation: new user, pid, network, ipc, uts and cgroup namespaces, no capabilities, a fresh
root with read-only ``/usr`` and the program files (memfds: nothing written on the host), two
private size-capped tmpfs (``/tmp``, ``/dev/shm``) as the only writable places, loopback-only
networking, an allow-listed environment (``environ.py``) and a seccomp deny-list
(``seccomp.py``). Limits: ``prlimit`` sets RLIMIT_CPU/AS/NPROC/NOFILE/FSIZE (no core dumps)
inside the sandbox's user namespace, so a fork bomb stops at ``limits.nproc`` and memory is
bounded by ``nproc * memory_mb`` plus the tmpfs; wall time and output are capped here by
killing the whole sandbox. No cgroup is assumed, so these rlimits are the caps everywhere.
``Sandbox.session`` runs one program's tests in one sandbox (``sandbox_driver.py``).
What each measure stops, and why: ``docs/internals/reward.md``.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward.environ import SANDBOX_ENV, SANDBOX_HOME, sandbox_setenv_args
from asyncrl.tasks.reward.sandbox_driver import READY, REPLY
from asyncrl.tasks.reward.seccomp import SeccompUnsupported, build_filter, native_arch
from asyncrl.tasks.reward.types import Reason

SANDBOX_DIR = "/sandbox"
WORK_DIR = SANDBOX_HOME
SHM_DIR = "/dev/shm"
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_READ_CHUNK = 65536
_STDERR_SHOWN = 600
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
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
PROCESS_MARKERS = ("BlockingIOError: [Errno 11]", "can't start new thread", "Resource temporarily unavailable")
# Python ignores SIGXFSZ, so an over-size write fails with EFBIG; a full /tmp with ENOSPC.
FILE_MARKERS = ("[Errno 27] File too large", "[Errno 28] No space left on device")
INSTALL_HINT = "install it with `apt-get install bubblewrap`"
# C0 controls but newline and tab, DEL and the C1 controls (U+0080..U+009F: CSI, OSC...).
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
# bwrap's --dev binds these host devices (and fails, naming only the first, if one is missing).
DEV_NODES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))


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
class _Capture:
    stdout: bytearray
    stderr: bytearray
    status: bytearray
    timed_out: bool = False
    overflow: str = ""
    exited: bool = False


class Sandbox:
    """Runs ``python3 /sandbox/<main>`` with the given files and stdin, isolated and limited."""

    def __init__(self, config: CodeRewardConfig) -> None:
        self.config = config
        self._bwrap = shutil.which(config.bwrap)
        self.python = config.python or next((p for p in PYTHON_CANDIDATES if os.access(p, os.X_OK)), PYTHON_CANDIDATES[0])
        self.driver_source = Path(__file__).with_name("sandbox_driver.py").read_bytes()
        """The source of the driver a session runs inside its sandbox."""

    @property
    def sandboxed(self) -> bool:
        """True when runs go through bubblewrap, False in the explicitly allowed unsandboxed mode."""
        return self._bwrap is not None

    def check(self) -> None:
        """Raise SandboxUnavailable, with what to do, when programs cannot be run as configured."""
        if self._bwrap is None:
            if not self.config.allow_unsandboxed:
                raise SandboxUnavailable(
                    f"bubblewrap ({self.config.bwrap!r}) not found: refusing to run model-written code; "
                    f"{INSTALL_HINT}, or set code.allow_unsandboxed=true to run it on the host "
                    "WITHOUT isolation (rlimits only)"
                )
        needed = [("code.python", self.python)]
        if self._bwrap is not None:
            needed.append(("code.prlimit", self.config.prlimit))
        for label, path in needed:
            if not os.access(path, os.X_OK):
                raise SandboxUnavailable(f"{label}: {path!r} is not an executable file")
        if self._bwrap is not None:
            missing = [(name, major, minor) for name, major, minor in DEV_NODES if not os.path.exists(f"/dev/{name}")]
            if missing:
                recreate = "; ".join(f"mknod -m 666 /dev/{name} c {major} {minor}" for name, major, minor in missing)
                raise SandboxUnavailable(
                    f"host device(s) {', '.join(f'/dev/{name}' for name, _, _ in missing)} missing: bubblewrap's "
                    f"--dev needs them in the sandbox's /dev; recreate as root: {recreate}"
                )
            try:
                native_arch()
            except SeccompUnsupported as exc:
                raise SandboxUnavailable(str(exc)) from exc
            resolved = os.path.realpath(self.python)
            if not resolved.startswith("/usr/"):
                raise SandboxUnavailable(
                    f"code.python: {self.python!r} resolves to {resolved!r}, outside /usr, "
                    "the only system tree mounted in the sandbox"
                )

    def run(
        self, files: Sequence[SandboxFile], main: str, stdin: bytes = b"", limits: SandboxLimits | None = None
    ) -> RunOutcome:
        """Run ``main`` (one of ``files``) with ``stdin``; never raises for what the program does.

        ``limits`` replaces ``config.limits`` for this run (a problem's own, tighter time limit).
        """
        if main not in {f.name for f in files}:
            raise ValueError(f"Sandbox.run: main file {main!r} is not among {[f.name for f in files]}")
        try:
            self.check()
        except SandboxUnavailable as exc:
            return RunOutcome(Reason.SANDBOX_UNAVAILABLE, str(exc), None, b"", b"", 0.0, self.sandboxed)
        limits = limits if limits is not None else self.config.limits
        if self._bwrap is not None:
            return self._run_bwrap(self._bwrap, files, main, stdin, limits)
        return self._run_unsandboxed(files, main, stdin, limits)

    # -- bubblewrap --------------------------------------------------------------------

    def _run_bwrap(
        self, bwrap: str, files: Sequence[SandboxFile], main: str, stdin: bytes, limits: SandboxLimits
    ) -> RunOutcome:
        owned: list[int] = []
        try:
            stdin_fd = _memfd("stdin", stdin, owned)
            data_fds = self._data_fds(files, owned)
            seccomp_fd = _memfd("seccomp", build_filter(native_arch()), owned)
            status_r, status_w = os.pipe()
            owned += [status_r, status_w]
            argv = [
                *self._bwrap_argv(bwrap, limits, data_fds, seccomp_fd),
                "--json-status-fd", str(status_w),
                "--",
                *_prlimit_argv(self.config.prlimit, limits),
                self.python, "-I", f"{SANDBOX_DIR}/{main}",
            ]  # fmt: skip
            start = time.monotonic()
            proc = self._popen_bwrap(
                argv, stdin_fd, subprocess.PIPE, [status_w, seccomp_fd, *(fd for fd, _ in data_fds)]
            )
            os.close(status_w)
            owned.remove(status_w)
            capture, status = _supervise(proc, status_r, limits, start, kill_group_on_exit=False)
            wall = time.monotonic() - start
        finally:
            for fd in owned:
                os.close(fd)
        statuses = _json_lines(bytes(capture.status))
        ran = any("exit-code" in s for s in statuses)
        if not ran and not capture.timed_out and not capture.overflow:
            message = escape_controls(bytes(capture.stderr).decode("utf-8", "replace").strip()[-_STDERR_SHOWN:])
            return RunOutcome(
                Reason.SANDBOX_UNAVAILABLE,
                f"bubblewrap could not start the sandbox (exit status {status}): {message or 'no message'}",
                status, bytes(capture.stdout), bytes(capture.stderr), wall, True,
            )  # fmt: skip
        reason, detail = classify(status, capture, wall, limits)
        return RunOutcome(reason, detail, status, bytes(capture.stdout), bytes(capture.stderr), wall, True)

    def _data_fds(self, files: Sequence[SandboxFile], owned: list[int]) -> list[tuple[int, str]]:
        """memfds of ``/etc/passwd``, ``/etc/group`` and the files, with where each goes."""
        uid = self.config.sandbox_uid
        etc = {
            "passwd": f"sandbox:x:{uid}:{uid}:sandbox:{WORK_DIR}:/usr/sbin/nologin\n".encode(),
            "group": f"sandbox:x:{uid}:\n".encode(),
        }
        data_fds = [(_memfd(name, content, owned), f"/etc/{name}") for name, content in etc.items()]
        data_fds += [(_memfd(f.name, f.content, owned), f"{SANDBOX_DIR}/{f.name}") for f in files]
        return data_fds

    def _bwrap_argv(
        self, bwrap: str, limits: SandboxLimits, data_fds: Sequence[tuple[int, str]], seccomp_fd: int
    ) -> list[str]:
        """bwrap's options up to (not including) the status fd and the command (module docstring)."""
        uid = self.config.sandbox_uid
        argv = [
            bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--cap-drop", "ALL",
            "--uid", str(uid),
            "--gid", str(uid),
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
            *_system_dir_args(),
            "--proc", "/proc",
            "--dev", "/dev",
            "--remount-ro", "/dev",  # not recursive: /dev/pts and the tmpfs below stay as they are
            "--size", str(limits.tmpfs_mb << 20),
            "--tmpfs", SHM_DIR,
            "--size", str(limits.tmpfs_mb << 20),
            "--tmpfs", WORK_DIR,
            "--dir", "/etc",
            "--dir", SANDBOX_DIR,
        ]  # fmt: skip
        for fd, dest in data_fds:
            argv += ["--perms", "0444", "--ro-bind-data", str(fd), dest]
        argv += ["--remount-ro", "/", "--chdir", WORK_DIR, *sandbox_setenv_args(), "--seccomp", str(seccomp_fd)]
        return argv

    def _popen_bwrap(self, argv: list[str], stdin: int, stdout: int, pass_fds: Sequence[int]) -> subprocess.Popen[bytes]:
        """Start bwrap in its own process group with SANDBOX_ENV only; as ``sandbox_uid`` when we
        are root (root is exempt from RLIMIT_NPROC)."""
        uid = self.config.sandbox_uid
        as_root = os.geteuid() == 0
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.PIPE,
            env=dict(SANDBOX_ENV),  # bwrap (or the driver) is pid 1 inside: its environ may be readable there
            pass_fds=list(pass_fds),
            process_group=0,
            user=uid if as_root else None,
            group=uid if as_root else None,
            extra_groups=[] if as_root else None,
        )

    # -- one sandbox for every test of a program -------------------------------------------

    def session(self, files: Sequence[SandboxFile], limits: SandboxLimits | None = None) -> SandboxSession:
        """A sandbox holding ``files`` in which to run the tests of ONE program one after the
        other (``SandboxSession.run``), each as its own process with ``limits`` (default
        ``config.limits``); see ``sandbox_driver.py``. Needs bubblewrap: in the unsandboxed mode
        each run is a separate ``run()``. Use as a context manager."""
        return SandboxSession(self, files, limits if limits is not None else self.config.limits)

    # -- explicitly allowed unsandboxed mode ---------------------------------------------

    def _run_unsandboxed(
        self, files: Sequence[SandboxFile], main: str, stdin: bytes, limits: SandboxLimits
    ) -> RunOutcome:
        """rlimits, a temporary working directory and a new session only: NOT isolation."""
        with tempfile.TemporaryDirectory(prefix="asyncrl-unsandboxed-") as work:
            for f in files:
                Path(work, f.name).write_bytes(f.content)
            owned: list[int] = []
            try:
                stdin_fd = _memfd("stdin", stdin, owned)
                status_r, status_w = os.pipe()
                os.close(status_w)  # no status channel without bwrap
                owned.append(status_r)
                start = time.monotonic()
                proc = subprocess.Popen(
                    [self.python, "-I", str(Path(work, main))],
                    stdin=stdin_fd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=work,
                    env={**SANDBOX_ENV, "HOME": work, "TMPDIR": work},
                    start_new_session=True,
                    preexec_fn=lambda: _apply_rlimits(limits),  # the worker is single-threaded
                )
                capture, status = _supervise(proc, status_r, limits, start, kill_group_on_exit=True)
                wall = time.monotonic() - start
            finally:
                for fd in owned:
                    os.close(fd)
        reason, detail = classify(status, capture, wall, limits)
        return RunOutcome(reason, detail, status, bytes(capture.stdout), bytes(capture.stderr), wall, False)


class SandboxSession:
    """One bubblewrap sandbox in which the tests of ONE program run one after the other.

    The sandbox is the one ``Sandbox.run`` builds (same namespaces, file system, seccomp
    filter, environment, uid), holding the program's files and the driver
    (``sandbox_driver.py``), which runs as its pid 1 and starts each test as its own process
    with the per-test limits (rlimits through prlimit, wall time, output caps), kills whatever
    the test left behind before answering, and reports how it ended. The outcome of a test is
    classified here by ``classify`` exactly as a one-test run's is, so the reasons are the same.

    The host watches the driver too: a test that gets no answer within ``limits.wall_s`` +
    DRIVER_SLACK_S is a timeout and the whole sandbox is killed; the next ``run`` starts a fresh
    sandbox. A sandbox that does not start (no ``ready`` from the driver within
    DRIVER_START_S), or a driver that ends unexpectedly, gives ``sandbox_unavailable``.
    The sandbox starts on the first ``run`` and ends on ``close`` (or at the end of a with-block).
    """

    def __init__(self, sandbox: Sandbox, files: Sequence[SandboxFile], limits: SandboxLimits) -> None:
        if DRIVER_FILE in {f.name for f in files}:
            raise ValueError(f"SandboxSession: {DRIVER_FILE!r} is the driver's file name")
        self.sandbox = sandbox
        self.files = list(files)
        self.limits = limits
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._pidfd = -1
        self._buffer = bytearray()
        self._stderr = bytearray()
        self._eof = False

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
        start = time.monotonic()
        try:
            stdin_fd = _memfd("stdin", stdin, owned)
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
        capture = _Capture(bytearray(stdout), bytearray(stderr), bytearray(), timed_out, overflow, exited=True)
        reason, detail = classify(status, capture, wall, self.limits)
        return RunOutcome(reason, detail, status, stdout, stderr, wall, True)

    def close(self) -> None:
        """End the sandbox: the driver sees the socket close and exits, and every process with it."""
        self._stop(kill=False)

    # -- internals ------------------------------------------------------------------------

    def _start(self, bwrap: str) -> RunOutcome | None:
        """Start bwrap with the driver as pid 1 and wait for its ``ready``; the failure, if any."""
        limits = self.limits
        owned: list[int] = []
        driver = SandboxFile(DRIVER_FILE, self.sandbox.driver_source)
        start = time.monotonic()
        host_sock, driver_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            data_fds = self.sandbox._data_fds([*self.files, driver], owned)
            seccomp_fd = _memfd("seccomp", build_filter(native_arch()), owned)
            argv = [
                *self.sandbox._bwrap_argv(bwrap, limits, data_fds, seccomp_fd),
                "--as-pid-1",  # the driver is init: no test can kill it
                "--",
                self.sandbox.python, "-I", "-S", f"{SANDBOX_DIR}/{DRIVER_FILE}",
                str(driver_sock.fileno()), repr(limits.wall_s), str(limits.output_bytes), WORK_DIR, self.sandbox.python,
                *_prlimit_argv(self.sandbox.config.prlimit, limits),
            ]  # fmt: skip
            proc = self.sandbox._popen_bwrap(
                argv, subprocess.DEVNULL, subprocess.DEVNULL, [driver_sock.fileno(), seccomp_fd, *(fd for fd, _ in data_fds)]
            )
        except BaseException:
            host_sock.close()
            raise
        finally:
            driver_sock.close()
            for fd in owned:
                os.close(fd)
        assert proc.stderr is not None
        self._proc, self._sock = proc, host_sock
        self._pidfd = os.pidfd_open(proc.pid)
        self._buffer, self._stderr, self._eof = bytearray(), bytearray(), False
        self._selector = selectors.DefaultSelector()
        os.set_blocking(proc.stderr.fileno(), False)
        for fd in (host_sock.fileno(), proc.stderr.fileno(), self._pidfd):
            self._selector.register(fd, selectors.EVENT_READ)
        ready = self._receive_frame(start + DRIVER_START_S)
        if ready == READY:
            return None
        status = self._stop(kill=True)
        message = escape_controls(bytes(self._stderr).decode("utf-8", "replace").strip()[-_STDERR_SHOWN:])
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
                    chunk = self._sock.recv(_READ_CHUNK)
                    if not chunk:
                        self._eof = True
                    self._buffer += chunk
                elif fd == self._pidfd:
                    self._selector.unregister(fd)  # bwrap ended: read what the socket still holds
                else:
                    chunk = os.read(fd, _READ_CHUNK)
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
        status = self._stop(kill=True)
        message = escape_controls(bytes(self._stderr).decode("utf-8", "replace").strip()[-_STDERR_SHOWN:])
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
            _kill_group(proc.pid)
        try:
            status = proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            status = proc.wait()
        if self._selector is not None:
            self._selector.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
        if proc.stderr is not None:
            proc.stderr.close()
        self._proc, self._sock, self._selector, self._pidfd = None, None, None, -1
        return status


def _frame(payload: bytes) -> bytes:
    """A driver protocol frame: 4-byte big-endian length, then the payload (sandbox_driver.py)."""
    return len(payload).to_bytes(4, "big") + payload


def classify(exit_code: int | None, capture: _Capture, wall_s: float, limits: SandboxLimits) -> tuple[Reason, str]:
    """The failure reason of a finished run (OK for status 0 within every limit).

    In order: wall-time kill -> timeout; output cap -> output_limit; SIGXCPU, or a
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
    tail = escape_controls(bytes(capture.stderr[-_STDERR_SHOWN:]).decode("utf-8", "replace").strip())
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


def _supervise(
    proc: subprocess.Popen[bytes], status_r: int, limits: SandboxLimits, start: float, kill_group_on_exit: bool
) -> tuple[_Capture, int | None]:
    """Read stdout/stderr/status until the process exits, killing its group on a limit.

    Returns the capture and the exit status (negative: killed by that signal).
    """
    assert proc.stdout is not None and proc.stderr is not None
    capture = _Capture(bytearray(), bytearray(), bytearray())
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
                _kill_group(proc.pid)
                break
            for key, _ in selector.select(left):
                fd = int(key.fd)
                if fd == pidfd:
                    capture.exited = True
                    selector.unregister(pidfd)
                    if kill_group_on_exit:
                        _kill_group(proc.pid)  # children left behind would hold the pipes open
                    continue
                name, buffer = streams[fd]
                chunk = os.read(fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(fd)
                    continue
                buffer += chunk
                if name != "status" and len(buffer) > limits.output_bytes:
                    del buffer[limits.output_bytes :]
                    capture.overflow = name
                    _kill_group(proc.pid)
            if capture.overflow:
                break
        proc.wait()
    finally:
        selector.close()
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    return capture, proc.returncode


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group; with bwrap its pid namespace, and every process in it, dies too."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _signal_of(exit_code: int | None) -> int:
    """The signal that ended the program: negative status (killed directly) or 128 + s (via bwrap)."""
    if exit_code is None:
        return 0
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 128 + signal.NSIG:
        return exit_code - 128
    return 0


def _system_dir_args() -> list[str]:
    """Mirror the host's /bin, /lib*... : a symlink stays a symlink (into /usr), a real dir is bound read-only."""
    args: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _prlimit_argv(prlimit: str, limits: SandboxLimits) -> list[str]:
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


def _apply_rlimits(limits: SandboxLimits) -> None:
    """The unsandboxed mode's limits. No RLIMIT_NPROC: outside a user namespace it would count
    every process of the host user (and root is exempt anyway)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.fsize_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _memfd(name: str, content: bytes, owned: list[int]) -> int:
    """An anonymous in-memory file holding ``content``, positioned at its start."""
    fd = os.memfd_create(f"asyncrl-{name}")
    owned.append(fd)
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _json_lines(data: bytes) -> list[dict[str, object]]:
    """bwrap's --json-status-fd output: one JSON object per line."""
    out: list[dict[str, object]] = []
    for line in data.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line:
            out.append(json.loads(line))
    return out


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
