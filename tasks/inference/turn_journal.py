"""The recording endpoint's book of completed agent turns, for the scheduler's journal
(:mod:`asyncrl.storage.journal`): what to write (:meth:`TurnJournal.snapshot`), and which
turns a restarted scheduler replays instead of sampling again (:meth:`TurnJournal.replay`).

An episode is the user's own code, so it cannot be resumed in the middle: a group run again
runs each episode from its start. Its model calls are then answered from the journal while
they repeat what was journaled: turn t is replayed when the episode's context at that call
(prompt, earlier turns and the tokens inserted between them, all as token ids) and its token
budget are those journaled for turn t. The reply is the journaled turn itself, so the tool
calls in it, and their idempotency keys, are those of the first run: a tool that keeps
results by key (``docs/agents.md``) answers them without doing them again, the contexts go
on matching, and the episode reaches its last completed turn without a model call. The
first call that differs (a tool that answered otherwise, an unjournaled turn) is sampled,
and the episode's later journaled turns are dropped: they continued another trajectory.

A replayed turn keeps the versions that sampled its tokens: the episode's staleness is
still its oldest token's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from asyncrl.storage.journal import JournaledTurn
from asyncrl.tasks.inference.samples import SampleOutput, SampleTimings

LOG = logging.getLogger(__name__)


@dataclass
class TurnCounts:
    """What the book did: turns and tokens replayed instead of sampled again."""

    replayed_turns: int = 0
    replayed_tokens: int = 0
    diverged: int = 0
    """Episodes whose next call did not match their journaled turn (sampled from there)."""


class TurnJournal:
    """Completed turns of the episodes of tracked groups, from :meth:`track` until :meth:`forget`;
    and the journaled turns a restarted scheduler replays (:meth:`load`)."""

    def __init__(self) -> None:
        self._group_of: dict[str, str] = {}
        """Episode id -> its group, for the episodes of tracked groups."""
        self._turns: dict[str, list[JournaledTurn]] = {}
        """Episode id -> its completed turns, in order."""
        self._replay: dict[str, list[JournaledTurn]] = {}
        """Episode id -> journaled turns not yet replayed, in order."""
        self._unjournaled = 0
        """Tokens of the turns recorded since the last snapshot."""
        self.counts = TurnCounts()

    def load(self, groups: Mapping[str, Sequence[JournaledTurn]]) -> None:
        """Turns to replay, by group (the journal a restarted scheduler read)."""
        self._replay = {}
        for turns in groups.values():
            for turn in turns:
                self._replay.setdefault(turn.episode, []).append(turn)
        for turns in self._replay.values():
            turns.sort(key=lambda t: t.turn)

    def track(self, group: str, episodes: Iterable[str]) -> None:
        """The episodes of ``group`` are about to run: their turns are journaled from now."""
        for episode in episodes:
            self._group_of[episode] = group
            self._turns[episode] = []

    def forget(self, groups: Iterable[str]) -> None:
        """Stop tracking these groups (written, left out or cancelled); their unreplayed turns go."""
        gone = set(groups)
        for episode in [e for e, g in self._group_of.items() if g in gone]:
            del self._group_of[episode]
            self._turns.pop(episode, None)
        for episode in [e for e, turns in self._replay.items() if turns and turns[0].group in gone]:
            del self._replay[episode]

    def replay(
        self, episode: str, turn: int, context_token_ids: Sequence[int], max_new_tokens: int
    ) -> SampleOutput | None:
        """The journaled turn ``turn`` of ``episode`` as a sample, if the call repeats it (same
        context and budget); else None, and the episode's journaled turns are dropped."""
        pending = self._replay.get(episode)
        if not pending:
            return None
        saved = pending[0]
        repeats = saved.context_token_ids == tuple(context_token_ids) and saved.max_new_tokens == max_new_tokens
        if saved.turn != turn or not repeats:
            del self._replay[episode]
            self.counts.diverged += 1
            LOG.info("turn journal: episode %s turn %d differs from its journaled one: sampled", episode, turn)
            return None
        pending.pop(0)
        self.counts.replayed_turns += 1
        self.counts.replayed_tokens += len(saved.token_ids)
        now = time.time()
        return SampleOutput(
            output_token_ids=list(saved.token_ids),
            behaviour_logprobs=list(saved.logprobs),
            token_versions=list(saved.versions),
            finish_reason="stop" if saved.finish_reason == "stop" else "length",
            timings=SampleTimings(submitted_at=now, finished_at=now, interruptions=0, retries=0, segments=0),
        )

    def record(self, episode: str, turn: int, context_token_ids: Sequence[int], max_new_tokens: int,
               sample: SampleOutput) -> None:  # fmt: skip
        """A completed turn of ``episode`` (ignored unless its group is tracked)."""
        group = self._group_of.get(episode)
        if group is None:
            return
        self._turns[episode].append(JournaledTurn(
            group=group, episode=episode, turn=turn, context_token_ids=tuple(context_token_ids),
            max_new_tokens=max_new_tokens, token_ids=tuple(sample.output_token_ids),
            logprobs=tuple(sample.behaviour_logprobs), versions=tuple(sample.token_versions),
            finish_reason=sample.finish_reason,
        ))  # fmt: skip
        self._unjournaled += len(sample.output_token_ids)

    def unjournaled_tokens(self) -> int:
        """Tokens of the turns completed since the last snapshot (the journal's trigger)."""
        return self._unjournaled

    def snapshot(self) -> list[JournaledTurn]:
        """Every tracked episode's completed turns now (immutable), for the journal."""
        self._unjournaled = 0
        return [turn for turns in self._turns.values() for turn in turns]
