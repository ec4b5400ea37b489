"""The driver that runs every test of ONE program inside ONE sandbox (``SandboxSession``).

Copied into the sandbox and run there as the pid namespace's init (``bwrap --as-pid-1``)
under the system interpreter (``python -I -S``), so it imports only builtin modules and
needs Python >= 3.7. Arguments: ``FD WALL_S OUTPUT_BYTES WORKDIR PYTHON PRLIMIT_ARGV...``.
Over the Unix socket FD it serves one test at a time (frames of a 4-byte big-endian length
and that many bytes: ``ready``; per test a file name with its stdin memfd, answered by a
``REPLY`` struct and the output bytes). Each test is its own child with the one-test
sandbox's limits, and every process it leaves is killed and reaped before the answer, so no
test outlives itself. Tests cannot reach the driver's channel, and expected outputs never
enter the sandbox. Protocol in full: ``docs/internals/reward.md``.
"""

from __future__ import annotations

import _signal
import _socket
import os
import select
import struct
import sys
import time

REPLY = struct.Struct(">?i?BdII")
"""has_status, status (exit status, or minus the killing signal), timed_out, overflow, wall_s,
stdout size, stderr size."""
READY = b"ready"
_PR_SET_DUMPABLE = 4
_CHUNK = 65536
_MAX_FRAME = 1 << 16
_OVERFLOW = {"": 0, "stdout": 1, "stderr": 2}


def main(argv: list[str]) -> int:
    """Serve tests until the host closes the socket (exit status 0); see the module docstring."""
    if len(argv) < 6:
        os.write(2, b"usage: driver.py FD WALL_S OUTPUT_BYTES WORKDIR PYTHON PRLIMIT_ARGV...\n")
        return 2
    fd, wall_s, output_bytes, workdir, python = int(argv[0]), float(argv[1]), int(argv[2]), argv[3], argv[4]
    prlimit_argv = argv[5:]
    _protect_self()
    os.set_inheritable(fd, False)
    conn = _socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()  # non-inheritable, as every descriptor Python opens
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    _signal.set_wakeup_fd(wake_w)
    _signal.signal(_signal.SIGCHLD, _ignore)  # only wakes the poll (set_wakeup_fd)
    _send_frame(conn, READY)
    while True:
        request = _recv_frame(conn)
        if request is None:
            return 0
        name, fds = request
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            os.write(2, b"driver: a request carries exactly one stdin descriptor\n")
            return 3
        argv_test = [*prlimit_argv, python, "-I", "/sandbox/" + name.decode()]
        reply, stdout, stderr = _run_test(argv_test, workdir, fds[0], wall_s, output_bytes, wake_r)
        _send_frame(conn, reply)
        conn.sendall(stdout)
        conn.sendall(stderr)


def _ignore(signum: int, frame: object) -> None:
    """SIGCHLD's handler: the signal only has to wake the poll."""


def _protect_self() -> None:
    """Not dumpable (``/proc/1/*`` closed to the tests); SIGPIPE ignored (a closed host socket
    is an EPIPE, not a death). Every other signal keeps init's default: dropped."""
    import ctypes  # only here: its import is most of the driver's start-up

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    for signum in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGUSR1, _signal.SIGUSR2):
        _signal.signal(signum, _signal.SIG_DFL)
    _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)


def _run_test(
    argv: list[str], workdir: str, stdin_fd: int, wall_s: float, output_bytes: int, wake_r: int
) -> tuple[bytes, bytes, bytes]:
    """Run one test and supervise it; returns (the REPLY frame, stdout, stderr).

    As the host's one-test supervision: past ``wall_s`` from the start -> timed out; more than
    ``output_bytes`` on stdout or stderr -> overflow (named), the output cut at the cap; either
    kills every process of the sandbox at once. When the main process exits, the others are
    killed too and the pipes read to their end (within the wall time).
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the test: stdio on fds 0-2, nothing else open after exec
        try:
            _signal.set_wakeup_fd(-1)
            _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
            os.dup2(stdin_fd, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.chdir(workdir)
            os.execv(argv[0], argv)
        finally:
            os.write(2, f"driver: cannot run {argv[0]}\n".encode())
            os._exit(127)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    buffers = {out_r: bytearray(), err_r: bytearray()}
    names = {out_r: "stdout", err_r: "stderr"}
    poller = select.poll()
    for fd in (out_r, err_r, wake_r):
        poller.register(fd, select.POLLIN)
    deadline = start + wall_s
    status: int | None = None
    timed_out = False
    overflow = ""
    open_fds = {out_r, err_r}
    try:
        while open_fds or status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for fd, _ in poller.poll(max(1, int(left * 1000 + 0.999))):
                if fd == wake_r:
                    _drain(wake_r)
                    continue
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    continue
                buffer = buffers[fd]
                buffer += chunk
                if len(buffer) > output_bytes:
                    del buffer[output_bytes:]
                    overflow = names[fd]
            if overflow:
                break
            if status is None:
                status = _reap(pid)
                if status is not None:
                    _kill_all()  # the program ended: so does every process it left behind
    finally:
        _kill_all()
        wall = time.monotonic() - start
        final = _reap_all(pid)
        if status is None:
            status = final
        os.close(out_r)
        os.close(err_r)
    reply = REPLY.pack(
        status is not None, status or 0, timed_out, _OVERFLOW[overflow], wall, len(buffers[out_r]), len(buffers[err_r])
    )
    return reply, bytes(buffers[out_r]), bytes(buffers[err_r])


def _kill_all() -> None:
    """SIGKILL every process of the sandbox but this one (kill(-1) never signals init)."""
    try:
        os.kill(-1, 9)
    except ProcessLookupError:
        pass  # nothing else is left


def _reap(main_pid: int) -> int | None:
    """Reap every exited process without blocking; the main process's exit status if it was among them."""
    found = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == main_pid:
            found = _exit_code(wait_status)


def _reap_all(main_pid: int) -> int | None:
    """Wait until no other process is left in the sandbox (all were killed); the main process's
    exit status if it was reaped here."""
    found = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            return found
        if pid == main_pid:
            found = _exit_code(wait_status)


def _exit_code(wait_status: int) -> int:
    """Popen's convention: the exit status, or minus the signal that killed the process."""
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _send_frame(conn: _socket.socket, payload: bytes) -> None:
    conn.sendall(len(payload).to_bytes(4, "big") + payload)


def _recv_frame(conn: _socket.socket) -> tuple[bytes, list[int]] | None:
    """(payload, descriptors) of the next frame, or None when the host closed the socket.
    Received descriptors are made close-on-exec at once."""
    fds: list[int] = []
    data = b""
    need = 4
    length: int | None = None
    while len(data) < need:
        chunk, ancillary, _, _ = conn.recvmsg(need - len(data), _socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                received = list(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
                for fd in received:
                    os.set_inheritable(fd, False)
                fds += received
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None
        data += chunk
        if length is None and len(data) >= 4:
            length = int.from_bytes(data[:4], "big")
            if length > _MAX_FRAME:
                raise ValueError(f"driver: frame of {length} bytes")
            need = 4 + length
    return data[4:], fds


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # nothing to flush (all output went through os.write / the socket)
