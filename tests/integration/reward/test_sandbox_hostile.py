"""Hostile programs in the code sandbox: each scores 0 with the right reason, and the host
keeps no new process, file or connection afterwards (checked by the host_guard fixture).

Where a program would pass its test only if the attack worked (reading a secret,
reaching a host server), a reward of 0 is itself evidence that the attack failed.
"""

from __future__ import annotations

import errno
import json
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

import psutil
import pytest

from asyncrl.tasks.reward.code_reward import score_code
from asyncrl.configs.reward import CodeRewardConfig, RewardConfig
from asyncrl.tasks.reward.environ import SANDBOX_ENV, WORKER_ENV_NAMES, WORKER_ENV_PREFIXES
from asyncrl.tasks.reward.pool import RewardPool
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_outcome import RunOutcome, SandboxFile, escape_controls
from asyncrl.tasks.reward.seccomp import X32_SYSCALL_BIT, native_arch
from asyncrl.tasks.reward.types import CodeTests, Reason, RewardRequest, RewardResult, StdioCase
from hostile_programs import SLEEPER_BOMB, sleeper_bomb

if TYPE_CHECKING:
    from conftest import HostGuard  # fixtures come from tests/integration/reward/conftest.py


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
    outcome = sandbox.run([SandboxFile("main.py", SLEEPER_BOMB.encode())], "main.py")
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
    # A wall limit well above the CPU limit: on a loaded 2-core machine 1 s of CPU can take
    # more than the fixture's 3 s of wall time, and the wall limit would answer first.
    limits = sandbox.config.limits.model_copy(update={"wall_s": 20.0})
    patient = Sandbox(sandbox.config.model_copy(update={"limits": limits}))
    result = run_hostile(patient, "while True:\n    pass")
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
    source = sleeper_bomb(linger_s=1.0)
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


# -- secrets, system calls, file systems, descriptors, leftovers, output -------------------------

CANARY_NAMES = ("AWS_SECRET_ACCESS_KEY", "ASYNCRL_ROLLOUT_API_KEY", "ASYNCRL_REWARD_TOKEN")

# Reads the environment of every process it can see and its own os.environ into `report`.
ENVIRON_PROBE = """\
import json, os
canaries = {canaries!r}
seen, unreadable, leaks = [], [], []
for pid in sorted((p for p in os.listdir('/proc') if p.isdigit()), key=int):
    try:
        data = open(f'/proc/{{pid}}/environ', 'rb').read().decode('utf-8', 'replace')
    except OSError as exc:
        unreadable.append(f'{{pid}}: {{exc}}')
        continue
    seen.append(int(pid))
    leaks += [f'/proc/{{pid}}/environ' for c in canaries if c in data]
leaks += [f'os.environ[{{k}}]' for k, v in os.environ.items() for c in canaries if c in v or c in k]
report = {{'seen': seen, 'unreadable': unreadable, 'leaks': leaks, 'names': sorted(os.environ)}}
"""


@pytest.fixture
def canaries(monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """Secret-looking variables set in this process (the reward worker's / pool's parent)."""
    values = tuple(f"canary-{name.lower()}-{os.getpid()}" for name in CANARY_NAMES)
    for name, value in zip(CANARY_NAMES, values, strict=True):
        monkeypatch.setenv(name, value)
    return values


def run_probe(sandbox: Sandbox, source: str) -> RunOutcome:
    outcome = sandbox.run([SandboxFile("main.py", source.encode())], "main.py")
    assert outcome.reason == Reason.OK, outcome
    return outcome


def test_no_secret_in_any_sandbox_process_environment(
    sandbox: Sandbox, host_guard: HostGuard, canaries: tuple[str, ...]
) -> None:
    assert all(c in os.environ.values() for c in canaries)  # bwrap would inherit them without env=
    source = ENVIRON_PROBE.format(canaries=canaries) + "print(json.dumps(report))\n"
    report = json.loads(run_probe(sandbox, source).stdout)
    assert 1 in report["seen"] and len(report["seen"]) >= 2, report  # bwrap's pid 1 was readable: a real check
    assert report["leaks"] == [], report
    assert set(report["names"]) <= set(SANDBOX_ENV) | {"PWD"}, report["names"]


def test_pool_workers_and_their_sandboxes_get_no_secret(
    pool_config: RewardConfig, host_guard: HostGuard, canaries: tuple[str, ...]
) -> None:
    require_bwrap()
    # pid 1 of a pool's sandbox is the driver of its tests (sandbox_driver.py): not dumpable, so its
    # environ is unreadable; the program's own processes are read.
    program = fenced(
        ENVIRON_PROBE.format(canaries=canaries)
        + "pid1 = 1 in seen or any(u.startswith('1: [Errno 13]') for u in unreadable)\n"
        + "print('clean' if not leaks and pid1 and seen else report)"
    )
    with RewardPool(pool_config, workers=1) as pool:
        host_guard.allow(pool.worker_pids())
        for pid in pool.worker_pids():
            environ = psutil.Process(pid).environ()
            assert not [c for c in canaries if c in "\0".join(f"{k}={v}" for k, v in environ.items())], environ
            assert all(k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES) for k in environ), sorted(environ)
            assert "PATH" in environ  # the worker still finds bwrap
        tests = CodeTests(stdio=(StdioCase("", "clean\n"),))
        (result,) = pool.score_sync([RewardRequest("code", program, tests)], timeout=60)
    assert result.reward == 1.0 and result.reason == Reason.OK, result


def test_dangerous_system_calls_fail_with_eperm(sandbox: Sandbox, host_guard: HostGuard) -> None:
    arch = native_arch()
    nr = arch.numbers
    # Each call is made so that, without the filter, it would succeed or fail with another errno
    # (EFAULT, EINVAL...): EPERM from all of them is the seccomp filter's answer.
    calls = {
        "ptrace(PTRACE_ATTACH, 1)": (nr["ptrace"], [16, 1, 0, 0]),
        "process_vm_readv(self, 0 iovecs)": (nr["process_vm_readv"], ["SELF", 0, 0, 0, 0, 0]),
        "process_vm_writev(self, 0 iovecs)": (nr["process_vm_writev"], ["SELF", 0, 0, 0, 0, 0]),
        "bpf(BPF_MAP_CREATE, NULL)": (nr["bpf"], [0, 0, 0]),
        "io_uring_setup(1, NULL)": (nr["io_uring_setup"], [1, 0]),
        "userfaultfd(UFFD_USER_MODE_ONLY)": (nr["userfaultfd"], [1]),
        "perf_event_open(NULL)": (nr["perf_event_open"], [0, 0, -1, -1, 0]),
        "keyctl(KEYCTL_GET_KEYRING_ID, session)": (nr["keyctl"], [0, -3, 0]),
        "unshare(CLONE_NEWNS)": (nr["unshare"], [0x00020000]),
        "mount(NULL)": (nr["mount"], [0, 0, 0, 0, 0]),
        "memfd_create('x')": (nr["memfd_create"], ["NAME", 0]),
    }
    if arch.has_x32:
        calls["x32 getpid"] = (X32_SYSCALL_BIT | 39, [])
    source = (
        "import ctypes, json, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"calls = {calls!r}\n"
        "out = {}\n"
        "for name, (number, args) in calls.items():\n"
        "    args = [os.getpid() if a == 'SELF' else ctypes.c_char_p(b'x') if a == 'NAME' else ctypes.c_long(a) for a in args]\n"
        "    ctypes.set_errno(0)\n"
        "    result = libc.syscall(ctypes.c_long(number), *args)\n"
        "    out[name] = [result, os.strerror(ctypes.get_errno()) if result == -1 else '']\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
        "print(json.dumps({'calls': out, 'seccomp': status['Seccomp'].strip(), 'getpid': os.getpid()}))\n"
    )
    report = json.loads(run_probe(sandbox, source).stdout)
    assert report["seccomp"] == "2", report  # SECCOMP_MODE_FILTER
    assert report["getpid"] > 0  # ordinary calls still work
    eperm = os.strerror(errno.EPERM)
    refused = {name: result for name, result in report["calls"].items() if result != [-1, eperm]}
    assert refused == {}, f"not denied with EPERM: {refused}"


def test_dev_is_read_only_and_dev_shm_and_tmp_are_capped(sandbox: Sandbox, host_guard: HostGuard) -> None:
    limits = sandbox.config.limits
    # Files of 8 MiB each stay under RLIMIT_FSIZE: only the tmpfs size can stop the writes.
    source = (
        "import json, os\n"
        "out = {}\n"
        "for d in ('/dev/shm', '/tmp'):\n"
        "    written, error = 0, ''\n"
        "    try:\n"
        "        for i in range(128):\n"
        "            with open(f'{d}/fill{i}', 'wb') as f:\n"
        "                for _ in range(8):\n"
        "                    f.write(b'x' * (1 << 20))\n"
        "                    f.flush()\n"
        "                    written += 1 << 20\n"
        "    except OSError as exc:\n"
        "        error = os.strerror(exc.errno)\n"
        "    for name in os.listdir(d):\n"
        "        os.unlink(f'{d}/{name}')\n"
        "    out[d] = [written, error]\n"
        "try:\n"
        "    open('/dev/planted', 'w').close()\n"
        "    out['/dev'] = 'created'\n"
        "except OSError as exc:\n"
        "    out['/dev'] = os.strerror(exc.errno)\n"
        "print(json.dumps(out))\n"
    )
    report = json.loads(run_probe(sandbox, source).stdout)
    for directory in ("/dev/shm", "/tmp"):
        written, error = report[directory]
        assert error == os.strerror(errno.ENOSPC), report
        assert written <= limits.tmpfs_mb << 20, f"{directory}: {written} bytes written, cap {limits.tmpfs_mb} MiB"
    assert report["/dev"] == os.strerror(errno.EROFS), report


def test_no_descriptor_is_inherited_beyond_stdio(sandbox: Sandbox, host_guard: HostGuard) -> None:
    source = (
        "import os\n"
        "def is_open(fd):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "        return True\n"
        "    except OSError:\n"
        "        return False\n"
        "print([fd for fd in range(1024) if is_open(fd)])\n"
    )
    assert run_probe(sandbox, source).stdout == b"[0, 1, 2]\n"


def test_sleeping_grandchild_is_gone_when_the_run_returns(sandbox: Sandbox, host_guard: HostGuard) -> None:
    source = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(60)', {host_guard.marker!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('parent leaves')\n"
    )
    outcome = run_probe(sandbox, source)
    assert outcome.stdout == b"parent leaves\n"
    # No settling time: the pid namespace's init waits for every process in it before it exits.
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if host_guard.marker in " ".join(p.info["cmdline"] or [])]
    assert left == [], f"sandbox processes still running after run() returned: {left}"


def test_core_dumps_are_disabled(sandbox: Sandbox, host_guard: HostGuard) -> None:
    source = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CORE))"
    assert run_probe(sandbox, source).stdout == b"(0, 0)\n"


def test_escape_sequences_on_stderr_come_back_escaped(sandbox: Sandbox, host_guard: HostGuard) -> None:
    source = (
        "import sys\n"
        "sys.stderr.write('\\x1b[2J\\x1b]0;owned\\x07\\r\\x9b31m red\\tend\\n')\n"
        "sys.exit(3)\n"
    )
    result = run_hostile(sandbox, source)
    assert_zero(result, Reason.CRASH, "exit status 3")
    detail = result.tests[0].detail
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x0d\\x9b31m red\tend" in detail, detail
    assert not [c for c in detail if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F], repr(detail)


def test_escape_controls_keeps_newlines_tabs_and_text() -> None:
    assert escape_controls("a\tb\nc é ✓") == "a\tb\nc é ✓"
    assert escape_controls("\x1b[31m\x00\x7f\x85\x9b\r") == "\\x1b[31m\\x00\\x7f\\x85\\x9b\\x0d"
