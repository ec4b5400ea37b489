"""The rollout client's book of in-flight samples, by group, for the scheduler's journal
(:mod:`asyncrl.storage.journal`): what to write (:meth:`SampleJournal.snapshot`), when it is
due (:meth:`SampleJournal.unjournaled_tokens`), and where a restarted scheduler's samples go
on from (:meth:`SampleJournal.start_group`).

A sample's journaled tokens are those of its finished segments plus, while a segment is
streaming, the tokens it received before any weight update began to pause its server
(:class:`~asyncrl.tasks.inference.samples.LiveSegment`: all of the version the segment began
with). In ``recompute`` mode an update ends the segment, so the journal lags a sample by
the interval alone; in ``keep`` mode a segment runs on through updates, and its tokens after
the first one are journaled when the segment ends (their versions are known only then).

A resumed sample is an interrupted one: its next segment asks for prompt + journaled
tokens, in either interrupt mode, and its tokens keep the versions that sampled them, so its
staleness is still its oldest token's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from asyncrl.storage.journal import JournaledSample
from asyncrl.tasks.inference.samples import PartialSample

LOG = logging.getLogger(__name__)


@dataclass
class JournalCounts:
    """What the book did: samples and tokens taken from a journal instead of generated again."""

    resumed_samples: int = 0
    resumed_tokens: int = 0
    finished_resumed: int = 0
    """Resumed samples that had already ended (their group waited for the others)."""
    mismatched: int = 0
    """Journaled groups whose prompt, budget or size did not match the group asked for (not used)."""


class SampleJournal:
    """In-flight samples by group key, from ``generate_group(..., journal_key=...)`` until
    :meth:`forget`; and the journaled samples a restarted scheduler resumes (:meth:`load`)."""

    def __init__(self) -> None:
        self._groups: dict[str, list[PartialSample]] = {}
        self._journaled: dict[int, int] = {}
        """Tokens of each sample (by ``id``) in the last snapshot."""
        self._resume: dict[str, list[JournaledSample]] = {}
        self.counts = JournalCounts()

    def load(self, groups: Mapping[str, Sequence[JournaledSample]]) -> None:
        """Samples to resume, by group key (the journal a restarted scheduler read)."""
        self._resume = {key: list(samples) for key, samples in groups.items()}

    def start_group(self, key: str, prompt_token_ids: Sequence[int], n: int, max_new_tokens: int,
                    submitted_at: float) -> list[PartialSample]:  # fmt: skip
        """Group ``key``'s ``n`` partial samples, tracked until :meth:`forget`: from the loaded
        journal where it holds this group with the same prompt, budget and size, else new."""
        journaled = self._resume.pop(key, None)
        partials = [PartialSample(list(prompt_token_ids), max_new_tokens, submitted_at) for _ in range(n)]
        if journaled is not None:
            if _matches(journaled, prompt_token_ids, n, max_new_tokens):
                for partial, saved in zip(partials, journaled, strict=True):
                    partial.restore(saved.token_ids, saved.logprobs, saved.versions, saved.finish_reason)
                    partial.submitted_at = saved.submitted_at or submitted_at
                    self.counts.resumed_samples += 1
                    self.counts.resumed_tokens += len(saved.token_ids)
                    self.counts.finished_resumed += saved.finish_reason is not None
            else:
                self.counts.mismatched += 1
                LOG.warning("journal: group %s does not match its journaled samples (prompt, budget or size): "
                            "generated afresh", key)  # fmt: skip
        self._groups[key] = partials
        for partial in partials:
            self._journaled[id(partial)] = len(partial.token_ids)
        return partials

    def forget(self, keys: Iterable[str]) -> None:
        """Stop tracking these groups (written, left out or cancelled)."""
        for key in keys:
            for partial in self._groups.pop(key, ()):
                self._journaled.pop(id(partial), None)
            self._resume.pop(key, None)

    def unjournaled_tokens(self) -> int:
        """The most tokens any tracked sample holds beyond its last snapshot: what a kill now
        would make some sample generate again (the journal's trigger)."""
        most = 0
        for partials in self._groups.values():
            for partial in partials:
                most = max(most, _journalable_length(partial) - self._journaled.get(id(partial), 0))
        return most

    def tracked(self) -> int:
        """Samples tracked (in flight, or ended and waiting for their group's shard)."""
        return sum(len(p) for p in self._groups.values())

    def snapshot(self) -> list[JournaledSample]:
        """Every tracked sample's journalable state now (an immutable copy, to write off the
        event loop); records the lengths for :meth:`unjournaled_tokens`."""
        out = []
        for key, partials in self._groups.items():
            for index, partial in enumerate(partials):
                tokens, logprobs, versions = journalable(partial)
                self._journaled[id(partial)] = len(tokens)
                out.append(JournaledSample(
                    group=key, index=index, prompt_token_ids=tuple(partial.prompt_token_ids),
                    max_new_tokens=partial.max_new_tokens, token_ids=tokens, logprobs=logprobs, versions=versions,
                    finish_reason=partial.finish_reason, submitted_at=partial.submitted_at,
                ))  # fmt: skip
        return out


def journalable(partial: PartialSample) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    """The sample's tokens, log-probs and versions a journal may hold now: its finished
    segments, plus the streaming segment's tokens known to be of its version (module docstring)."""
    tokens, logprobs, versions = list(partial.token_ids), list(partial.logprobs), list(partial.versions)
    live, n = partial.live, partial.live_known
    if live is not None:
        tokens += live.token_ids[:n]
        logprobs += live.logprobs[:n]
        versions += [live.version] * n
    return tuple(tokens), tuple(logprobs), tuple(versions)


def _journalable_length(partial: PartialSample) -> int:
    return len(partial.token_ids) + partial.live_known


def _matches(journaled: Sequence[JournaledSample], prompt: Sequence[int], n: int, max_new_tokens: int) -> bool:
    return (
        len(journaled) == n
        and [s.index for s in journaled] == list(range(n))
        and all(s.prompt_token_ids == tuple(prompt) and s.max_new_tokens == max_new_tokens for s in journaled)
    )
