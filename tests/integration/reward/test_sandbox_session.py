"""One sandbox per program (Sandbox.session, sandbox_driver.py): each test is still its own
process with its own limits and reasons, nothing of one test outlives it, and no test can reach
or stop the driver that runs them."""

from __future__ import annotations

import json
import signal
import time
from typing import TYPE_CHECKING

import pytest

from asyncrl.tasks.reward import sandbox_session as sandbox_session_module
from asyncrl.tasks.reward.code_reward import score_code
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_session import SandboxSession
from asyncrl.tasks.reward.sandbox_outcome import SandboxFile
from asyncrl.tasks.reward.types import CodeTests, Reason, StdioCase
from hostile_programs import SLEEPER_BOMB

if TYPE_CHECKING:
    from conftest import HostGuard  # fixtures come from tests/integration/reward/conftest.py

ADD = b"a, b = map(int, input().split())\nprint(a + b)\n"
LIST_PROCESSES = b"import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"


def daemon(marker: str) -> bytes:
    """Leaves a double-forked, setsid'd sleeper behind (its command line carries the marker)."""
    return (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('left a daemon')\n"
    ).encode()


def test_each_test_is_its_own_process_tree(sandbox: Sandbox, host_guard: HostGuard) -> None:
    fds = b"import os\nprint([fd for fd in range(1024) if os.path.exists(f'/proc/self/fd/{fd}')])\n"
    files = [SandboxFile("add.py", ADD), SandboxFile("daemon.py", daemon(host_guard.marker)),
             SandboxFile("ps.py", LIST_PROCESSES), SandboxFile("fds.py", fds)]  # fmt: skip
    with SandboxSession(sandbox, files) as session:
        first = session.run("add.py", b"1 2\n")
        assert (first.reason, first.stdout) == (Reason.OK, b"3\n"), first
        left = session.run("daemon.py")
        assert (left.reason, left.stdout) == (Reason.OK, b"left a daemon\n"), left
        # The daemon died with its test: the next test sees only the driver (pid 1) and itself.
        listing = session.run("ps.py")
        assert listing.reason == Reason.OK, listing
        pids = json.loads(listing.stdout)
        assert len(pids) == 2 and pids[0] == 1, pids
        # No descriptor of the driver (its socket, its pipes, other tests' stdin) reaches a test.
        assert session.run("fds.py").stdout == b"[0, 1, 2]\n"
        again = session.run("add.py", b"40 2\n")
        assert (again.reason, again.stdout) == (Reason.OK, b"42\n"), again


def test_limits_and_reasons_hold_per_test(sandbox: Sandbox, host_guard: HostGuard) -> None:
    limits = sandbox.config.limits
    files = [
        SandboxFile("add.py", ADD),
        SandboxFile("bomb.py", b"import os\nwhile True:\n    os.fork()\n"),
        SandboxFile("sleepers.py", SLEEPER_BOMB.encode()),
        SandboxFile("memory.py", b"x = bytearray(8 << 30)\n"),
        SandboxFile("sleep.py", b"import time\ntime.sleep(3600)\n"),
        SandboxFile("output.py", b"import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"),
        SandboxFile("segv.py", b"import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"),
        SandboxFile("exit3.py", b"raise SystemExit(3)\n"),
    ]
    with SandboxSession(sandbox, files) as session:
        bomb = session.run("bomb.py")
        assert (bomb.reason, bomb.detail.startswith(f"process limit of {limits.nproc}")) == (Reason.PROCESS_LIMIT, True)
        # The bomb's processes are gone: the whole process limit is free again, twice over.
        counts = [int(session.run("sleepers.py").stdout) for _ in range(2)]
        assert counts[0] == counts[1] and 0 < counts[0] < limits.nproc, counts
        memory = session.run("memory.py")
        assert memory.reason == Reason.MEMORY and f"memory limit of {limits.memory_mb} MiB" in memory.detail
        start = time.monotonic()
        slept = session.run("sleep.py")
        assert slept.reason == Reason.TIMEOUT and f"wall time limit of {limits.wall_s} s" in slept.detail
        assert limits.wall_s <= slept.wall_s < limits.wall_s + 2 and time.monotonic() - start < limits.wall_s + 4
        flood = session.run("output.py")
        assert flood.reason == Reason.OUTPUT_LIMIT and len(flood.stdout) == limits.output_bytes
        segv = session.run("segv.py")
        assert (segv.reason, segv.detail) == (Reason.CRASH, "killed by SIGSEGV")
        exit3 = session.run("exit3.py")
        assert exit3.reason == Reason.CRASH and exit3.detail.startswith("exit status 3")
        after = session.run("add.py", b"2 2\n")
        assert (after.reason, after.stdout) == (Reason.OK, b"4\n"), after


def test_no_test_can_reach_or_stop_the_driver(sandbox: Sandbox, host_guard: HostGuard) -> None:
    probe = (
        "import json, os\n"
        "out = {}\n"
        "for path in ('/proc/1/fd', '/proc/1/environ', '/proc/1/mem', '/proc/1/fd/3', '/proc/1/root/tmp'):\n"
        "    try:\n"
        "        if path.endswith('fd'):\n"
        "            out[path] = os.listdir(path)\n"
        "        else:\n"
        "            with open(path, 'rb') as f:\n"
        "                out[path] = f.read(16).hex()\n"
        "    except OSError as exc:\n"
        "        out[path] = exc.errno\n"
        "try:\n"
        "    with open('/proc/1/fd/3', 'wb') as f:\n"
        "        f.write(b'forged')\n"
        "    out['write'] = 'written'\n"
        "except OSError as exc:\n"
        "    out['write'] = exc.errno\n"
        "print(json.dumps(out))\n"
    )
    signals = sorted(int(s) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))
    attack = (
        "import os, time\n"
        f"for s in {[*signals, int(signal.SIGSTOP), int(signal.SIGKILL)]!r}:\n"
        "    os.kill(1, s)\n"
        "try:\n"
        "    os.kill(-1, 9)\n"
        "except ProcessLookupError:\n"
        "    pass\n"
        "time.sleep(0.2)\n"
        "print('still here')\n"
    )
    files = [SandboxFile("probe.py", probe.encode()), SandboxFile("attack.py", attack.encode()), SandboxFile("add.py", ADD)]
    with SandboxSession(sandbox, files) as session:
        seen = session.run("probe.py")
        assert seen.reason == Reason.OK, seen
        report = json.loads(seen.stdout)
        assert all(value == 13 for value in report.values()), report  # EACCES: the driver is not dumpable
        hit = session.run("attack.py")
        assert (hit.reason, hit.stdout) == (Reason.OK, b"still here\n"), hit
        after = session.run("add.py", b"5 6\n")
        assert (after.reason, after.stdout) == (Reason.OK, b"11\n"), after


def test_a_driver_that_does_not_answer_is_a_timeout_and_the_next_test_gets_a_fresh_sandbox(
    sandbox: Sandbox, host_guard: HostGuard, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host waits limits.wall_s + DRIVER_SLACK_S: made shorter than the driver's own limit here.
    monkeypatch.setattr(sandbox_session_module, "DRIVER_SLACK_S", 0.5 - sandbox.config.limits.wall_s)
    files = [SandboxFile("sleep.py", b"import time\ntime.sleep(3600)\n"), SandboxFile("add.py", ADD)]
    with SandboxSession(sandbox, files) as session:
        stuck = session.run("sleep.py")
        assert stuck.reason == Reason.TIMEOUT and "sandbox killed" in stuck.detail, stuck
        assert stuck.wall_s < 2.0
        after = session.run("add.py", b"1 1\n")
        assert (after.reason, after.stdout) == (Reason.OK, b"2\n"), after


def test_a_program_starts_one_sandbox_for_all_its_tests(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[list[str]] = []
    popen = Sandbox._popen_bwrap

    def counting(self: Sandbox, argv: list[str], *args: object, **kwargs: object) -> object:
        starts.append(argv)
        return popen(self, argv, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Sandbox, "_popen_bwrap", counting)
    program = "```python\nif __name__ == '__main__':\n    a, b = map(int, input().split())\n    print(a + b)\n```"
    tests = CodeTests(stdio=tuple(StdioCase(f"{i} {i}\n", f"{2 * i}\n") for i in range(5)), asserts=("assert True",))
    result = score_code(program, tests, sandbox.config, sandbox)
    assert (result.reward, result.reason) == (1.0, Reason.OK), result
    assert len(starts) == 1 and "--as-pid-1" in starts[0]
    per_test = sandbox.config.model_copy(update={"sandbox_per": "test"})
    result = score_code(program, tests, per_test, Sandbox(per_test))
    assert (result.reward, result.reason) == (1.0, Reason.OK), result
    assert len(starts) == 1 + tests.count


def test_a_broken_bwrap_is_sandbox_unavailable_for_a_session() -> None:
    from asyncrl.configs.reward import CodeRewardConfig

    box = Sandbox(CodeRewardConfig(bwrap="/bin/false"))
    with SandboxSession(box, [SandboxFile("add.py", ADD)]) as session:
        outcome = session.run("add.py", b"1 2\n")
    assert outcome.reason == Reason.SANDBOX_UNAVAILABLE
    assert outcome.detail.startswith("bubblewrap could not start the sandbox (exit status 1)")
