"""The worker pool: mixed batches, dead and hung workers replaced, timeouts, async submit."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from asyncrl.configs.reward import RewardConfig
from asyncrl.tasks.reward.pool import RewardPool, RewardPoolError, request_budget_s
from asyncrl.tasks.reward.types import CodeTests, Reason, RewardRequest, StdioCase

if TYPE_CHECKING:
    from conftest import HostGuard  # fixtures come from tests/integration/reward/conftest.py

ECHO = "```python\nprint(input())\n```"
ECHO_TESTS = CodeTests(stdio=(StdioCase("hi\n", "hi\n"),))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def test_mixed_batch_with_a_dying_plugin_completes(pool: RewardPool) -> None:
    before = pool.stats()
    old_pids = set(pool.worker_pids())
    batch = [
        RewardRequest("math", "\\boxed{\\frac{1}{2}}", "0.5"),
        RewardRequest("plugin", "exit", "x", plugin="judge"),  # os._exit(7) inside the worker
        RewardRequest("math", "#### 5", "#### 6"),
        RewardRequest("code", ECHO, ECHO_TESTS),
        RewardRequest("plugin", "same", "same", plugin="judge"),
        RewardRequest("plugin", "raise", "x", plugin="judge"),
        RewardRequest("plugin", "labelled", "x", plugin="judge"),
        RewardRequest("plugin", "nan", "x", plugin="judge"),
    ]
    results = pool.score_sync(batch, timeout=120)
    summary = [(r.reward, r.reason) for r in results]
    assert summary == [
        (1.0, Reason.OK),
        (0.0, Reason.WORKER_DIED),
        (0.0, Reason.WRONG_ANSWER),
        (1.0, Reason.OK),
        (1.0, Reason.OK),
        (0.0, Reason.VERIFIER_ERROR),
        (0.0, Reason.WRONG_ANSWER),
        (0.0, Reason.VERIFIER_ERROR),
    ]
    assert "exit status 7" in results[1].detail
    assert "KeyError" in results[5].detail and "user_reward.py" in results[5].detail
    assert "non-finite" in results[7].detail
    after = pool.stats()
    assert after.worker_restarts == before.worker_restarts + 1
    assert after.completed == before.completed + len(batch)
    assert after.reasons_by_kind["plugin"]["worker_died"] >= 1
    # Exactly one replacement (it is published right after the dead worker's item completes).
    wait_for(lambda: len(set(pool.worker_pids()) - old_pids) == 1, "one worker replaced")
    assert len(pool.worker_pids()) == pool.size
    # The replacement serves the next batch.
    again = pool.score_sync([RewardRequest("math", "\\boxed{3}", "3")] * 4, timeout=60)
    assert [r.reason for r in again] == [Reason.OK] * 4


def test_hung_plugin_is_killed_at_its_timeout_and_replaced(pool: RewardPool) -> None:
    before = pool.stats()
    start = time.monotonic()
    results = pool.score_sync(
        [RewardRequest("plugin", "hang", "x", plugin="judge"), RewardRequest("plugin", "ok", "ok", plugin="judge")],
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert (results[0].reward, results[0].reason) == (0.0, Reason.TIMEOUT)
    assert "budget of 1.5 s" in results[0].detail and "killed and replaced" in results[0].detail
    assert (results[1].reward, results[1].reason) == (1.0, Reason.OK)
    assert elapsed < 30
    after = pool.stats()
    assert after.workers_killed_for_timeout == before.workers_killed_for_timeout + 1


def test_math_timeout_inside_the_worker_keeps_the_worker(pool: RewardPool) -> None:
    before = pool.stats()
    (result,) = pool.score_sync([RewardRequest("math", "\\boxed{9^{9^{9^{9}}}}", "5")], timeout=60)
    assert (result.reward, result.reason) == (0.0, Reason.TIMEOUT)
    assert "math-verify timed out" in result.detail
    assert pool.stats().worker_restarts == before.worker_restarts  # math-verify stopped itself


def test_worker_killed_mid_sandbox_leaves_nothing_behind(pool: RewardPool, host_guard: HostGuard) -> None:
    sleeper = "```python\nimport time\ntime.sleep(3600)\n```"
    future = pool.submit([RewardRequest("code", sleeper, ECHO_TESTS)])
    # Wait until a worker has started a sandbox, then kill that worker from outside.
    deadline = time.monotonic() + 30
    victim = None
    while victim is None and time.monotonic() < deadline:
        for pid in pool.worker_pids():
            if any(child.name() == "bwrap" for child in psutil.Process(pid).children()):
                victim = pid
        time.sleep(0.02)
    assert victim is not None, "no worker started a sandbox"
    os.kill(victim, signal.SIGKILL)
    (result,) = future.result(timeout=60)
    assert (result.reward, result.reason) == (0.0, Reason.WORKER_DIED)
    assert "signal SIGKILL" in result.detail
    wait_for(lambda: victim not in pool.worker_pids() and len(pool.worker_pids()) == pool.size, "victim replaced")
    host_guard.allow(pool.worker_pids())
    # host_guard: bwrap and the sleeping program died with their worker (--die-with-parent).


POOL_OWNER = """
import time
from asyncrl.configs.reward import RewardConfig
from asyncrl.tasks.reward.pool import RewardPool
pool = RewardPool(RewardConfig(), workers=2).start()
print(*pool.worker_pids(), flush=True)
time.sleep(600)
"""


def test_workers_die_with_a_killed_pool_process() -> None:
    """SIGKILL the process that owns the pool (a flow run killed by its Prefect worker):
    no `close()` runs, yet no worker is left."""
    import subprocess
    import sys

    import process_scan

    with subprocess.Popen([sys.executable, "-c", POOL_OWNER], stdout=subprocess.PIPE, text=True) as owner:
        try:
            assert owner.stdout is not None
            workers = [process_scan.process_record(int(pid)) for pid in owner.stdout.readline().split()]
            assert len(workers) == 2 and None not in workers
        finally:
            owner.kill()
    assert process_scan.wait_gone([w for w in workers if w is not None], timeout_s=10.0) == []


def test_async_submission_of_concurrent_batches(pool: RewardPool) -> None:
    async def main() -> list[list[float]]:
        batches = [
            [RewardRequest("math", f"\\boxed{{{i}}}", str(i)), RewardRequest("math", f"\\boxed{{{i}}}", str(i + 1))]
            for i in range(4)
        ]
        results = await asyncio.gather(*(pool.score(b) for b in batches))
        return [[r.reward for r in batch] for batch in results]

    assert asyncio.run(main()) == [[1.0, 0.0]] * 4


def test_empty_batch_and_bad_items(pool: RewardPool) -> None:
    assert pool.score_sync([]) == []
    with pytest.raises(TypeError, match=r"requests\[1\] is a str"):
        pool.submit([RewardRequest("math", "1", "1"), "not a request"])  # type: ignore[list-item]
    (result,) = pool.score_sync([RewardRequest("math", "1", ["not", "a", "string"])])
    assert result.reason == Reason.BAD_REQUEST


def test_request_budgets(pool_config: RewardConfig) -> None:
    tests = CodeTests(stdio=(StdioCase("", ""),) * 3)
    assert request_budget_s(RewardRequest("math", "", "1"), pool_config) == 2 + 2.0
    assert request_budget_s(RewardRequest("code", "", tests), pool_config) == 3 * (3.0 + 1.0) + 2.0
    short = CodeTests(stdio=tests.stdio, time_limit_s=0.5)  # the problem's own limit, under wall_s = 3.0
    assert request_budget_s(RewardRequest("code", "", short), pool_config) == 3 * (0.5 + 1.0) + 2.0
    long = CodeTests(stdio=tests.stdio, time_limit_s=60.0)  # capped by wall_s
    assert request_budget_s(RewardRequest("code", "", long), pool_config) == 3 * (3.0 + 1.0) + 2.0
    # Each plug-in's own timeout; an unknown one gets the grace (the worker answers at once).
    assert request_budget_s(RewardRequest("plugin", "", None, plugin="judge"), pool_config) == 1.5
    assert request_budget_s(RewardRequest("plugin", "", None, plugin="length"), pool_config) == 4.0
    assert request_budget_s(RewardRequest("plugin", "", None, plugin="nobody"), pool_config) == 2.0


def test_named_plugins_each_score_their_own_requests(pool: RewardPool) -> None:
    before = pool.stats()
    batch = [
        RewardRequest("plugin", "same", "same", plugin="judge"),
        RewardRequest("plugin", "same", "same", plugin="length"),
        RewardRequest("plugin", "abc", "abc", plugin="judge"),
        RewardRequest("plugin", "abcdefghij", "other", plugin="length"),
        RewardRequest("plugin", "labelled", "x", plugin="judge"),
        RewardRequest("plugin", "labelled", "x", plugin="length"),
    ]
    results = pool.score_sync(batch, timeout=60)
    assert [(r.reward, r.reason) for r in results] == [
        (1.0, Reason.OK),  # judge: exact match
        (0.04, Reason.OK),  # length: len / 100
        (1.0, Reason.OK),
        (0.1, Reason.OK),
        (0.0, Reason.WRONG_ANSWER),  # judge's labelled answer
        (0.08, Reason.OK),
    ]
    assert pool.stats().worker_restarts == before.worker_restarts


def test_unknown_plugin_name_is_a_bad_request_naming_the_known_ones(pool: RewardPool) -> None:
    before = pool.stats()
    results = pool.score_sync(
        [RewardRequest("plugin", "x", "x", plugin="nobody"), RewardRequest("plugin", "x", "x", plugin="judge")],
        timeout=60,
    )
    assert (results[0].reward, results[0].reason) == (0.0, Reason.BAD_REQUEST)
    assert "'nobody' is not configured" in results[0].detail
    assert "configured: judge, length" in results[0].detail
    assert (results[1].reward, results[1].reason) == (1.0, Reason.OK)
    assert pool.stats().worker_restarts == before.worker_restarts  # answered, not crashed


def test_plugin_request_without_plugins_is_a_bad_request() -> None:
    config = RewardConfig.model_validate({"pool": {"workers": 1, "preload_math": False}})
    with RewardPool(config) as pool:
        (result,) = pool.score_sync([RewardRequest("plugin", "x", "x", plugin="judge")], timeout=60)
    assert result.reason == Reason.BAD_REQUEST
    assert "'judge' is not configured under reward.plugins (configured: none)" in result.detail
    with pytest.raises(RewardPoolError, match="closed"):
        pool.submit([RewardRequest("math", "1", "1")])


def test_unloadable_plugin_fails_start_with_its_name(tmp_path: Path, plugin_file: Path) -> None:
    config = RewardConfig.model_validate(
        {
            "plugins": {
                "fine": {"function": f"{plugin_file}:reward"},
                "broken": {"function": f"{tmp_path / 'missing.py'}:reward"},
            },
            "pool": {"workers": 1, "preload_math": False},
        }
    )
    with pytest.raises(RewardPoolError, match=r"reward\.plugins\.broken\.function: file .*missing.py.*does not exist"):
        RewardPool(config).start()


def test_submit_before_start_is_refused(pool_config: RewardConfig) -> None:
    with pytest.raises(RewardPoolError, match="not started"):
        RewardPool(pool_config).submit([RewardRequest("math", "1", "1")])
