"""Hostile programs in the code sandbox: each scores 0 with the right reason, and the host
keeps no new process, file or connection afterwards (checked by the host_guard fixture).

Where a program would pass its test only if the attack worked (reading a secret,
reaching a host server), a reward of 0 is itself evidence that the attack failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from asyncrl.tasks.reward.code_reward import score_code
from asyncrl.tasks.reward.config import CodeRewardConfig
from asyncrl.tasks.reward.sandbox import RunOutcome, Sandbox, SandboxFile
from asyncrl.tasks.reward.types import CodeTests, Reason, RewardResult, StdioCase

if TYPE_CHECKING:
    from conftest import HostGuard  # fixtures come from tests/reward/conftest.py


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{source}\n```\n"


def run_hostile(sandbox: Sandbox, source: str, expected_output: str = "3\n", stdin: str = "1 2\n") -> RewardResult:
    tests = CodeTests(stdio=(StdioCase(stdin, expected_output),))
    result = score_code(fenced(source), tests, sandbox.config, sandbox)
    assert result.sandboxed is True
    return result


def assert_zero(result: RewardResult, reason: Reason, detail_contains: str = "") -> None:
    assert result.reward == 0.0, result
    assert result.reason == reason, result
    assert detail_contains in result.detail, result.detail


def test_fork_bomb_hits_the_process_limit(sandbox: Sandbox, host_guard: HostGuard) -> None:
    result = run_hostile(sandbox, "import os\nwhile True:\n    os.fork()")
    assert_zero(result, Reason.PROCESS_LIMIT, "process limit of 16")


def test_fork_bomb_of_sleepers_is_capped_at_nproc(sandbox: Sandbox, host_guard: HostGuard) -> None:
    # Children that survive (sleep) make the cap visible: the program reports how many forks worked.
    source = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    outcome = sandbox.run([SandboxFile("main.py", source.encode())], "main.py")
    assert outcome.reason == Reason.OK, outcome
    forks = int(outcome.stdout)
    assert 0 < forks < sandbox.config.limits.nproc  # bwrap's init and the program count too
    # The 60 s sleepers died with the sandbox (host_guard checks no process is left).
    assert outcome.wall_s < 30


@pytest.mark.parametrize(
    "source",
    ["x = bytearray(8 << 30)", "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"],
    ids=["one-allocation", "growing"],
)
def test_memory_bomb_hits_the_memory_limit(sandbox: Sandbox, host_guard: HostGuard, source: str) -> None:
    assert_zero(run_hostile(sandbox, source), Reason.MEMORY, "memory limit of 256 MiB")


def test_infinite_loop_hits_the_cpu_limit(sandbox: Sandbox, host_guard: HostGuard) -> None:
    result = run_hostile(sandbox, "while True:\n    pass")
    assert_zero(result, Reason.TIMEOUT, "CPU time limit of 1 s")


def test_sleeping_program_hits_the_wall_time_limit(sandbox: Sandbox, host_guard: HostGuard) -> None:
    start = time.monotonic()
    result = run_hostile(sandbox, "import time\ntime.sleep(3600)")
    assert_zero(result, Reason.TIMEOUT, "wall time limit of 3.0 s")
    assert time.monotonic() - start < 15


def test_busy_child_left_behind_is_killed(sandbox: Sandbox, host_guard: HostGuard) -> None:
    # Double fork + setsid: a daemon spinning forever, its command line carrying the marker.
    source = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/python3', ['python3', '-c', 'while True: pass', {host_guard.marker!r}])\n"
        "    os._exit(0)\n"
        "print('parent leaves')\n"
    )
    result = run_hostile(sandbox, source)
    assert_zero(result, Reason.WRONG_ANSWER, "'parent leaves")
    # host_guard then finds no process with the marker: the daemon died with the sandbox.


def test_network_is_unreachable(sandbox: Sandbox, host_guard: HostGuard) -> None:
    # A host server that would hand the program its expected output.
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, addr = server.accept()
            except TimeoutError:
                continue
            accepted.append(addr)
            conn.sendall(b"3\n")
            conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        local = run_hostile(
            sandbox, f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint(s.recv(10).decode(), end='')"
        )
        outside = run_hostile(sandbox, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint(3)")
    finally:
        done.set()
        thread.join()
        server.close()
    assert_zero(local, Reason.CRASH, "ConnectionRefusedError")
    assert_zero(outside, Reason.CRASH, "Network is unreachable")
    assert accepted == []


def test_host_secrets_are_not_visible(sandbox: Sandbox, host_guard: HostGuard, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t\n")
    secret.chmod(0o644)
    read_secret = run_hostile(sandbox, f"print(open({str(secret)!r}).read(), end='')", expected_output="s3cr3t\n")
    assert_zero(read_secret, Reason.CRASH, "FileNotFoundError")
    shadow = run_hostile(sandbox, "print(open('/etc/shadow').read(), end='')", expected_output="root:")
    assert_zero(shadow, Reason.CRASH, "No such file or directory: '/etc/shadow'")
    home = os.path.expanduser("~")
    listing = run_hostile(sandbox, f"import os\nprint(os.listdir({home!r}))", expected_output="[]")
    assert_zero(listing, Reason.CRASH, "FileNotFoundError")
    environ = run_hostile(sandbox, "import os\nprint(sorted(os.environ))", expected_output="x")
    assert_zero(environ, Reason.WRONG_ANSWER)
    assert "AWS" not in environ.tests[0].detail and "PYENV" not in environ.tests[0].detail


def test_writes_outside_the_sandbox_fail_and_tmp_is_private(sandbox: Sandbox, host_guard: HostGuard, tmp_path: Path) -> None:
    host_dir = tmp_path / "host"
    host_dir.mkdir(mode=0o777)
    host_dir.chmod(0o777)  # writable by anyone on the host: only the mount namespace protects it
    targets = {
        "host dir": (str(host_dir / "escape.txt"), "FileNotFoundError"),
        "/usr": (f"/usr/{host_guard.marker}", "Read-only file system"),
        "/": (f"/{host_guard.marker}", "Read-only file system"),
        "/sandbox": ("/sandbox/main.py", "Read-only file system"),
    }
    for label, (path, error) in targets.items():
        result = run_hostile(sandbox, f"open({path!r}, 'w').write('x')\nprint(3)")
        assert_zero(result, Reason.CRASH, error)
        assert not Path(path).exists(), label
    assert list(host_dir.iterdir()) == []
    # /tmp inside is writable but private: nothing appears in the host's /tmp.
    private = run_hostile(sandbox, f"open('/tmp/{host_guard.marker}', 'w').write('x')\nprint(3)")
    assert private.reward == 1.0 and private.reason == Reason.OK
    assert not Path("/tmp", host_guard.marker).exists()


def test_gigantic_output_hits_the_output_cap(sandbox: Sandbox, host_guard: HostGuard) -> None:
    result = run_hostile(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert_zero(result, Reason.OUTPUT_LIMIT, "stdout exceeded")
    assert len(result.tests[0].detail) < 1000


def test_big_files_hit_the_file_and_tmp_limits(sandbox: Sandbox, host_guard: HostGuard) -> None:
    one_big = run_hostile(sandbox, "open('/tmp/big', 'wb').write(b'x' * (32 << 20))\nprint(3)")
    assert_zero(one_big, Reason.OUTPUT_LIMIT, "File too large")
    many = run_hostile(sandbox, "for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (8 << 20))\nprint(3)")
    assert_zero(many, Reason.OUTPUT_LIMIT, "No space left on device")


def test_signals_to_the_parent_reach_nothing_on_the_host(sandbox: Sandbox, host_guard: HostGuard) -> None:
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        source = (
            "import os, signal\n"
            "for target in (os.getppid(), 1, -1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
            f"for pid in ({os.getpid()}, {sentinel.pid}):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
            "print('still here')\n"
        )
        result = run_hostile(sandbox, source)
        assert_zero(result, Reason.WRONG_ANSWER, "'still here")
        assert sentinel.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        sentinel.send_signal(signal.SIGKILL)
        sentinel.wait()


def test_program_killing_itself_is_a_crash(sandbox: Sandbox, host_guard: HostGuard) -> None:
    result = run_hostile(sandbox, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert_zero(result, Reason.CRASH, "killed by SIGSEGV")


def test_sandbox_runs_as_an_unprivileged_user_without_capabilities(sandbox: Sandbox) -> None:
    source = (
        "import os\n"
        "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
        "print(os.getuid(), status['CapEff'].strip(), len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
    )
    outcome = sandbox.run([SandboxFile("main.py", source.encode())], "main.py")
    uid, cap_eff, visible_pids = outcome.stdout.decode().split()
    assert int(uid) == sandbox.config.sandbox_uid
    assert int(cap_eff, 16) == 0
    # A private pid namespace: only bwrap's init and the program itself are visible.
    assert int(visible_pids) == 2


def test_process_limit_is_per_sandbox_not_shared(sandbox: Sandbox, host_guard: HostGuard) -> None:
    # RLIMIT_NPROC is set inside each sandbox's user namespace: two sandboxes of the same
    # host uid running at once each get the full limit (set outside, they would share it).
    source = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "time.sleep(1.0)\n"
        "print(n)\n"
    )
    outcomes: list[RunOutcome] = []
    threads = [
        threading.Thread(target=lambda: outcomes.append(sandbox.run([SandboxFile("main.py", source.encode())], "main.py")))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    forks = sorted(int(o.stdout) for o in outcomes)
    limit = sandbox.config.limits.nproc
    assert all(limit - 4 <= n < limit for n in forks), forks


def test_interpreter_outside_usr_is_refused(tmp_path: Path) -> None:
    require_bwrap()
    fake = tmp_path / "python3"
    fake.symlink_to(sys.executable)  # e.g. a pyenv or venv interpreter under a home directory
    box = Sandbox(CodeRewardConfig(python=str(fake)))
    outcome = box.run([SandboxFile("main.py", b"print(1)")], "main.py")
    assert outcome.reason == Reason.SANDBOX_UNAVAILABLE
    assert "outside /usr" in outcome.detail
