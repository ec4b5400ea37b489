"""Run untrusted Python inside bubblewrap with resource limits.

Isolation: new user, pid, network, ipc, uts and cgroup namespaces, no capabilities, a fresh
root with read-only ``/usr`` and the program files (memfds: nothing written on the host), two
private size-capped tmpfs (``/tmp``, ``/dev/shm``) as the only writable places, loopback-only
networking, an allow-listed environment (``environ.py``) and a seccomp deny-list
(``seccomp.py``). Limits: ``prlimit`` sets RLIMIT_CPU/AS/NPROC/NOFILE/FSIZE (no core dumps)
inside the sandbox's user namespace, so a fork bomb stops at ``limits.nproc``; wall time and
output are capped here by killing the whole sandbox. Where cgroup v2, or else cgroup v1,
allows it, each sandbox also gets a cgroup of its own (memory, pids and CPU bandwidth over all
its processes, decided once per pool: ``sandbox_cgroup.py``, ``Sandbox.caps``); without one,
memory is bounded only per process, by ``nproc * memory_mb`` plus the tmpfs in all
(``reward.code.require_cgroup`` refuses code then).
:class:`~asyncrl.tasks.reward.sandbox_session.SandboxSession` runs one program's tests in one sandbox (``sandbox_driver.py``).
What each measure stops, and why: ``docs/internals/reward.md``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward.environ import SANDBOX_ENV, sandbox_setenv_args
from asyncrl.tasks.reward.sandbox_cgroup import SandboxCaps, decide_caps, release_into
from asyncrl.tasks.reward.sandbox_cgroup_fs import CgroupUnavailable, SandboxCgroup
from asyncrl.tasks.reward.seccomp import SeccompUnsupported, build_filter, native_arch
from asyncrl.tasks.reward.types import Reason
from asyncrl.tasks.reward.sandbox_outcome import (
    RunOutcome,
    STDERR_SHOWN,
    SandboxFile,
    SandboxUnavailable,
    classify,
    escape_controls,
)
from asyncrl.tasks.reward.sandbox_process import (
    SANDBOX_DIR,
    SHM_DIR,
    WORK_DIR,
    apply_rlimits,
    json_lines,
    kill_group,
    memfd,
    prlimit_argv,
    supervise,
    system_dir_args,
)

INSTALL_HINT = "install it with `apt-get install bubblewrap`"
PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
# bwrap's --dev binds these host devices (and fails, naming only the first, if one is missing).
DEV_NODES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))


class Sandbox:
    """Runs ``python3 /sandbox/<main>`` with the given files and stdin, isolated and limited."""

    def __init__(self, config: CodeRewardConfig) -> None:
        self.config = config
        self._bwrap = shutil.which(config.bwrap)
        self.python = config.python or next((p for p in PYTHON_CANDIDATES if os.access(p, os.X_OK)), PYTHON_CANDIDATES[0])
        self.driver_source = Path(__file__).with_name("sandbox_driver.py").read_bytes()
        """The source of the driver a session runs inside its sandbox."""
        self.caps: SandboxCaps = decide_caps(config, sandboxed=self._bwrap is not None)
        """A cgroup per sandbox (``caps.parents``) or the rlimits alone (``caps.reason``); a pool
        decides once and hands its workers the decision (``SandboxCaps.for_workers``)."""

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
        refusal = self.caps.refusal(self.config)
        if refusal is not None:
            raise SandboxUnavailable(refusal)

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
        try:
            cgroup = self.new_cgroup(limits)
        except CgroupUnavailable as exc:
            return RunOutcome(Reason.SANDBOX_UNAVAILABLE, str(exc), None, b"", b"", 0.0, True)
        owned: list[int] = []
        proc: subprocess.Popen[bytes] | None = None
        released = cgroup is None
        try:
            stdin_fd = memfd("stdin", stdin, owned)
            data_fds = self._data_fds(files, owned)
            seccomp_fd = memfd("seccomp", build_filter(native_arch()), owned)
            status_r, status_w = os.pipe()
            owned += [status_r, status_w]
            block_r, block_w = os.pipe() if cgroup is not None else (-1, -1)
            owned += [fd for fd in (block_r, block_w) if fd >= 0]
            argv = [
                *self._bwrap_argv(bwrap, limits, data_fds, seccomp_fd, block_r),
                "--json-status-fd", str(status_w),
                "--",
                *prlimit_argv(self.config.prlimit, limits),
                self.python, "-I", f"{SANDBOX_DIR}/{main}",
            ]  # fmt: skip
            start = time.monotonic()
            passed = [status_w, seccomp_fd, *(fd for fd, _ in data_fds), *([block_r] if block_r >= 0 else [])]
            proc = self._popen_bwrap(argv, stdin_fd, subprocess.PIPE, passed)
            for fd in (status_w, block_r):
                if fd >= 0:
                    os.close(fd)
                    owned.remove(fd)
            cgroup_error = None
            if cgroup is not None:
                cgroup_error = self.release(proc, cgroup, status_r, block_w)
                released = True
            capture, status = supervise(proc, status_r, limits, start, kill_group_on_exit=False)
            wall = time.monotonic() - start
            oom_killed = cgroup is not None and cgroup.oom_kills() > 0
        finally:
            if proc is not None and not released:
                kill_group(proc.pid)  # before its block fd closes, which would let it run outside the cgroup
            for fd in owned:
                os.close(fd)
            if cgroup is not None:
                cgroup.remove()
        if cgroup_error is not None:
            return RunOutcome(Reason.SANDBOX_UNAVAILABLE, cgroup_error, status, b"", b"", wall, True)
        statuses = json_lines(bytes(capture.status))
        ran = any("exit-code" in s for s in statuses)
        if not ran and not capture.timed_out and not capture.overflow:
            message = escape_controls(bytes(capture.stderr).decode("utf-8", "replace").strip()[-STDERR_SHOWN:])
            return RunOutcome(
                Reason.SANDBOX_UNAVAILABLE,
                f"bubblewrap could not start the sandbox (exit status {status}): {message or 'no message'}",
                status, bytes(capture.stdout), bytes(capture.stderr), wall, True,
            )  # fmt: skip
        reason, detail = classify(status, capture, wall, limits, oom_killed)
        return RunOutcome(reason, detail, status, bytes(capture.stdout), bytes(capture.stderr), wall, True)

    def new_cgroup(self, limits: SandboxLimits) -> SandboxCgroup | None:
        """A cgroup with ``limits`` for one sandbox when ``caps`` says so, else None;
        ``CgroupUnavailable`` when it cannot be made."""
        return self.caps.new_cgroup(limits) if self.caps.cgroup else None

    def release(self, proc: subprocess.Popen[bytes], cgroup: SandboxCgroup, status_r: int, block_w: int) -> str | None:
        """Move bwrap's sandbox into ``cgroup`` and let it run (``release_into``); the error, if
        any, with bwrap killed first. A bwrap that ended or hung before naming its sandbox is
        killed too: the caller reports its failure to start."""
        try:
            if release_into(cgroup, status_r, block_w):
                return None
            kill_group(proc.pid)
            return None
        except CgroupUnavailable as exc:
            kill_group(proc.pid)
            return str(exc)

    def _data_fds(self, files: Sequence[SandboxFile], owned: list[int]) -> list[tuple[int, str]]:
        """memfds of ``/etc/passwd``, ``/etc/group`` and the files, with where each goes."""
        uid = self.config.sandbox_uid
        etc = {
            "passwd": f"sandbox:x:{uid}:{uid}:sandbox:{WORK_DIR}:/usr/sbin/nologin\n".encode(),
            "group": f"sandbox:x:{uid}:\n".encode(),
        }
        data_fds = [(memfd(name, content, owned), f"/etc/{name}") for name, content in etc.items()]
        data_fds += [(memfd(f.name, f.content, owned), f"{SANDBOX_DIR}/{f.name}") for f in files]
        return data_fds

    def _bwrap_argv(
        self, bwrap: str, limits: SandboxLimits, data_fds: Sequence[tuple[int, str]], seccomp_fd: int, block_fd: int = -1
    ) -> list[str]:
        """bwrap's options up to (not including) the status fd and the command (module docstring);
        with ``block_fd`` (>= 0) the sandbox waits for a byte on it before anything runs (``release``)."""
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
            *system_dir_args(),
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
        if block_fd >= 0:
            argv += ["--block-fd", str(block_fd)]
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
                stdin_fd = memfd("stdin", stdin, owned)
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
                    preexec_fn=lambda: apply_rlimits(limits),  # the worker is single-threaded
                )
                capture, status = supervise(proc, status_r, limits, start, kill_group_on_exit=True)
                wall = time.monotonic() - start
            finally:
                for fd in owned:
                    os.close(fd)
        reason, detail = classify(status, capture, wall, limits)
        return RunOutcome(reason, detail, status, bytes(capture.stdout), bytes(capture.stderr), wall, False)


