"""Shared fixtures for the reward service tests: host snapshots, a sandbox, a running pool."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from asyncrl.configs.reward import CodeRewardConfig, RewardConfig, SandboxLimits
from asyncrl.tasks.reward.pool import RewardPool
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_outcome import SandboxFile
from asyncrl.tasks.reward.types import Reason

SANDBOX_UID = CodeRewardConfig().sandbox_uid

PLUGIN_SOURCE = '''
import os
import time


def reward(response, reference, **metadata):
    """Exact match; special responses misbehave to exercise the pool."""
    if response == "exit":
        os._exit(7)
    if response == "hang":
        time.sleep(3600)
    if response == "raise":
        raise KeyError("no such key")
    if response == "nan":
        return float("nan")
    if response == "labelled":
        return 0.0, "wrong_answer"
    return 1.0 if response == reference else 0.0


def length(response, reference, **metadata):
    """A second plug-in: tells its requests apart from the first's by what it returns."""
    return len(response) / 100, "ok"
'''


def require_bwrap() -> None:
    """Skip when bubblewrap is not installed (CI installs it with apt-get)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    """A working bubblewrap sandbox with small limits; fails (not skips) if bwrap exists but cannot run."""
    require_bwrap()
    box = Sandbox(CodeRewardConfig(limits=SandboxLimits(cpu_s=1, wall_s=3.0, memory_mb=256, nproc=16)))
    probe = box.run([SandboxFile("main.py", b"print('ready')")], "main.py")
    assert probe.reason == Reason.OK and probe.stdout == b"ready\n", probe
    return box


@dataclass(frozen=True)
class HostSnapshot:
    pids: frozenset[int]
    temp_entries: frozenset[str]
    connections: frozenset[tuple[object, ...]]


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _held_by_another(proc: psutil.Process, ours: frozenset[int]) -> bool:
    """The process's first ancestor outside the sandbox uid is a live process that is neither
    ours nor init: a sandbox another test (the other xdist worker's reward service) is running
    now. A sandbox left behind by ours is held by one of ours or, orphaned, by init."""
    try:
        for parent in proc.parents():
            if parent.uids().real != SANDBOX_UID:
                return parent.pid not in ours and parent.pid != 1
    except psutil.NoSuchProcess:
        return False
    return False


def _suspects(marker: str, before: frozenset[int]) -> list[str]:
    """Processes that may belong to a sandbox: any of the sandbox uid (when we are root) not
    held by another test's live process, our descendants started since the snapshot, anything
    with the marker in its command line."""
    found: list[str] = []
    descendants = {p.pid for p in _descendants()}
    ours = frozenset({os.getpid(), *descendants})
    mine = descendants - before
    for proc in psutil.process_iter(["pid", "uids", "cmdline", "status"]):
        info = proc.info
        cmdline = " ".join(info["cmdline"] or [])
        uid = info["uids"].real if info["uids"] else None
        sandbox_uid = os.geteuid() == 0 and uid == SANDBOX_UID and not _held_by_another(proc, ours)
        if sandbox_uid or info["pid"] in mine or marker in cmdline:
            found.append(f"pid {info['pid']} uid {uid} {info['status']}: {cmdline[:120]!r}")
    return found


def _connections(services: frozenset[int]) -> frozenset[tuple[object, ...]]:
    """Internet connections of this process and its descendants, except ``services``: the
    session's long-lived servers (SeaweedFS, vLLM, Prefect), whose internal loopback traffic
    (e.g. ``weed mini``'s master, volume and filer talking to each other) is not a sandbox's."""
    conns: set[tuple[object, ...]] = set()
    for proc in [psutil.Process(), *(p for p in _descendants() if p.pid not in services)]:
        try:
            for c in proc.net_connections(kind="inet"):
                conns.add((proc.pid, c.laddr, c.raddr, c.status))
        except psutil.NoSuchProcess:
            continue
    return frozenset(conns)


class HostGuard:
    """Snapshot of the host around one hostile run: processes, temp files, connections."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.services = frozenset(p.pid for p in _descendants())
        self.before = self._snapshot()
        self.allowed: set[int] = set()

    def allow(self, pids: list[int]) -> None:
        """New processes the test started on purpose (a pool's replacement workers)."""
        self.allowed.update(pids)

    def _snapshot(self) -> HostSnapshot:
        return HostSnapshot(
            pids=frozenset(psutil.pids()),
            temp_entries=frozenset(os.listdir(tempfile.gettempdir())),
            connections=_connections(self.services),
        )

    def _from_a_sandbox(self, entry: str) -> bool:
        """A temp dir entry a sandbox (or the unsandboxed mode's temp dir) could have left: with the
        marker, of the sandbox uid, or ``asyncrl-unsandboxed-*``. Other asyncrl temp entries come
        from other processes sharing the machine's /tmp (concurrent test runs)."""
        if self.marker in entry or entry.startswith("asyncrl-unsandboxed-"):
            return True
        try:
            return os.lstat(os.path.join(tempfile.gettempdir(), entry)).st_uid == SANDBOX_UID
        except OSError:
            return False  # gone already

    def assert_clean(self, settle_s: float = 10.0) -> None:
        """No sandbox process left (zombies included, after the host's init reaps them), no new
        temp dir entry from a sandbox, no new connection of this process tree."""
        deadline = time.monotonic() + settle_s
        while True:
            left = _suspects(self.marker, self.before.pids | self.allowed)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"processes left behind: {left}"
        after = self._snapshot()
        new_temp = [e for e in after.temp_entries - self.before.temp_entries if self._from_a_sandbox(e)]
        assert not new_temp, f"new host temp entries: {new_temp}"
        new_conns = after.connections - self.before.connections
        assert not new_conns, f"new connections: {new_conns}"


@pytest.fixture
def host_guard(request: pytest.FixtureRequest) -> Iterator[HostGuard]:
    marker = f"asyncrl-hostile-{os.getpid()}-{request.node.name.replace('[', '-').replace(']', '')}"
    guard = HostGuard(marker)
    yield guard
    guard.assert_clean()


@pytest.fixture(scope="session")
def plugin_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plugin") / "user_reward.py"
    path.write_text(PLUGIN_SOURCE, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def pool_config(plugin_file: Path) -> RewardConfig:
    return RewardConfig.model_validate(
        {
            "math": {"timeout_s": 2},
            "code": {"limits": {"cpu_s": 1, "wall_s": 3.0, "memory_mb": 256}},
            "plugins": {
                "judge": {"function": f"{plugin_file}:reward", "timeout_s": 1.5},
                "length": {"function": f"{plugin_file}:length", "timeout_s": 4.0},
            },
            "pool": {"workers": 2, "kill_grace_s": 2.0},
        }
    )


@pytest.fixture(scope="session")
def pool(pool_config: RewardConfig) -> Iterator[RewardPool]:
    with RewardPool(pool_config) as running:
        yield running
