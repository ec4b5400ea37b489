"""The train files a run selected from a folder ``data.train_path``, in its run root
(:data:`~asyncrl.storage.paths.TRAIN_FILES`, ``data/train-files.json``).

Written once, before training, with put-if-absent: a restarted or resumed run reads it back
and trains on the same files whatever the folder holds by then; the scheduler and the
trainer read their prompts from exactly the files it lists. Content::

    {"train_path": "s3://bucket/prompts/", "seed": 0, "replay_fraction": 0.25, "listed": 5,
     "files": [{"uri": "s3://bucket/prompts/2026-12-01.jsonl", "digest": "...", "new": false}, ...]}

``files`` in listing order; ``digest``: sha256 of the file's bytes, first 16 hex digits
(MLflow's dataset digest); ``new``: no earlier run trained on it (else it is replayed);
``listed``: the data files the folder held when the run chose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot


@dataclass(frozen=True, order=True)
class TrainFile:
    """One data file as the runs record it: a file rewritten with other bytes is another one."""

    uri: str
    digest: str
    """sha256 of the file's bytes, first 16 hex digits."""


@dataclass(frozen=True)
class TrainSelection:
    """What one run trains on, out of a folder's listing."""

    files: tuple[TrainFile, ...]
    """The files the run trains on, in listing order: ``new`` and ``replayed``, or every listed
    file when none is new."""
    new: tuple[TrainFile, ...]
    """Listed files no earlier run trained on."""
    replayed: tuple[TrainFile, ...]
    """Earlier runs' files trained on again (``data.replay_fraction``)."""
    listed: int
    """Data files in the folder when the run chose."""


@dataclass(frozen=True)
class TrainManifest:
    train_path: str
    seed: int
    replay_fraction: float
    selection: TrainSelection

    def to_json(self) -> bytes:
        new = set(self.selection.new)
        files = [{"uri": f.uri, "digest": f.digest, "new": f in new} for f in self.selection.files]
        return json.dumps(
            {"train_path": self.train_path, "seed": self.seed, "replay_fraction": self.replay_fraction,
             "listed": self.selection.listed, "files": files}, indent=1,
        ).encode()  # fmt: skip

    @classmethod
    def from_json(cls, content: dict[str, Any], where: str) -> TrainManifest:
        """``ValueError`` naming ``where`` and the key for a malformed manifest."""
        try:
            entries = content["files"]
            files = tuple(TrainFile(str(e["uri"]), str(e["digest"])) for e in entries)
            new = tuple(f for f, e in zip(files, entries) if e.get("new") is True)
            replayed = tuple(f for f, e in zip(files, entries) if e.get("new") is False) if new else ()
            selection = TrainSelection(files, new, replayed, int(content["listed"]))
            return cls(str(content["train_path"]), int(content["seed"]), float(content["replay_fraction"]), selection)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: not a train-file manifest ({type(exc).__name__}: {exc})") from None


def write_train_manifest(root: RunRoot, manifest: TrainManifest) -> TrainManifest:
    """Publish ``manifest`` unless the run root holds one; the one it holds (a start that chose
    first wins, so two starts of one run train on the same files)."""
    try:
        fs.put_if_absent(root, paths.TRAIN_FILES, manifest.to_json())
    except FileExistsError:
        pass
    found = read_train_manifest(root)
    assert found is not None  # just written, or there already
    return found


def read_train_manifest(root: RunRoot) -> TrainManifest | None:
    """The run's manifest; None before the run chose its files."""
    content = fs.read_json_object(root, paths.TRAIN_FILES)
    return None if content is None else TrainManifest.from_json(content, root.display(paths.TRAIN_FILES))
