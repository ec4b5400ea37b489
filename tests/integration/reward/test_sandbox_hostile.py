"""Hostile programs scored by the real reward service process (``python -m
asyncrl.tasks.reward.server``, through ``RemoteRewardScorer``), which holds fake credentials in
its environment: each program scores 0 with the right reason, no credential ever shows in a
result, and the host keeps no new process, file or connection afterwards (host_guard).

One service per sandbox mode (``reward.code.sandbox_per``: one sandbox per program, the
default, and one per test) is shared by the whole module. Where a program would pass its test
only if the attack worked (reading a secret, reaching a host server), a reward of 0 is itself
evidence that the attack failed; probes check for themselves and print ``clean``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest
from process_config_files import write_process_config

from asyncrl.configs.reward import CodeRewardConfig
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.tasks.reward.environ import SANDBOX_ENV, WORKER_ENV_NAMES, WORKER_ENV_PREFIXES, worker_environment
from asyncrl.tasks.reward.process import MODULE
from asyncrl.tasks.reward.remote import RemoteRewardScorer
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_outcome import SandboxFile, escape_controls
from asyncrl.tasks.reward.seccomp import X32_SYSCALL_BIT, native_arch
from asyncrl.tasks.reward.service_registry import TOKEN_ENV, read_reward_service
from asyncrl.tasks.reward.types import CodeTests, Reason, RewardRequest, RewardResult, StdioCase
from asyncrl.tasks.system.process_group import kill_group, read_log_tail, spawn_session
from hostile_programs import SLEEPER_BOMB, sleeper_bomb

if TYPE_CHECKING:
    from conftest import HostGuard  # fixtures come from tests/integration/reward/conftest.py

SECRET_NAMES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "ASYNCRL_ROLLOUT_API_KEY",
    "ASYNCRL_REWARD_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "OPENAI_API_KEY",
    "WANDB_API_KEY",
)  # fmt: skip
CANARIES = {name: f"canary-{name.lower().replace('_', '-')}-{os.getpid()}" for name in SECRET_NAMES}
"""Fake credentials in the reward service's environment (its bearer token among them)."""
LIMITS = {"cpu_s": 1, "wall_s": 20.0, "memory_mb": 256, "nproc": 16}
"""The service's sandbox limits; tests but the CPU one run with a 3 s problem time limit."""
WALL_S = 3.0
NOTHING = "\x00nothing\n"
"""An expected output no program prints: the test fails and its detail shows the output."""
START_TIMEOUT_S = 60.0


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@dataclass
class Service:
    """A running reward service with CANARIES in its environment."""

    process: subprocess.Popen[bytes]
    log: Path
    root: RunRoot
    url: str
    sandbox_per: str

    def score_many(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """Score through the service; fails if any credential shows anywhere in the results."""

        async def send() -> list[RewardResult]:
            async with RemoteRewardScorer(self.root, token=CANARIES[TOKEN_ENV], unavailable_timeout_s=30) as scorer:
                return await scorer.score(requests)

        results = asyncio.run(send())
        shown = json.dumps([r.to_json() for r in results])
        leaked = [name for name, value in CANARIES.items() if value in shown or name in shown]
        assert not leaked, f"credentials in the results: {leaked}"
        return results

    def score(
        self, source: str, expected: str = "3\n", stdin: str = "1 2\n", time_limit_s: float | None = WALL_S
    ) -> RewardResult:
        """Score ``source`` (fenced, as a model writes it) against one stdio test."""
        tests = CodeTests(stdio=(StdioCase(stdin, expected),), time_limit_s=time_limit_s)
        (result,) = self.score_many([RewardRequest("code", fenced(source), tests)])
        assert result.sandboxed is True, result
        return result

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{source}\n```\n"


def start_service(directory: Path, sandbox_per: str) -> Service:
    config = {
        "name": "hostile",
        "model": {"path": str(directory / "model")},
        "data": {"train_path": str(directory / "train.parquet")},
        "storage": {"root": str(directory / "store")},
        "reward": {
            "code": {"limits": LIMITS, "sandbox_per": sandbox_per},
            "pool": {"workers": 2, "kill_grace_s": 2.0, "preload_math": False},
        },
    }
    path = write_process_config(directory / "run.yaml", config, "reward")
    env = {**{k: v for k, v in os.environ.items() if k not in CANARIES}, **CANARIES}
    log = directory / "service.log"
    process = spawn_session([sys.executable, "-m", MODULE, "--config", str(path)], log, env=env)
    root = open_root(str(directory / "store"))
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        info = read_reward_service(root)
        if info is not None and info.pid == process.pid:
            return Service(process, log, root, info.url, sandbox_per)
        if process.poll() is not None or time.monotonic() > deadline:
            kill_group(process, grace_s=1.0)
            pytest.fail(f"reward service did not start:\n{read_log_tail(log, 40)}")
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["program", "test"], ids=lambda mode: f"sandbox_per={mode}")
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    require_bwrap()
    running = start_service(tmp_path_factory.mktemp(f"hostile-{request.param}"), request.param)
    try:
        yield running
    finally:
        kill_group(running.process, grace_s=5.0)
    log = running.log.read_text(errors="replace")
    assert not [name for name, value in CANARIES.items() if value in log], "a credential reached the service's log"


def assert_zero(result: RewardResult, reason: Reason, detail_contains: str = "") -> None:
    assert result.reward == 0.0, result
    assert result.reason == reason, result
    assert detail_contains in result.detail, result.detail


def printed(result: RewardResult) -> str:
    """What a program judged against NOTHING printed (from its wrong-answer detail)."""
    assert result.reason == Reason.WRONG_ANSWER, result
    match = re.fullmatch(r"expected .*?, got (.*)", result.tests[0].detail, re.DOTALL)
    assert match is not None, result.tests[0].detail
    return str(ast.literal_eval(match.group(1)))


def assert_passes(result: RewardResult) -> None:
    assert result.reward == 1.0 and result.reason == Reason.OK, result


# -- credentials ----------------------------------------------------------------------------------


def test_the_service_holds_the_credentials_and_its_workers_do_not(service: Service) -> None:
    assert worker_environment(CANARIES) == {}  # environ.py drops every one of them
    environ = psutil.Process(service.process.pid).environ()
    assert all(environ.get(name) == value for name, value in CANARIES.items())  # the test is real
    workers = service.workers()
    assert len(workers) == 2
    for worker in workers:
        env = worker.environ()
        assert not [v for v in CANARIES.values() if v in "\0".join(f"{k}={x}" for k, x in env.items())], env
        assert all(k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES) for k in env), sorted(env)
        assert "PATH" in env  # the worker still finds bwrap


# Reads every environment and command line it can see, its own os.environ, and those of the
# service and its workers by their host pids; prints "clean" or what it found.
ENVIRON_PROBE = """\
import json, os
canaries = {canaries!r}
host_pids = {host_pids!r}
seen, unreadable, leaks = [], [], []
pids = sorted({{int(p) for p in os.listdir('/proc') if p.isdigit()}} | set(host_pids))
for pid in pids:
    for name in ('environ', 'cmdline'):
        try:
            data = open(f'/proc/{{pid}}/{{name}}', 'rb').read().decode('utf-8', 'replace')
        except OSError as exc:
            unreadable.append(f'{{pid}}/{{name}}: {{exc.strerror}}')
            continue
        seen.append(pid)
        leaks += [f'/proc/{{pid}}/{{name}}' for c in canaries if c in data]
leaks += [f'os.environ[{{k}}]' for k, v in os.environ.items() for c in canaries if c in v or c in k]
extra = sorted(set(os.environ) - {allowed!r})
pid1 = 1 in seen or any(u.startswith('1/environ: Permission denied') for u in unreadable)
print('clean' if not leaks and not extra and pid1 and seen else json.dumps([leaks, extra, seen, unreadable])[:100])
"""


def test_no_credential_in_any_environment_the_program_can_read(service: Service, host_guard: HostGuard) -> None:
    host_pids = [service.process.pid, *(w.pid for w in service.workers()), os.getpid()]
    source = ENVIRON_PROBE.format(
        canaries=[*CANARIES.values(), *CANARIES], host_pids=host_pids, allowed=set(SANDBOX_ENV) | {"PWD"}
    )
    # pid 1 is bwrap (sandbox_per=test; its environ is SANDBOX_ENV) or the driver (not dumpable).
    assert_passes(service.score(source, expected="clean\n"))


def test_host_files_and_secrets_are_not_visible(service: Service, host_guard: HostGuard, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text(f"{CANARIES['AWS_SECRET_ACCESS_KEY']}\n")
    secret.chmod(0o644)
    read_secret = service.score(f"print(open({str(secret)!r}).read(), end='')", expected=secret.read_text())
    assert_zero(read_secret, Reason.CRASH, "FileNotFoundError")
    shadow = service.score("print(open('/etc/shadow').read(), end='')", expected="root:")
    assert_zero(shadow, Reason.CRASH, "No such file or directory: '/etc/shadow'")
    home = os.path.expanduser("~")
    listing = service.score(f"import os\nprint(os.listdir({home!r}))", expected="[]")
    assert_zero(listing, Reason.CRASH, "FileNotFoundError")
    config = service.score(f"print(open({str(service.log.parent / 'run.yaml')!r}).read())", expected="x")
    assert_zero(config, Reason.CRASH, "FileNotFoundError")
    names = printed(service.score("import os\nprint(sorted(os.environ))", expected=NOTHING))
    assert set(ast.literal_eval(names)) <= set(SANDBOX_ENV) | {"PWD"}, names


# -- resources ------------------------------------------------------------------------------------


def test_fork_bomb_hits_the_process_limit(service: Service, host_guard: HostGuard) -> None:
    result = service.score("import os\nwhile True:\n    os.fork()")
    assert_zero(result, Reason.PROCESS_LIMIT, "process limit of 16")


def test_fork_bomb_of_sleepers_is_capped_at_nproc(service: Service, host_guard: HostGuard) -> None:
    # Children that survive (sleep) make the cap visible: the program reports how many forks worked.
    result = service.score(SLEEPER_BOMB, expected=NOTHING)
    forks = int(printed(result))
    assert 0 < forks < LIMITS["nproc"]  # the sandbox's init (bwrap or the driver) and the program count too
    # The 60 s sleepers died with the test (host_guard checks no process is left).
    assert result.elapsed_s < 30


def test_process_limit_is_per_sandbox_not_shared(service: Service, host_guard: HostGuard) -> None:
    # RLIMIT_NPROC is set inside each sandbox's user namespace: two sandboxes of the same host
    # uid running at once (one per worker) each get the full limit (set outside, they would share it).
    tests = CodeTests(stdio=(StdioCase("", NOTHING),), time_limit_s=WALL_S)
    request = RewardRequest("code", fenced(sleeper_bomb(linger_s=1.0)), tests)
    forks = sorted(int(printed(r)) for r in service.score_many([request, request]))
    limit = LIMITS["nproc"]
    assert all(limit - 4 <= n < limit for n in forks), forks


@pytest.mark.parametrize(
    "source",
    ["x = bytearray(8 << 30)", "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"],
    ids=["one-allocation", "growing"],
)
def test_memory_bomb_hits_the_memory_limit(service: Service, host_guard: HostGuard, source: str) -> None:
    assert_zero(service.score(source), Reason.MEMORY, "memory limit of 256 MiB")


def test_infinite_loop_hits_the_cpu_limit(service: Service, host_guard: HostGuard) -> None:
    # No problem time limit: the service's 20 s of wall time, well above the CPU limit (on a
    # loaded 2-core machine 1 s of CPU can take more than 3 s of wall time).
    result = service.score("while True:\n    pass", time_limit_s=None)
    assert_zero(result, Reason.TIMEOUT, "CPU time limit of 1 s")


def test_sleeping_program_hits_the_wall_time_limit(service: Service, host_guard: HostGuard) -> None:
    start = time.monotonic()
    result = service.score("import time\ntime.sleep(3600)")
    assert_zero(result, Reason.TIMEOUT, "wall time limit of 3.0 s")
    assert time.monotonic() - start < 15


def test_gigantic_output_hits_the_output_cap(service: Service, host_guard: HostGuard) -> None:
    result = service.score("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert_zero(result, Reason.OUTPUT_LIMIT, "stdout exceeded")
    assert len(result.tests[0].detail) < 1000


def test_big_files_hit_the_file_and_tmp_limits(service: Service, host_guard: HostGuard) -> None:
    one_big = service.score("open('/tmp/big', 'wb').write(b'x' * (32 << 20))\nprint(3)")
    assert_zero(one_big, Reason.OUTPUT_LIMIT, "File too large")
    many = service.score("for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (8 << 20))\nprint(3)")
    assert_zero(many, Reason.OUTPUT_LIMIT, "No space left on device")


def test_dev_is_read_only_and_dev_shm_and_tmp_are_capped(service: Service, host_guard: HostGuard) -> None:
    # Files of 8 MiB each stay under RLIMIT_FSIZE: only the tmpfs size can stop the writes.
    cap = CodeRewardConfig().limits.tmpfs_mb << 20
    source = (
        "import errno, json, os\n"
        "out = {}\n"
        "for d in ('/dev/shm', '/tmp'):\n"
        "    written, error = 0, 0\n"
        "    try:\n"
        "        for i in range(128):\n"
        "            with open(f'{d}/fill{i}', 'wb') as f:\n"
        "                for _ in range(8):\n"
        "                    f.write(b'x' * (1 << 20))\n"
        "                    f.flush()\n"
        "                    written += 1 << 20\n"
        "    except OSError as exc:\n"
        "        error = exc.errno\n"
        "    for name in os.listdir(d):\n"
        "        os.unlink(f'{d}/{name}')\n"
        f"    out[d] = error == errno.ENOSPC and written <= {cap}\n"
        "try:\n"
        "    open('/dev/planted', 'w').close()\n"
        "    out['/dev'] = False\n"
        "except OSError as exc:\n"
        "    out['/dev'] = exc.errno == errno.EROFS\n"
        "print('capped' if all(out.values()) else out)\n"
    )
    assert_passes(service.score(source, expected="capped\n"))


# -- isolation ------------------------------------------------------------------------------------


def test_busy_child_left_behind_is_killed(service: Service, host_guard: HostGuard) -> None:
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
    assert_zero(service.score(source), Reason.WRONG_ANSWER, "'parent leaves")
    # host_guard then finds no process with the marker: the daemon died with its test.


def test_sleeping_grandchild_is_gone_when_the_result_comes(service: Service, host_guard: HostGuard) -> None:
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
    assert_passes(service.score(source, expected="parent leaves\n"))
    # No settling time: every process of a test is killed and reaped before its answer.
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if host_guard.marker in " ".join(p.info["cmdline"] or [])]
    assert left == [], f"sandbox processes still running after the result came: {left}"


def test_network_is_unreachable(service: Service, host_guard: HostGuard) -> None:
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
    service_port = int(service.url.rsplit(":", 1)[1])
    try:
        local = service.score(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint(s.recv(10).decode(), end='')"
        )
        # The reward service itself, which would score whatever the program asks it to.
        own = service.score(f"import socket\nsocket.create_connection(('127.0.0.1', {service_port}), timeout=2)\nprint(3)")
        outside = service.score("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint(3)")
    finally:
        done.set()
        thread.join()
        server.close()
    assert_zero(local, Reason.CRASH, "ConnectionRefusedError")
    assert_zero(own, Reason.CRASH, "ConnectionRefusedError")
    assert_zero(outside, Reason.CRASH, "Network is unreachable")
    assert accepted == []


def test_writes_outside_the_sandbox_fail_and_tmp_is_private(service: Service, host_guard: HostGuard, tmp_path: Path) -> None:
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
        assert_zero(service.score(f"open({path!r}, 'w').write('x')\nprint(3)"), Reason.CRASH, error)
        assert not Path(path).exists(), label
    assert list(host_dir.iterdir()) == []
    # /tmp inside is writable but private: nothing appears in the host's /tmp.
    assert_passes(service.score(f"open('/tmp/{host_guard.marker}', 'w').write('x')\nprint(3)"))
    assert not Path("/tmp", host_guard.marker).exists()


def test_signals_to_the_parent_reach_nothing_on_the_host(service: Service, host_guard: HostGuard) -> None:
    sentinel = subprocess.Popen(["sleep", "60"])
    targets = [os.getpid(), sentinel.pid, service.process.pid, *(w.pid for w in service.workers())]
    try:
        source = (
            "import os, signal\n"
            f"for target in (os.getppid(), 1, -1, *{targets!r}):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
            "print('still here')\n"
        )
        assert_zero(service.score(source), Reason.WRONG_ANSWER, "'still here")
        assert sentinel.poll() is None, "a host process was killed from inside the sandbox"
        assert service.process.poll() is None, "the reward service was killed from inside the sandbox"
    finally:
        sentinel.send_signal(signal.SIGKILL)
        sentinel.wait()
    headers = {"Authorization": f"Bearer {CANARIES[TOKEN_ENV]}"}
    stats = httpx.get(f"{service.url}/stats", headers=headers, timeout=10).json()
    assert stats["worker_restarts"] == 0, stats  # no worker was killed either


def test_sandbox_runs_as_an_unprivileged_user_without_capabilities(service: Service, host_guard: HostGuard) -> None:
    source = (
        "import os\n"
        "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
        "print(os.getuid(), int(status['CapEff'].strip(), 16), len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
    )
    # A private pid namespace: only the sandbox's init (bwrap or the driver) and the program are visible.
    assert_passes(service.score(source, expected=f"{CodeRewardConfig().sandbox_uid} 0 2\n"))


def test_dangerous_system_calls_fail_with_eperm(service: Service, host_guard: HostGuard) -> None:
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
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"calls = {calls!r}\n"
        "refused = {}\n"
        "for name, (number, args) in calls.items():\n"
        "    args = [os.getpid() if a == 'SELF' else ctypes.c_char_p(b'x') if a == 'NAME' else ctypes.c_long(a) for a in args]\n"
        "    ctypes.set_errno(0)\n"
        "    result = libc.syscall(ctypes.c_long(number), *args)\n"
        "    if result != -1 or ctypes.get_errno() != errno.EPERM:\n"
        "        refused[name] = [result, ctypes.get_errno()]\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
        "filtered = status['Seccomp'].strip() == '2'\n"  # SECCOMP_MODE_FILTER
        "print('denied' if filtered and not refused and os.getpid() > 0 else refused)\n"
    )
    assert_passes(service.score(source, expected="denied\n"))


def test_no_descriptor_is_inherited_beyond_stdio(service: Service, host_guard: HostGuard) -> None:
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
    assert_passes(service.score(source, expected="[0, 1, 2]\n"))


def test_core_dumps_are_disabled(service: Service, host_guard: HostGuard) -> None:
    source = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CORE))"
    assert_passes(service.score(source, expected="(0, 0)\n"))


def test_program_killing_itself_is_a_crash(service: Service, host_guard: HostGuard) -> None:
    result = service.score("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert_zero(result, Reason.CRASH, "killed by SIGSEGV")


def test_escape_sequences_on_stderr_come_back_escaped(service: Service, host_guard: HostGuard) -> None:
    source = (
        "import sys\n"
        "sys.stderr.write('\\x1b[2J\\x1b]0;owned\\x07\\r\\x9b31m red\\tend\\n')\n"
        "sys.exit(3)\n"
    )
    result = service.score(source)
    assert_zero(result, Reason.CRASH, "exit status 3")
    detail = result.tests[0].detail
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x0d\\x9b31m red\tend" in detail, detail
    assert not [c for c in detail if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F], repr(detail)


# -- the service's report and what needs no service ----------------------------------------------


def test_the_service_reports_the_caps_in_force(service: Service) -> None:
    headers = {"Authorization": f"Bearer {CANARIES[TOKEN_ENV]}"}
    caps = httpx.get(f"{service.url}/stats", headers=headers, timeout=10).json()["caps"]
    assert caps.startswith((
        "caps: cgroup v2 (memory.max=256 MiB, pids.max=16, ",
        "caps: cgroup v1 (memory.limit_in_bytes=256 MiB, pids.max=16, ",
        "caps: rlimit (per process; no cgroup: ",
    )), caps  # fmt: skip
    listening = [line for line in service.log.read_text().splitlines() if "reward service listening on" in line]
    assert len(listening) == 1 and listening[0].endswith(caps), listening


def test_interpreter_outside_usr_is_refused(tmp_path: Path) -> None:
    require_bwrap()
    fake = tmp_path / "python3"
    fake.symlink_to(sys.executable)  # e.g. a pyenv or venv interpreter under a home directory
    box = Sandbox(CodeRewardConfig(python=str(fake)))
    outcome = box.run([SandboxFile("main.py", b"print(1)")], "main.py")
    assert outcome.reason == Reason.SANDBOX_UNAVAILABLE
    assert "outside /usr" in outcome.detail


def test_escape_controls_keeps_newlines_tabs_and_text() -> None:
    assert escape_controls("a\tb\nc é ✓") == "a\tb\nc é ✓"
    assert escape_controls("\x1b[31m\x00\x7f\x85\x9b\r") == "\\x1b[31m\\x00\\x7f\\x85\\x9b\\x0d"
