"""The reward service: math answers checked with math-verify, code run against unit tests
in a bubblewrap sandbox, and user plug-in rewards, scored in a pool of worker processes.

Every result carries a reason (``Reason``); a verifier crash or timeout is a zero reward
with its reason, never a crashed service. The service process of a run is ``server``
(imported separately so this package stays light).
"""

from __future__ import annotations

from asyncrl.configs.reward import RewardConfig
from asyncrl.tasks.reward.pool import PoolStats, RewardPool, RewardPoolError
from asyncrl.tasks.reward.types import (
    CallCase,
    CodeTests,
    Reason,
    RewardRequest,
    RewardResult,
    StdioCase,
    TestOutcome,
)

__all__ = [
    "CallCase",
    "CodeTests",
    "PoolStats",
    "Reason",
    "RewardConfig",
    "RewardPool",
    "RewardPoolError",
    "RewardRequest",
    "RewardResult",
    "StdioCase",
    "TestOutcome",
]
