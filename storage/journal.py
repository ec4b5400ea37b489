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


def write_journal(root: RunRoot, samples: Iterable[JournaledSample]) -> int:
    """Replace the journal with ``samples`` (one atomic PUT); returns the bytes written."""
    payload = {"format": JOURNAL_FORMAT, "samples": [s.to_json() for s in samples]}
    data = json.dumps(payload, separators=(",", ":")).encode()
    fs.put_atomic_replace(root, JOURNAL_PATH, data)
    return len(data)


def read_journal(root: RunRoot) -> dict[str, list[JournaledSample]]:
    """The journaled samples by group id, each group's in index order; empty without a
    journal. ``ValueError`` names the object if it is malformed (a scheduler refuses to
    start on it rather than guess)."""
    raw = fs.read_json_object(root, JOURNAL_PATH)
    if raw is None:
        return {}
    where = root.display(JOURNAL_PATH)
    if raw.get("format") != JOURNAL_FORMAT:
        raise ValueError(f"{where}: format {raw.get('format')!r}, expected {JOURNAL_FORMAT}")
    groups: dict[str, list[JournaledSample]] = {}
    try:
        for entry in raw.get("samples") or []:
            sample = JournaledSample.from_json(entry)
            groups.setdefault(sample.group, []).append(sample)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{where}: malformed entry ({exc!r}); delete it to start the run's in-flight samples afresh"
        ) from None
    for samples in groups.values():
        samples.sort(key=lambda s: s.index)
    return groups
