"""The lineage file beside each published weight version, and the update count it gives.

The trainer writes ``weights/v{version}/asyncrl_lineage.json`` with every version it
publishes: at least ``version``, ``parent_version`` and, for an RL step, ``step`` (the
training steps those weights received) and ``shards``. Version labels only ever grow,
but after a trainer restart they no longer count updates: the trainer resumes from
checkpoint step s while the killed trainer may have published steps s+1..k as versions up
to k, so its next version (label k+1) holds s+1 updates. Staleness is therefore measured
in updates, read here, by the trainer (:func:`asyncrl.tasks.trainer.staleness.sample_staleness`),
the scheduler's staleness gate and the run audit alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot

LINEAGE_FILE = "asyncrl_lineage.json"


def read_lineage(root: RunRoot, version: int) -> dict[str, Any] | None:
    """The lineage published beside weight ``version`` (or kept in ``weights-lineage/``
    when the version was pruned); None if it has none (a version not written by the
    trainer, or not published). ``ValueError`` names a corrupt file."""
    lineage = fs.read_json_object(root, paths.weights_file(version, LINEAGE_FILE))
    if lineage is None:
        lineage = fs.read_json_object(root, paths.pruned_lineage(version))
    return lineage


def lineage_updates(version: int, lineage: Mapping[str, Any] | None) -> int:
    """Training steps the weights of ``version`` received (its update count U(version)).

    - the lineage names an RL ``step``: U = step. A version of a branch discarded by a
      trainer rollback keeps its step: its tokens were sampled by weights with that many
      updates, whatever the trainer holds now;
    - the lineage names no step (SFT or other weights the RL run starts from): U = 0, RL
      updates are counted from them;
    - no lineage file (weights published outside the trainer, e.g. benchmarks and tests):
      U = version, the convention of a run that never rolled back (label = updates).
    """
    if lineage is None:
        return version
    step = lineage.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    return 0


class VersionUpdates:
    """``updates(version)`` -> U(version) (:func:`lineage_updates`) of one run root.

    A published version's files never change, so its answer is cached (per instance;
    nothing is shared between instances). A version without a lineage file is cached only
    once it is complete: before that its lineage may still be on its way."""

    def __init__(self, root: RunRoot) -> None:
        self._root = root
        self._cache: dict[int, int] = {}

    def __call__(self, version: int) -> int:
        cached = self._cache.get(version)
        if cached is not None:
            return cached
        lineage = read_lineage(self._root, version)
        updates = lineage_updates(version, lineage)
        if lineage is not None or fs.exists(self._root, paths.weights_complete_marker(version)):
            self._cache[version] = updates
        return updates
