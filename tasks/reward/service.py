"""The reward service as Prefect tasks: thin wrappers over the pool.

The flow owns the pool's life (``with RewardPool(config) as pool:``: its worker
processes are killed when the block ends, on success, failure or cancel). Inside it,
``reward_service`` runs beside the scheduler (``reward_service.submit(pool, stop)`` on
the default thread task runner): it watches the pool, logs the reason counts, and
fails (raising) if the pool breaks, so the flow sees it. The scheduler scores
batches with ``await pool.score(batch)`` directly or through ``score_rewards``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from asyncrl.tasks.reward.pool import PoolStats, RewardPool, RewardPoolError
from asyncrl.tasks.reward.types import RewardRequest, RewardResult


def supervise_pool(
    pool: RewardPool, stop: threading.Event, every_s: float, report: Callable[[PoolStats], None]
) -> PoolStats:
    """Report the pool's stats every ``every_s`` until ``stop`` is set; raise if the pool breaks.

    Dead workers are replaced by the pool itself; a broken pool (workers that cannot
    load, a crashed dispatcher) cannot heal and raises RewardPoolError.
    """
    if every_s <= 0:
        raise ValueError(f"supervise_pool: every_s must be > 0, got {every_s}")
    while True:
        stopped = stop.wait(every_s)
        if not pool.healthy:
            raise RewardPoolError(f"reward pool is down: {pool.error or 'not running'}")
        stats = pool.stats()
        report(stats)
        if stopped:
            return stats


def format_stats(stats: PoolStats) -> str:
    """One log line: completed items, reason counts, worker restarts."""
    reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(stats.reasons.items())) or "none"
    return (
        f"reward pool: {stats.completed} scored, {stats.pending} pending, {stats.busy}/{stats.workers} busy; "
        f"reasons: {reasons}; worker restarts {stats.worker_restarts} "
        f"({stats.workers_killed_for_timeout} killed for timeouts)"
    )


@task(name="reward-service", cache_policy=NO_CACHE)
def reward_service(pool: RewardPool, stop: threading.Event, report_every_s: float = 30.0) -> dict[str, Any]:
    """Supervise a started pool until ``stop`` is set; returns its final stats as a dict."""
    logger = _logger()
    stats = supervise_pool(pool, stop, report_every_s, lambda s: logger.info(format_stats(s)))
    return asdict(stats)


@task(name="score-rewards", cache_policy=NO_CACHE)
def score_rewards(pool: RewardPool, requests: Sequence[RewardRequest]) -> list[RewardResult]:
    """Score one batch in the pool (blocking; one result per request, in order)."""
    return pool.score_sync(requests)


def _logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger inside a run; a plain logger when the task's .fn is called directly."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("asyncrl.reward")
