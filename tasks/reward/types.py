"""What the reward service takes and gives back: requests, results and failure reasons.

Every result carries a reason. A reward of 0 never comes without one, so a broken
verifier cannot pass for a bad policy, and the reasons are counted by the pool.

Each type has a JSON form (``to_json`` / ``from_json``) for the reward service's HTTP
API. It is exact: ``X.from_json(json.loads(json.dumps(x.to_json()))) == x`` for every
field (floats are not rounded), except that a plug-in reference or metadata holding
tuples comes back with lists (JSON has no tuples). ``from_json`` refuses unknown keys
and wrong types with a ``ValueError`` that names the field, so a client of another
version fails loudly instead of losing a field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from collections.abc import Sequence
from typing import Any, Literal, Protocol, get_args

_NUMBER = (int, float)


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

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output}

    @classmethod
    def from_json(cls, data: Any, where: str = "StdioCase") -> StdioCase:
        data = _object(data, where, required=("input", "output"))
        return cls(input=_typed(data, "input", where, str), output=_typed(data, "output", where, str))


@dataclass(frozen=True)
class CallCase:
    """One function-call test: ``function(*arguments)`` must return ``expected``.

    ``arguments`` is the JSON text of the argument list and ``expected`` the JSON text of the
    return value (APPS/TACO ``fn_name`` cases, LiveCodeBench functional cases). ``function``
    is a top-level function of the program or, failing that, a method of its ``Solution``
    class (LeetCode style). A returned tuple compares as a list; an ``expected`` that is a
    one-element list also accepts its element (APPS wraps return values in a list).
    """

    function: str
    arguments: str
    expected: str

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "arguments": self.arguments, "expected": self.expected}

    @classmethod
    def from_json(cls, data: Any, where: str = "CallCase") -> CallCase:
        data = _object(data, where, required=("function", "arguments", "expected"))
        return cls(
            function=_typed(data, "function", where, str),
            arguments=_typed(data, "arguments", where, str),
            expected=_typed(data, "expected", where, str),
        )


@dataclass(frozen=True)
class CodeTests:
    """Unit tests of one coding problem.

    ``stdio`` cases feed stdin and compare stdout; each ``asserts`` entry is Python code
    appended to the program and run as one script that must exit with status 0; each
    ``calls`` case calls one of the program's functions (:class:`CallCase`).
    ``time_limit_s``, when set, is this problem's wall-time limit per test (the row's own
    time limit); the sandbox's configured limits still cap it.
    """

    stdio: tuple[StdioCase, ...] = ()
    asserts: tuple[str, ...] = ()
    calls: tuple[CallCase, ...] = ()
    time_limit_s: float | None = None

    @property
    def count(self) -> int:
        return len(self.stdio) + len(self.asserts) + len(self.calls)

    def to_json(self) -> dict[str, Any]:
        """The tests file format of ``code_reward`` (``{"stdio": [...], "asserts": [...], ...}``)."""
        data: dict[str, Any] = {"stdio": [case.to_json() for case in self.stdio], "asserts": list(self.asserts)}
        if self.calls:
            data["calls"] = [case.to_json() for case in self.calls]
        if self.time_limit_s is not None:
            data["time_limit_s"] = self.time_limit_s
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "CodeTests") -> CodeTests:
        """Unlike a tests file, empty tests are accepted: the scorer answers them with bad_request."""
        data = _object(data, where, optional=("stdio", "asserts", "calls", "time_limit_s"))
        stdio = _typed(data, "stdio", where, list, default=[])
        asserts = _typed(data, "asserts", where, list, default=[])
        calls = _typed(data, "calls", where, list, default=[])
        time_limit = _typed(data, "time_limit_s", where, (*_NUMBER, type(None)), default=None)
        for i, code in enumerate(asserts):
            if not isinstance(code, str):
                raise ValueError(f"{where}.asserts[{i}]: expected str, got {type(code).__name__}")
        if time_limit is not None and not (math.isfinite(time_limit) and time_limit > 0):
            raise ValueError(f"{where}.time_limit_s: must be a positive number, got {time_limit!r}")
        return cls(
            stdio=tuple(StdioCase.from_json(case, f"{where}.stdio[{i}]") for i, case in enumerate(stdio)),
            asserts=tuple(asserts),
            calls=tuple(CallCase.from_json(case, f"{where}.calls[{i}]") for i, case in enumerate(calls)),
            time_limit_s=None if time_limit is None else float(time_limit),
        )


@dataclass(frozen=True)
class RewardRequest:
    """One item to score.

    - math: ``reference`` is the gold answer (``42``, ``\\frac{1}{2}``, a GSM8K
      solution ending in ``#### 42``, ...).
    - code: ``reference`` is a :class:`CodeTests`.
    - plugin: ``reference`` is passed unchanged to the user function configured under
      ``reward.plugins[plugin]``, with ``metadata`` as keyword arguments.
    """

    kind: RequestKind
    response: str
    reference: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    plugin: str = ""
    """The name of the plug-in that scores a ``plugin`` request (empty for math and code)."""

    def __post_init__(self) -> None:
        if self.kind not in REQUEST_KINDS:
            raise ValueError(f"RewardRequest.kind: {self.kind!r} is not one of {list(REQUEST_KINDS)}")
        if not isinstance(self.response, str):
            raise ValueError(f"RewardRequest.response: expected str, got {type(self.response).__name__}")
        if self.kind == "code" and not isinstance(self.reference, CodeTests):
            raise ValueError(
                f"RewardRequest.reference: a code request needs CodeTests, got {type(self.reference).__name__}"
            )
        if (self.kind == "plugin") != bool(self.plugin):
            raise ValueError(
                f"RewardRequest.plugin: a plugin request names its plug-in and no other request does "
                f"(kind {self.kind!r}, plugin {self.plugin!r})"
            )

    def to_json(self) -> dict[str, Any]:
        """JSON form; a plug-in's reference and the metadata must be JSON-able as they are."""
        reference = self.reference.to_json() if isinstance(self.reference, CodeTests) else self.reference
        data = {"kind": self.kind, "response": self.response, "reference": reference, "metadata": dict(self.metadata)}
        if self.plugin:
            data["plugin"] = self.plugin
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "RewardRequest") -> RewardRequest:
        data = _object(data, where, required=("kind", "response", "reference"), optional=("metadata", "plugin"))
        kind = _typed(data, "kind", where, str)
        if kind not in REQUEST_KINDS:
            raise ValueError(f"{where}.kind: {kind!r} is not one of {list(REQUEST_KINDS)}")
        reference = data["reference"]
        if kind == "code":
            reference = CodeTests.from_json(reference, f"{where}.reference")
        return cls(
            kind=kind,
            response=_typed(data, "response", where, str),
            reference=reference,
            metadata=dict(_typed(data, "metadata", where, dict, default={})),
            plugin=_typed(data, "plugin", where, str, default=""),
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

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "reason": self.reason.value,
            "detail": self.detail,
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "TestOutcome") -> TestOutcome:
        data = _object(data, where, required=("name", "passed", "reason"), optional=("detail", "wall_s"))
        return cls(
            name=_typed(data, "name", where, str),
            passed=_typed(data, "passed", where, bool),
            reason=_reason(data, where),
            detail=_typed(data, "detail", where, str, default=""),
            wall_s=float(_typed(data, "wall_s", where, _NUMBER, default=0.0)),
        )


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
        """Plain JSON-able form (the CLI's ``--json``, the reward service's answers); not
        rounded, so that :meth:`from_json` gives back an equal result."""
        return {
            "reward": self.reward,
            "reason": self.reason.value,
            "detail": self.detail,
            "sandboxed": self.sandboxed,
            "elapsed_s": self.elapsed_s,
            "tests": [t.to_json() for t in self.tests],
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "RewardResult") -> RewardResult:
        data = _object(
            data, where, required=("reward", "reason"), optional=("detail", "sandboxed", "elapsed_s", "tests")
        )
        tests = _typed(data, "tests", where, list, default=[])
        return cls(
            reward=float(_typed(data, "reward", where, _NUMBER)),
            reason=_reason(data, where),
            detail=_typed(data, "detail", where, str, default=""),
            tests=tuple(TestOutcome.from_json(test, f"{where}.tests[{i}]") for i, test in enumerate(tests)),
            sandboxed=_typed(data, "sandboxed", where, (bool, type(None)), default=None),
            elapsed_s=float(_typed(data, "elapsed_s", where, _NUMBER, default=0.0)),
        )


def failure(reason: Reason, detail: str, elapsed_s: float = 0.0, sandboxed: bool | None = None) -> RewardResult:
    """A zero reward with its reason."""
    if reason == Reason.OK:
        raise ValueError("failure(): reason must not be 'ok'")
    return RewardResult(reward=0.0, reason=reason, detail=detail, elapsed_s=elapsed_s, sandboxed=sandboxed)


def _object(data: Any, where: str, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data`` as a JSON object holding every required key and no unknown one: a misspelt
    or newer field must be refused, not silently dropped."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [key for key in required if key not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    unknown = sorted(str(key) for key in set(data) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {[*required, *optional]}")
    return data


_NO_DEFAULT: Any = object()


def _typed(
    data: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = _NO_DEFAULT
) -> Any:
    """``data[key]`` checked against ``kind`` (``default`` when absent and one is given).
    ``bool`` is not accepted as a number, though Python counts it as an int."""
    if key not in data and default is not _NO_DEFAULT:
        return default
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{where}.{key}: expected {names}, got {type(value).__name__} {value!r:.80}")
    return value


def _reason(data: dict[str, Any], where: str) -> Reason:
    value = _typed(data, "reason", where, str)
    try:
        return Reason(value)
    except ValueError:
        raise ValueError(f"{where}.reason: {value!r} is not one of {[r.value for r in Reason]}") from None


class RewardScorer(Protocol):
    """What a caller needs of the reward service: a batch of requests scored in order."""

    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]: ...
