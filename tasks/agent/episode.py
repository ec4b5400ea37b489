"""Users' agent episodes: what one gets, how it is run, and what it leaves behind.

An episode is ordinary async Python: a function of an :class:`EpisodeContext` that talks to
the model with the official ``openai`` client (``base_url=context.base_url``), runs its own
tools, and returns None or a reward of its own. Every model call goes through the recording
endpoint (:mod:`asyncrl.tasks.inference.proxy`), which keeps the exact tokens the model
sampled and those inserted between turns. The runner here opens an episode there, calls
the user's function under a time limit, and closes it; whatever the function does
(returns, raises, hangs) the run goes on, and :class:`EpisodeOutcome` says which.
An episode's id is stable (:func:`stable_episode_id`), so the idempotency key of each tool
call (:meth:`EpisodeContext.tool_call_key`) repeats when the same turn is run again.
An example episode: ``docs/internals/agent.md``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import numbers
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.reward.plugin import load_plugin
from asyncrl.tasks.inference.conversation import EpisodeTokens
from asyncrl.tasks.inference.tool_calls import tool_call_id

EPISODE_API_KEY = "asyncrl-episode"
"""What :attr:`EpisodeContext.api_key` holds: the endpoint listens on 127.0.0.1 only and
checks no key (the ``openai`` client insists on one). Never a real credential."""
EPISODE_ERROR = "episode_error"
EPISODE_TIMEOUT = "episode_timeout"
EPISODE_OVER_BUDGET = "episode_over_budget"
MAX_SCOPE_CHARS = 64
"""Longest scope kept verbatim in an episode id (:func:`stable_episode_id`)."""


@dataclass(frozen=True)
class EpisodeContext:
    """What the user's episode function gets."""

    row: PromptRecord
    """The prompt row: ``prompt``, ``answer`` (the reference), ``task``, ``fields``."""
    base_url: str
    """OpenAI-compatible endpoint of this episode (chat completions and completions)."""
    api_key: str
    model: str
    """Any model name is accepted; this is the run's model path, for logs."""
    sample_index: int
    """0..n-1: which of the group's n episodes this is."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """``rollout.episode.options``."""
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This episode's stable id (:func:`stable_episode_id`): ``<run name>.<group id>.<sample
    index>`` in training, ``<run name>.v<version>.eval-<prompt>.<sample index>`` in held-out
    evaluation; the same whenever this episode is run again (a retry after a crash, a group
    generated again). A context built by hand gets a random one."""

    def tool_call_key(self, turn: int, index: int = 0) -> str:
        """Idempotency key of the ``index``-th tool call of model turn ``turn`` (both from 0;
        turn t is the (t+1)-th model call the endpoint recorded, a refused or failed call
        being none): ``call_<episode_id>_<turn>_<index>``,
        the ``id`` the endpoint gives that call. For tool calls an episode parses itself
        (completions); the contract is in ``docs/agents.md``."""
        if turn < 0 or index < 0:
            raise ValueError(f"tool_call_key: turn and index count from 0, got turn={turn}, index={index}")
        return tool_call_id(self.episode_id, turn, index)


EpisodeFunction = Callable[[EpisodeContext], Awaitable[Any]]


class EpisodeRecorder(Protocol):
    """The recording endpoint as the runner uses it (:class:`~asyncrl.tasks.inference.proxy.RecordingProxy`)."""

    def open_episode(self, episode_id: str) -> str: ...

    def close_episode(self, episode_id: str) -> EpisodeTokens | None: ...


@dataclass(frozen=True)
class EpisodeOutcome:
    """How one episode ended."""

    tokens: EpisodeTokens | None
    """What the model generated and what was inserted between turns (None: no model call)."""
    reward: float | None
    """The episode's own reward; None when it left scoring to the row's reward or failed."""
    failure: str | None
    """None, or ``<kind>: <detail>`` with kind ``episode_error`` (it raised or returned
    something that is no reward), ``episode_over_budget`` (it raised after its token budget
    ran out, e.g. on the endpoint's refusal of one more turn) or ``episode_timeout``."""
    submitted_at: float
    finished_at: float

    @property
    def failed(self) -> bool:
        return self.failure is not None


def stable_episode_id(scope: str, group: str, sample_index: int) -> str:
    """``<scope>.<group>.<sample_index>``: the id of one episode of a group, a function of where
    it stands in the run only, so a retry or a resume of it gets the same id. ``scope`` names
    the run (its name; an evaluation adds the version), so no two runs share ids. A scope of
    more than :data:`MAX_SCOPE_CHARS` characters becomes its first 47 and 16 hex digits of its
    sha256, so the id fits the endpoint's 128 characters."""
    if len(scope) > MAX_SCOPE_CHARS:
        scope = f"{scope[:47]}-{hashlib.sha256(scope.encode()).hexdigest()[:16]}"
    return f"{scope}.{group}.{sample_index}"


def load_episode(spec: str, where: str = "rollout.episode.function") -> EpisodeFunction:
    """The user's episode function; ``ValueError`` naming ``where`` if it cannot be imported
    or is not an ``async def``."""
    function = load_plugin(spec, where)
    if not asyncio.iscoroutinefunction(function):
        raise ValueError(f"{where}: {spec!r} must be an 'async def' taking an EpisodeContext")
    return function


def episode_reward(value: Any) -> tuple[float | None, str | None]:  # noqa: ANN401 - whatever the user returned
    """(reward, failure) from an episode's return value: a finite real number is its reward,
    ``None`` asks the row's reward to score the last assistant message, anything else
    (a bool, NaN, a string, ...) is an ``episode_error``."""
    if value is None:
        return None, None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        return float(value), None
    return None, f"{EPISODE_ERROR}: returned {type(value).__name__} {value!r:.80}, expected a finite number or None"


async def run_episode(
    function: EpisodeFunction,
    context: Callable[[str], EpisodeContext],
    recorder: EpisodeRecorder,
    timeout_s: float,
    episode_id: str | None = None,
) -> EpisodeOutcome:
    """Run one episode: open it on ``recorder`` as ``episode_id`` (the context's; None: a
    random one), call ``function(context(base_url))`` for at most ``timeout_s``, close it.
    Exceptions and time-outs of the user's code become the outcome's ``failure`` (an
    exception once the episode's budget is spent is ``episode_over_budget``); cancellation
    of the runner itself propagates (the episode is closed first)."""
    episode_id = uuid.uuid4().hex if episode_id is None else episode_id
    submitted_at = time.time()
    base_url = recorder.open_episode(episode_id)
    reward: float | None = None
    failure: str | None = None
    limit = asyncio.timeout(timeout_s)
    try:
        async with limit:
            value = await function(context(base_url))
        reward, failure = episode_reward(value)
    except TimeoutError as exc:
        failure = (
            f"{EPISODE_TIMEOUT}: still running after {timeout_s:g} s"
            if limit.expired()
            else f"{EPISODE_ERROR}: {type(exc).__name__}: {exc}"
        )
    except Exception as exc:  # noqa: BLE001 - the user's code: recorded, never fatal
        failure = f"{EPISODE_ERROR}: {type(exc).__name__}: {exc}"
    finally:
        tokens = recorder.close_episode(episode_id)
    if failure is not None and failure.startswith(EPISODE_ERROR) and tokens is not None and tokens.budget_exhausted:
        failure = EPISODE_OVER_BUDGET + failure[len(EPISODE_ERROR) :]
    return EpisodeOutcome(tokens, reward, failure, submitted_at, time.time())
