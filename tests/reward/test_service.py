"""The Prefect-facing service: supervision reports stats, stops on request, fails on a broken pool."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncrl.tasks.reward.config import RewardConfig
from asyncrl.tasks.reward.pool import PoolStats, RewardPool, RewardPoolError
from asyncrl.tasks.reward.service import format_stats, reward_service, score_rewards, supervise_pool
from asyncrl.tasks.reward.types import Reason, RewardRequest


def test_reward_service_reports_until_stopped(pool: RewardPool) -> None:
    stop = threading.Event()
    with ThreadPoolExecutor(1) as executor:
        running = executor.submit(reward_service.fn, pool, stop, 0.05)
        results = score_rewards.fn(pool, [RewardRequest("math", "\\boxed{4}", "4"), RewardRequest("math", "5", "4")])
        stop.set()
        final = running.result(timeout=30)
    assert [r.reason for r in results] == [Reason.OK, Reason.WRONG_ANSWER]
    assert final["completed"] >= 2
    assert final["reasons"]["ok"] >= 1 and final["reasons"]["wrong_answer"] >= 1


def test_supervision_raises_when_the_pool_is_down() -> None:
    config = RewardConfig.model_validate({"pool": {"workers": 1, "preload_math": False}})
    pool = RewardPool(config).start()
    reports: list[PoolStats] = []
    pool.close()
    with pytest.raises(RewardPoolError, match="reward pool is down"):
        supervise_pool(pool, threading.Event(), 0.01, reports.append)
    assert reports == []


def test_format_stats_lists_reasons() -> None:
    stats = PoolStats(
        workers=2, completed=5, pending=1, busy=1, reasons={"ok": 3, "timeout": 2},
        reasons_by_kind={"math": {"ok": 3, "timeout": 2}}, worker_restarts=2, workers_killed_for_timeout=2,
    )  # fmt: skip
    line = format_stats(stats)
    assert "5 scored" in line and "ok=3, timeout=2" in line and "worker restarts 2 (2 killed for timeouts)" in line
