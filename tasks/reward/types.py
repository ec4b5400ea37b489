"""What the reward service takes and gives back: requests, results and failure reasons.

Every result carries a reason. A reward of 0 never comes without one, so a broken
verifier cannot pass for a bad policy, and the reasons are counted by the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, get_args


class Reason(StrEnum):
    """Why an item got its reward.

    ``ok`` means the verifier ran to the end and the reward is its verdict (1.0 for a
    correct math answer or a program that passed every test). Every other value is a
    failure whose reward is 0 (or, for code scored by fraction, the failed tests' share).
    """

    OK = "ok"
    WRONG_ANSWER = "wrong_answer"
    """The answer or the program's output differs from the reference."""
    NO_ANSWER = "no_answer"
    """No final answer or no program could be extracted from the response."""
    TIMEOUT = "timeout"
    """A wall-time or CPU-time limit was hit (verifier, program or plug-in)."""
    MEMORY = "memory"
    """The program ran out of its address-space limit."""
    PROCESS_LIMIT = "process_limit"
    """The program could not fork: its process limit was reached (a fork bomb)."""
    OUTPUT_LIMIT = "output_limit"
    """The program wrote more than the output cap, or a file over the file-size limit."""
    CRASH = "crash"
    """The program exited with an error or was killed by a signal."""
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    """bubblewrap is missing or cannot start, and the unsandboxed mode is not allowed."""
    VERIFIER_ERROR = "verifier_error"
    """The verifier itself raised (math-verify, a user plug-in) or returned a bad value."""
    WORKER_DIED = "worker_died"
    """The worker process scoring the item died; the pool replaced it."""
    BAD_REQUEST = "bad_request"
    """The request cannot be scored as given (unknown kind, no plug-in configured, ...)."""


RequestKind = Literal["math", "code", "plugin"]
REQUEST_KINDS: tuple[str, ...] = get_args(RequestKind)


@dataclass(frozen=True)
class StdioCase:
    """One stdin/stdout test: the program reads ``input`` and must print ``output``."""

    input: str
    output: str


@dataclass(frozen=True)
class CodeTests:
    """Unit tests of one coding problem.

    ``stdio`` cases feed stdin and compare stdout; each ``asserts`` entry is Python code
    appended to the program and run as one script that must exit with status 0.
    """

    stdio: tuple[StdioCase, ...] = ()
    asserts: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.stdio) + len(self.asserts)


@dataclass(frozen=True)
class RewardRequest:
    """One item to score.

    - math: ``reference`` is the gold answer (``42``, ``\\frac{1}{2}``, a GSM8K
      solution ending in ``#### 42``, ...).
    - code: ``reference`` is a :class:`CodeTests`.
    - plugin: ``reference`` is passed unchanged to the configured user function.
    """

    kind: RequestKind
    response: str
    reference: Any
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in REQUEST_KINDS:
            raise ValueError(f"RewardRequest.kind: {self.kind!r} is not one of {list(REQUEST_KINDS)}")
        if not isinstance(self.response, str):
            raise ValueError(f"RewardRequest.response: expected str, got {type(self.response).__name__}")
        if self.kind == "code" and not isinstance(self.reference, CodeTests):
            raise ValueError(
                f"RewardRequest.reference: a code request needs CodeTests, got {type(self.reference).__name__}"
            )


@dataclass(frozen=True)
class TestOutcome:
    """The result of one unit test of a program."""

    __test__ = False  # not a pytest class

    name: str
    passed: bool
    reason: Reason
    detail: str = ""
    wall_s: float = 0.0


@dataclass(frozen=True)
class RewardResult:
    """The reward of one item and why."""

    reward: float
    reason: Reason
    detail: str = ""
    tests: tuple[TestOutcome, ...] = ()
    sandboxed: bool | None = None
    """For code: True in bubblewrap, False in the explicitly allowed unsandboxed mode."""
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"RewardResult.reward: must be finite, got {self.reward}")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able form (used by the CLI's ``--json``)."""
        return {
            "reward": self.reward,
            "reason": self.reason.value,
            "detail": self.detail,
            "sandboxed": self.sandboxed,
            "elapsed_s": round(self.elapsed_s, 4),
            "tests": [
                {
                    "name": t.name,
                    "passed": t.passed,
                    "reason": t.reason.value,
                    "detail": t.detail,
                    "wall_s": round(t.wall_s, 4),
                }
                for t in self.tests
            ],
        }


def failure(reason: Reason, detail: str, elapsed_s: float = 0.0, sandboxed: bool | None = None) -> RewardResult:
    """A zero reward with its reason."""
    if reason == Reason.OK:
        raise ValueError("failure(): reason must not be 'ok'")
    return RewardResult(reward=0.0, reason=reason, detail=detail, elapsed_s=elapsed_s, sandboxed=sandboxed)
