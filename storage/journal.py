"""The scheduler's journal of partial trajectories (``scheduler/journal.json``): the state of
every sample of every group admitted and not yet written, so that a scheduler (or node)
killed mid-generation continues each sample from its last journaled token instead of from
its prompt.

One object, replaced whole at each write (one PUT): its size is that of the samples in
flight, bounded by the staleness rule, so storage and work per training step do not grow
with the run. A group's entries name its group id and its prompt; a restart uses an entry
only for the same group with the same prompt and budget (:func:`read_journal` returns them
all; the caller matches). Each sample holds its prompt, tokens so far, their behaviour
log-probs and versions, and a finish reason once the sample has ended (its group waiting
for the others, its reward or its shard).

Agent episodes add their completed model turns (:class:`JournaledTurn`, by episode id and
turn): a group run again replays each turn whose context matches the journaled one, so an
episode resumes at its last completed turn (the turn in progress at a kill is sampled again).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asyncrl.storage import fs
from asyncrl.storage.fs import RunRoot

JOURNAL_PATH = "scheduler/journal.json"
JOURNAL_FORMAT = 1


@dataclass(frozen=True)
class JournaledSample:
    """One sample's state at the journal's last write."""

    group: str
    """Its group's id (``g00000012``)."""
    index: int
    """Its place in the group (0 .. n-1)."""
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    """The weight version that sampled each token (the oldest one is the sample's staleness)."""
    finish_reason: str | None = None
    """``stop`` or ``length`` once the sample has ended; None while it is generating."""
    submitted_at: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"JournaledSample {self.group}[{self.index}]: {n} tokens but {len(self.logprobs)} log-probs "
                f"and {len(self.versions)} versions"
            )
        if n > self.max_new_tokens:
            raise ValueError(
                f"JournaledSample {self.group}[{self.index}]: {n} tokens over max_new_tokens {self.max_new_tokens}"
            )
        if self.finish_reason not in (None, "stop", "length"):
            raise ValueError(f"JournaledSample {self.group}[{self.index}]: finish_reason {self.finish_reason!r}")

    def to_json(self) -> dict[str, object]:
        return {
            "group": self.group, "index": self.index, "prompt": list(self.prompt_token_ids),
            "max_new_tokens": self.max_new_tokens, "tokens": list(self.token_ids), "logprobs": list(self.logprobs),
            "versions": list(self.versions), "finish_reason": self.finish_reason, "submitted_at": self.submitted_at,
        }  # fmt: skip

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JournaledSample:
        """The sample of one entry (``KeyError``/``TypeError``/``ValueError`` if malformed)."""
        finish = raw.get("finish_reason")
        return cls(
            group=str(raw["group"]),
            index=int(raw["index"]),
            prompt_token_ids=tuple(int(t) for t in raw["prompt"]),
            max_new_tokens=int(raw["max_new_tokens"]),
            token_ids=tuple(int(t) for t in raw["tokens"]),
            logprobs=tuple(float(x) for x in raw["logprobs"]),
            versions=tuple(int(v) for v in raw["versions"]),
            finish_reason=None if finish is None else str(finish),
            submitted_at=float(raw.get("submitted_at") or 0.0),
        )


@dataclass(frozen=True)
class JournaledTurn:
    """One completed model turn of an agent episode: the context it continued and what the
    model sampled (:class:`~asyncrl.tasks.inference.turn_journal.TurnJournal`)."""

    group: str
    episode: str
    """The episode's stable id (``<run>.<group>.<index>``)."""
    turn: int
    """The episode's model calls before this one (from 0)."""
    context_token_ids: tuple[int, ...]
    """Everything the model was given: prompt, earlier turns and the tokens inserted between them."""
    max_new_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        where = f"JournaledTurn {self.episode} turn {self.turn}"
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"{where}: {n} tokens but {len(self.logprobs)} log-probs and {len(self.versions)} versions"
            )
        if n > self.max_new_tokens or self.turn < 0:
            raise ValueError(f"{where}: {n} tokens over max_new_tokens {self.max_new_tokens}, or a negative turn")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"{where}: finish_reason {self.finish_reason!r}")

    def to_json(self) -> dict[str, object]:
        return {
            "group": self.group, "episode": self.episode, "turn": self.turn, "context": list(self.context_token_ids),
            "max_new_tokens": self.max_new_tokens, "tokens": list(self.token_ids), "logprobs": list(self.logprobs),
            "versions": list(self.versions), "finish_reason": self.finish_reason,
        }  # fmt: skip

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JournaledTurn:
        """The turn of one entry (``KeyError``/``TypeError``/``ValueError`` if malformed)."""
        return cls(
            group=str(raw["group"]),
            episode=str(raw["episode"]),
            turn=int(raw["turn"]),
            context_token_ids=tuple(int(t) for t in raw["context"]),
            max_new_tokens=int(raw["max_new_tokens"]),
            token_ids=tuple(int(t) for t in raw["tokens"]),
            logprobs=tuple(float(x) for x in raw["logprobs"]),
            versions=tuple(int(v) for v in raw["versions"]),
            finish_reason=str(raw["finish_reason"]),
        )


@dataclass(frozen=True)
class JournalContents:
    """What a journal holds: in-flight samples and completed episode turns, both by group id
    (samples in index order, turns in (episode, turn) order)."""

    samples: dict[str, list[JournaledSample]]
    turns: dict[str, list[JournaledTurn]]


def write_journal(root: RunRoot, samples: Iterable[JournaledSample], turns: Iterable[JournaledTurn] = ()) -> int:
    """Replace the journal with ``samples`` and ``turns`` (one atomic PUT); returns the bytes written."""
    payload = {
        "format": JOURNAL_FORMAT, "samples": [s.to_json() for s in samples], "turns": [t.to_json() for t in turns]
    }
    data = json.dumps(payload, separators=(",", ":")).encode()
    fs.put_atomic_replace(root, JOURNAL_PATH, data)
    return len(data)


def read_journal(root: RunRoot) -> dict[str, list[JournaledSample]]:
    """The journaled samples by group id, each group's in index order (:func:`read_journal_contents`)."""
    return read_journal_contents(root).samples


def read_journal_contents(root: RunRoot) -> JournalContents:
    """The journaled samples and turns by group id; empty without a journal. ``ValueError``
    names the object if it is malformed (a scheduler refuses to start on it rather than guess)."""
    raw = fs.read_json_object(root, JOURNAL_PATH)
    if raw is None:
        return JournalContents({}, {})
    where = root.display(JOURNAL_PATH)
    if raw.get("format") != JOURNAL_FORMAT:
        raise ValueError(f"{where}: format {raw.get('format')!r}, expected {JOURNAL_FORMAT}")
    groups: dict[str, list[JournaledSample]] = {}
    turns: dict[str, list[JournaledTurn]] = {}
    try:
        for entry in raw.get("samples") or []:
            sample = JournaledSample.from_json(entry)
            groups.setdefault(sample.group, []).append(sample)
        for entry in raw.get("turns") or []:
            turn = JournaledTurn.from_json(entry)
            turns.setdefault(turn.group, []).append(turn)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{where}: malformed entry ({exc!r}); delete it to start the run's in-flight samples afresh"
        ) from None
    for samples in groups.values():
        samples.sort(key=lambda s: s.index)
    for group_turns in turns.values():
        group_turns.sort(key=lambda t: (t.episode, t.turn))
    return JournalContents(groups, turns)
