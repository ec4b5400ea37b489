"""What the rollout client returns: one :class:`SampleOutput` per sample, one
:class:`UpdateStats` per weight update, and the :class:`PartialSample` a sample is built in.

A sample may be produced by several requests (segments): each interruption (a weight
update in ``recompute`` mode, a dead server) ends one segment, and the next segment is
requested with prompt + tokens so far and the remaining budget. :class:`PartialSample`
is the only place segments are joined, and it checks the invariants every sample keeps:
the token, log-prob and version arrays have one entry per output token, and the total
never exceeds the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]
InterruptMode = Literal["recompute", "keep"]
INTERRUPT_MODES: tuple[InterruptMode, ...] = ("recompute", "keep")


@dataclass(frozen=True)
class SampleTimings:
    """When a sample was asked for and done, and what interrupted it on the way."""

    submitted_at: float
    """Wall-clock time (``time.time()``) at which ``generate_group`` accepted the sample."""
    finished_at: float
    """Wall-clock time at which its last token arrived."""
    interruptions: int
    """Weight updates that paused the sample while a server was generating it."""
    retries: int
    """Segments resubmitted because their server failed (died or refused a weight load)."""
    segments: int
    """Requests the sample took (1 if nothing interrupted it, more after abort or failure)."""


@dataclass(frozen=True)
class SampleOutput:
    """One generated sample; its three per-token arrays have equal length."""

    output_token_ids: list[int]
    behaviour_logprobs: list[float]
    """log pi_behav(token | prompt, earlier tokens): the raw model log-probability under
    the weights that sampled the token (vLLM's ``raw_logprobs``)."""
    token_versions: list[int]
    """Policy (weight) version that sampled each token."""
    finish_reason: FinishReason
    timings: SampleTimings

    def __post_init__(self) -> None:
        n = len(self.output_token_ids)
        if len(self.behaviour_logprobs) != n or len(self.token_versions) != n:
            raise ValueError(
                f"SampleOutput: {n} output_token_ids but {len(self.behaviour_logprobs)} behaviour_logprobs "
                f"and {len(self.token_versions)} token_versions"
            )


@dataclass(frozen=True)
class UpdateStats:
    """What one interruptible weight update cost."""

    version: int
    mode: InterruptMode
    stall_s: float
    """Seconds generation was stopped: first ``/pause`` sent -> last ``/resume`` answered."""
    server_stall_s: dict[str, float]
    """Per server URL: its ``/pause`` sent -> its ``/resume`` answered."""
    load_s: dict[str, float]
    """Per server URL: seconds the weight loader took."""
    interrupted_segments: int
    """Requests in flight on the paused servers when the pause was sent."""
    failed_servers: dict[str, str] = field(default_factory=dict)
    """Servers taken out of rotation during the update, with the reason."""
    phase_s: dict[str, float] = field(default_factory=dict)
    """Seconds of each phase over all servers: ``pause``, ``load``, ``set_version``, ``resume``
    (their sum is ``stall_s``)."""
    paused_servers: int = 0
    """Servers that had requests in flight and were paused (an idle server is not)."""


@dataclass(frozen=True)
class Segment:
    """Tokens one request produced, each with its log-prob and the version that sampled it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    """``stop``, ``length`` or ``abort`` (cut by a pause; to be continued)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"Segment: {n} token ids but {len(self.logprobs)} log-probs and {len(self.versions)} versions"
            )


@dataclass
class LiveSegment:
    """The segment a sample is streaming: its tokens so far (the lists the stream appends
    to), of which the first :attr:`known` are certainly of ``version``: all of them until a
    weight update begins to pause their server (:meth:`freeze`); the version of a token
    received after that is known only from the segment's final spans."""

    token_ids: list[int]
    logprobs: list[float]
    version: int
    frozen_at: int | None = None

    def freeze(self) -> None:
        """An update begins on this segment's server: the tokens received so far are the last
        ones certainly of ``version`` (the first freeze counts)."""
        if self.frozen_at is None:
            self.frozen_at = len(self.token_ids)

    @property
    def known(self) -> int:
        """Tokens (and their log-probs) received and certainly of ``version``."""
        n = min(len(self.token_ids), len(self.logprobs))
        return n if self.frozen_at is None else min(n, self.frozen_at)


class PartialSample:
    """A sample being generated: the tokens so far of all finished segments, and the
    segment streaming now (``live``, for the journal)."""

    def __init__(self, prompt_token_ids: list[int], max_new_tokens: int, submitted_at: float) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_new_tokens = max_new_tokens
        self.submitted_at = submitted_at
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.interruptions = 0
        self.retries = 0
        self.segments = 0
        self.live: LiveSegment | None = None
        self.finish_reason: FinishReason | None = None
        """Set by :meth:`finish` (or :meth:`restore` of an ended sample)."""

    def restore(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                finish_reason: str | None) -> None:  # fmt: skip
        """Start from journaled state (:mod:`~asyncrl.tasks.inference.sample_journal`): its
        tokens as one finished segment, and its finish reason if it had ended."""
        if self.token_ids:
            raise ValueError("PartialSample.restore: the sample already holds tokens")
        self.extend(Segment(list(token_ids), list(logprobs), list(versions), finish_reason or "abort"))
        if finish_reason is not None:
            if finish_reason not in ("stop", "length"):
                raise ValueError(f"PartialSample.restore: finish_reason {finish_reason!r}")
            self.finish_reason = finish_reason  # type: ignore[assignment]

    @property
    def remaining(self) -> int:
        """Token budget left: max_new_tokens - tokens so far."""
        return self.max_new_tokens - len(self.token_ids)

    @property
    def live_known(self) -> int:
        """Tokens of the streaming segment certainly of its version, within the budget (0 when
        none streams): what the journal and a stop may keep of it."""
        return 0 if self.live is None else min(self.live.known, self.remaining)

    def cut_live(self) -> Segment | None:
        """What a cut stream keeps of the streaming segment: its first :attr:`live_known`
        tokens, all of its version, as a segment ended by ``abort`` (None when there are none).
        Tokens received after an update began on its server are dropped: their versions are
        known only from the final spans, which a cut stream never sends."""
        known, live = self.live_known, self.live
        if live is None or not known:
            return None
        return Segment(live.token_ids[:known], live.logprobs[:known], [live.version] * known, "abort")

    def next_prompt(self) -> list[int]:
        """What the next segment continues from: prompt + tokens so far."""
        return self.prompt_token_ids + self.token_ids

    def extend(self, segment: Segment) -> None:
        """Append a segment's tokens; ``ValueError`` if they overrun the budget."""
        if len(segment.token_ids) > self.remaining:
            raise ValueError(
                f"segment of {len(segment.token_ids)} tokens overruns the remaining budget of {self.remaining} "
                f"(max_new_tokens {self.max_new_tokens}, {len(self.token_ids)} tokens so far)"
            )
        self.token_ids.extend(segment.token_ids)
        self.logprobs.extend(segment.logprobs)
        self.versions.extend(segment.versions)

    def finish(self, finish_reason: FinishReason, finished_at: float) -> SampleOutput:
        self.finish_reason = finish_reason
        self.live = None
        return SampleOutput(
            output_token_ids=list(self.token_ids),
            behaviour_logprobs=list(self.logprobs),
            token_versions=list(self.versions),
            finish_reason=finish_reason,
            timings=SampleTimings(
                submitted_at=self.submitted_at,
                finished_at=finished_at,
                interruptions=self.interruptions,
                retries=self.retries,
                segments=self.segments,
            ),
        )
