"""The reward service as its own process (``python -m asyncrl.tasks.reward.server``), scored
through ``RemoteRewardScorer``: real processes, real HTTP, the run root's registration.

Every service runs in a session of its own (``spawn_session``), as its supervisor starts
it, and is killed with its group at the end of its test whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from process_config_files import write_process_config

from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.tasks.system.process_group import kill_group, read_log_tail, spawn_session
from asyncrl.tasks.reward.pool import PoolStats, RewardPool
from asyncrl.tasks.reward.service_registry import TOKEN_ENV, RewardServiceInfo, read_reward_service, register_reward_service
from asyncrl.tasks.reward.remote import RemoteRewardScorer, RewardServiceRejected, RewardServiceUnavailable
from asyncrl.tasks.reward.process import MODULE
from asyncrl.tasks.reward.server import format_stats, wait_until_stopped
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult

TOKEN = "reward-test-token"
# The same verifier settings as conftest's in-process `pool`, so both must agree.
REWARD_SECTION: dict[str, Any] = {"math": {"timeout_s": 2}, "pool": {"workers": 1, "kill_grace_s": 2.0}}
MATH = [RewardRequest("math", "so 2 + 2 = \\boxed{4}", "4"), RewardRequest("math", "the answer is \\boxed{5}", "4")]
START_TIMEOUT_S = 60.0


def write_config(directory: Path, reward: dict[str, Any]) -> Path:
    """The reward service's process config of a run whose storage root is ``directory / 'store'``."""
    config = {
        "name": "reward-service-test",
        "model": {"path": str(directory / "model")},
        "data": {"train_path": str(directory / "train.parquet")},
        "storage": {"root": str(directory / "store")},
        "reward": reward,
    }
    return write_process_config(directory / "reward.yaml", config, "reward")


def without_timing(results: list[RewardResult]) -> list[RewardResult]:
    """Results with their wall times zeroed: the only fields two scorings may differ in."""
    return [replace(r, elapsed_s=0.0, tests=tuple(replace(t, wall_s=0.0) for t in r.tests)) for r in results]


def free_port(avoid: int) -> int:
    """A port free now and other than ``avoid``, so a restarted service surely moves."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port != avoid:
            return port


def still_running(processes: list[psutil.Process], timeout_s: float = 10.0) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout_s`` (a zombie waiting for
    init to reap it, the fate of an orphaned worker, counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in processes if p.is_running() and _status(p) != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _status(process: psutil.Process) -> str:
    try:
        return process.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    log: Path
    root: RunRoot

    def wait_registered(self, timeout_s: float = START_TIMEOUT_S) -> RewardServiceInfo:
        """The registration this process wrote (not a predecessor's); fails with the log if it exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = read_reward_service(self.root)
            if info is not None and info.pid == self.process.pid:
                return info
            if self.process.poll() is not None:
                pytest.fail(f"reward service exited with {self.process.returncode}:\n{read_log_tail(self.log, 40)}")
            if time.monotonic() > deadline:
                pytest.fail(f"reward service not registered after {timeout_s} s:\n{read_log_tail(self.log, 40)}")
            time.sleep(0.05)

    def workers(self) -> list[psutil.Process]:
        """The pool's worker processes (children of the service, each in a session of its own)."""
        return psutil.Process(self.process.pid).children(recursive=True)


Launcher = Callable[..., Service]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    """Starts services on one run config; every one still running at the end is killed with its group."""
    started: list[Service] = []

    def start(port: int = 0, token: str | None = TOKEN, reward: dict[str, Any] | None = None) -> Service:
        config = write_config(tmp_path, reward if reward is not None else REWARD_SECTION)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        if token is not None:
            env[TOKEN_ENV] = token
        log = tmp_path / f"service-{len(started)}.log"
        command = [sys.executable, "-m", MODULE, "--config", str(config), "--port", str(port)]
        service = Service(spawn_session(command, log, env=env), log, open_root(str(tmp_path / "store")))
        started.append(service)
        return service

    yield start
    for service in started:
        kill_group(service.process, grace_s=5.0)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunRoot, RewardServiceInfo]]:
    """One service shared by the tests that do not stop it."""
    directory = tmp_path_factory.mktemp("reward-service")
    config = write_config(directory, REWARD_SECTION)
    log = directory / "service.log"
    process = spawn_session(
        [sys.executable, "-m", MODULE, "--config", str(config)], log, env={**os.environ, TOKEN_ENV: TOKEN}
    )
    try:
        running = Service(process, log, open_root(str(directory / "store")))
        yield running.root, running.wait_registered()
    finally:
        kill_group(process, grace_s=5.0)


async def remote_score(root: RunRoot, requests: list[RewardRequest], **options: Any) -> list[RewardResult]:
    async with RemoteRewardScorer(root, **options) as scorer:
        return await scorer.score(requests)


def test_remote_results_equal_the_in_process_pool(
    service: tuple[RunRoot, RewardServiceInfo], pool: RewardPool
) -> None:
    root, _ = service
    remote = asyncio.run(remote_score(root, MATH, token=TOKEN))
    local = pool.score_sync(MATH)
    assert [r.reason for r in remote] == [Reason.OK, Reason.WRONG_ANSWER]
    assert [r.reward for r in remote] == [1.0, 0.0]
    assert without_timing(remote) == without_timing(local)
    assert asyncio.run(remote_score(root, [], token=TOKEN)) == []


def test_token_comes_from_the_environment(
    service: tuple[RunRoot, RewardServiceInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    results = asyncio.run(remote_score(service[0], MATH[:1]))
    assert results[0].reason == Reason.OK


def test_health_and_stats(service: tuple[RunRoot, RewardServiceInfo]) -> None:
    _, info = service
    headers = {"Authorization": f"Bearer {TOKEN}"}
    health = httpx.get(f"{info.url}/health", headers=headers, timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["stats"]["workers"] == 1
    stats = httpx.get(f"{info.url}/stats", headers=headers, timeout=10)
    assert stats.status_code == 200 and set(stats.json()) >= {"completed", "reasons", "worker_restarts"}
    missing = httpx.get(f"{info.url}/nothing", headers=headers, timeout=10)
    assert missing.status_code == 404 and "POST /score" in missing.json()["error"]


def test_requests_without_the_token_get_401(service: tuple[RunRoot, RewardServiceInfo]) -> None:
    root, info = service
    body = {"requests": [MATH[0].to_json()]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        answer = httpx.post(f"{info.url}/score", json=body, headers=headers, timeout=10)
        assert answer.status_code == 401, headers
        assert "Unauthorized" in answer.json()["error"]
    assert httpx.get(f"{info.url}/health", timeout=10).status_code == 401
    started = time.monotonic()
    with pytest.raises(RewardServiceRejected, match=r"HTTP 401\): Unauthorized"):
        asyncio.run(remote_score(root, MATH, token="wrong", unavailable_timeout_s=60))
    assert time.monotonic() - started < 10, "a 401 must be raised at once, not retried"


def test_a_bad_batch_gets_400_naming_the_field(service: tuple[RunRoot, RewardServiceInfo]) -> None:
    _, info = service
    body = {"requests": [MATH[0].to_json(), {"kind": "poem", "response": "x", "reference": "y"}]}
    answer = httpx.post(f"{info.url}/score", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("requests[1].kind: 'poem' is not one of")


def test_a_score_issued_while_the_service_is_down_completes_after_a_restart(
    launch: Launcher, caplog: pytest.LogCaptureFixture
) -> None:
    first = launch()
    first_info = first.wait_registered()
    first_workers = first.workers()
    assert first_workers, "the pool has no worker process"

    async def scenario() -> tuple[list[RewardResult], list[RewardResult], RewardServiceInfo]:
        async with RemoteRewardScorer(first.root, token=TOKEN, unavailable_timeout_s=120) as scorer:
            before = await scorer.score(MATH)
            os.killpg(first.process.pid, signal.SIGKILL)
            first.process.wait()
            pending = asyncio.create_task(scorer.score(MATH))
            await asyncio.sleep(1.0)
            assert not pending.done(), "score() returned while no service was up"
            second = launch(port=free_port(avoid=int(first_info.url.rsplit(":", 1)[1])))
            second_info = await asyncio.to_thread(second.wait_registered)
            after = await asyncio.wait_for(pending, timeout=60)
            return before, after, second_info

    with caplog.at_level(logging.INFO, logger="asyncrl.reward.remote"):
        before, after, second_info = asyncio.run(scenario())
    assert second_info.url != first_info.url
    assert without_timing(after) == without_timing(before)
    assert [r.reason for r in after] == [Reason.OK, Reason.WRONG_ANSWER]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per outage, not per attempt
    assert first_info.url in warnings[0].getMessage()
    assert any(second_info.url in r.getMessage() and "answers again" in r.getMessage() for r in caplog.records)
    left = still_running(first_workers)
    assert not left, f"workers of the killed service left running: {left}"


def test_sigterm_stops_serving_and_leaves_no_worker(launch: Launcher) -> None:
    running = launch()
    running.wait_registered()
    workers = running.workers()
    assert workers, "the pool has no worker process"
    assert kill_group(running.process, grace_s=30.0) == 0, read_log_tail(running.log, 40)
    left = still_running(workers)
    assert not left, f"workers left running after SIGTERM: {left}"
    assert read_reward_service(running.root) is None, "a stopped service must remove its registration"


@pytest.mark.parametrize(
    ("reward", "field"),
    [
        ({"pool": {"workers": 0}}, "reward.pool.workers"),
        ({"math": {"timeout": 3}}, "reward.math.timeout: unknown key"),
    ],
)
def test_a_bad_config_exits_2_naming_the_field(tmp_path: Path, reward: dict[str, Any], field: str) -> None:
    config = write_config(tmp_path, {})
    written = yaml.safe_load(config.read_text())  # a process config edited by hand
    for key, value in reward.items():
        written["reward"][key] = {**written["reward"].get(key, {}), **value}
    config.write_text(yaml.safe_dump(written))
    done = subprocess.run(
        [sys.executable, "-m", MODULE, "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert field in done.stderr
    assert "Traceback" not in done.stderr


def test_a_pool_that_cannot_start_exits_1_with_its_error(launch: Launcher) -> None:
    broken = launch(reward={"plugins": {"judge": {"function": "/nonexistent/user_reward.py:reward"}}, "pool": {"workers": 1}})
    assert broken.process.wait(timeout=START_TIMEOUT_S) == 1
    log = read_log_tail(broken.log, 40)
    assert "reward pool failed to start" in log and "/nonexistent/user_reward.py" in log, log
    assert read_reward_service(broken.root) is None


def test_the_client_gives_up_after_the_timeout_naming_the_url(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    with pytest.raises(RewardServiceUnavailable, match=r"never registered.*service\.json does not exist"):
        asyncio.run(remote_score(root, MATH, unavailable_timeout_s=0.3))
    dead = f"http://127.0.0.1:{free_port(avoid=0)}"
    register_reward_service(root, dead, pid=1)
    started = time.monotonic()
    with pytest.raises(RewardServiceUnavailable, match=rf"reward service {dead} unavailable for 0.5 s; last error: .*ConnectError"):
        asyncio.run(remote_score(root, MATH, unavailable_timeout_s=0.5))
    assert time.monotonic() - started < 5


def test_format_stats_lists_reasons() -> None:
    stats = PoolStats(
        workers=2, completed=5, pending=1, busy=1, reasons={"ok": 3, "timeout": 2},
        reasons_by_kind={"math": {"ok": 3, "timeout": 2}}, worker_restarts=2, workers_killed_for_timeout=2,
    )  # fmt: skip
    line = format_stats(stats)
    assert "5 scored" in line and "ok=3, timeout=2" in line and "worker restarts 2 (2 killed for timeouts)" in line


class _StubPool:
    """What ``wait_until_stopped`` reads of a pool: its health and stats."""

    def __init__(self) -> None:
        self.healthy = True
        self.error: str | None = None

    def stats(self) -> PoolStats:
        return PoolStats(2, 7, 0, 0, {"ok": 7}, {"math": {"ok": 7}}, 0, 0)


def test_the_service_logs_its_stats_periodically_and_stops_on_a_broken_pool(caplog: pytest.LogCaptureFixture) -> None:
    pool = _StubPool()
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with caplog.at_level(logging.INFO, logger="asyncrl.reward.server"):
        assert wait_until_stopped(pool, stop, every_s=0.02, report_every_s=0.1) is None  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if "reward pool:" in r.getMessage()]
    assert len(lines) >= 2 and all("7 scored" in line and "ok=7" in line for line in lines), lines
    pool.healthy, pool.error = False, "dispatcher crashed"
    assert wait_until_stopped(pool, threading.Event(), every_s=0.02) == "dispatcher crashed"  # type: ignore[arg-type]
