"""Retention of published weight versions: what the trainer keeps after each publish.

After every publish the writer rank calls :func:`prune_after_publish`. With C the version just
published, U(v) the update count of v (its lineage ``step``), m the max staleness (the run
config's staleness bound, handed to the trainer) and K ``trainer.keep_versions``, v is kept
iff: (1) v >= C; (2) U(v) >= U(C) - (m + 1), the staleness window plus one update of margin;
(3) v is the lowest complete version; (4) v is a complete checkpoint's version; (5) v is
pinned; (6) v is one of the K newest besides C; (7) the evaluator may still load v. Every
other version is pruned (:meth:`WeightStore.prune`); when in doubt (manifests unreadable,
the store failing) nothing is. The same call aborts incomplete multipart uploads
under ``weights/`` and ``checkpoints/``. Why each rule: ``docs/internals/trainer.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from asyncrl.storage import fs, paths
from asyncrl.storage.evaluations import EvaluationStore
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.weight_lineage import VersionUpdates
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.trainer.checkpoint import CheckpointError, checkpoint_versions

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class RetentionPolicy:
    """The run's knobs of the rule in the module docstring."""

    max_staleness: int
    """m: samples staler than this (in updates) are dropped by the trainer."""
    keep_versions: int = 0
    """K: extra newest versions kept besides the current one."""

    def __post_init__(self) -> None:
        for name in ("max_staleness", "keep_versions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"retention {name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class RetentionReport:
    """What one pass kept and deleted."""

    kept: tuple[int, ...]
    deleted: tuple[int, ...]
    aborted_uploads: tuple[str, ...]


def versions_to_keep(
    complete: Collection[int],
    current: int,
    policy: RetentionPolicy,
    updates_of: Callable[[int], int],
    checkpointed: Collection[int] = (),
) -> set[int]:
    """Rules 1-4 and 6 of the module docstring over the ``complete`` versions (pins, rule 5,
    are applied by :meth:`WeightStore.prune` itself; rule 7 by :func:`prune_weights`)."""
    ordered = sorted(complete)
    keep = {v for v in ordered if v >= current}
    floor = updates_of(current) - (policy.max_staleness + 1)
    keep.update(v for v in ordered if v < current and updates_of(v) >= floor)
    if ordered:
        keep.add(ordered[0])
    keep.update(checkpointed)
    older = [v for v in ordered if v < current]
    if policy.keep_versions:
        keep.update(older[-policy.keep_versions :])
    return keep


def prune_weights(store: WeightStore, current: int, policy: RetentionPolicy) -> RetentionReport:
    """One retention pass for ``current`` (the version just published) under ``policy``."""
    root = store.root
    try:
        checkpointed = checkpoint_versions(root)
    except CheckpointError as exc:
        logger.warning("weight retention skipped: %s", exc)
        return RetentionReport(kept=tuple(store.list_versions()), deleted=(), aborted_uploads=())
    complete = store.list_versions()
    keep = versions_to_keep(complete, current, policy, VersionUpdates(root), checkpointed)
    evaluator = EvaluationStore(root).state()
    if evaluator is not None:
        keep.update(evaluator.needed(current))
    deleted = store.prune(keep_latest=0, referenced=keep)
    if deleted:
        logger.info("weight retention at version %d: deleted versions %s", current, deleted)
    return RetentionReport(kept=tuple(sorted(set(complete) - set(deleted))), deleted=tuple(deleted), aborted_uploads=())


def abort_trainer_uploads(root: RunRoot) -> list[str]:
    """Abort the incomplete multipart uploads under ``weights/`` and ``checkpoints/``;
    return their relative paths. Call only from the trainer's writer rank while it uploads
    nothing (no other process uploads there)."""
    aborted: list[str] = []
    for directory in (paths.WEIGHTS_DIR, paths.CHECKPOINTS_DIR):
        aborted.extend(fs.abort_incomplete_uploads(root, directory))
    if aborted:
        logger.info("aborted incomplete multipart uploads left by a killed trainer: %s", aborted)
    return aborted


def prune_after_publish(store: WeightStore, version: int, policy: RetentionPolicy | None) -> RetentionReport | None:
    """The trainer's call right after publishing ``version``: :func:`abort_trainer_uploads`,
    then :func:`prune_weights` under ``policy`` (the trainer's own settings); None, pruning
    nothing, without a policy (the SFT stage's one version) or when the pass failed (a
    warning says why)."""
    try:
        aborted = abort_trainer_uploads(store.root)
        if policy is None:
            return None
        report = prune_weights(store, version, policy)
        return RetentionReport(kept=report.kept, deleted=report.deleted, aborted_uploads=tuple(aborted))
    except (OSError, ValueError) as exc:
        logger.warning("weight retention after publishing version %d failed, retried after the next publish: %r",
                       version, exc)
        return None
