"""Staleness of a sample in training steps, not version labels: the update count of each
version (:data:`UpdateCount`), the unclamped lag and the clamped staleness that the step
drops samples by. Pure functions of a sample and the trainer's step count.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.storage.schema import Sample


UpdateCount = Callable[[int], int]
"""Weight version label -> U(version), the training steps those weights received
(:class:`asyncrl.storage.weight_lineage.VersionUpdates` reads it from the lineage files)."""


def labels_as_updates(version: int) -> int:
    """U(v) = v: the update count of a run that never rolled back, whose version labels
    count its steps (what :func:`sample_staleness` assumes when given no lineage)."""
    return version


def update_lag(sample: Sample, trainer_updates: int, updates_of: UpdateCount = labels_as_updates) -> int:
    """U_trainer - min over the sample's model tokens t of U(v_t), unclamped (see
    :func:`sample_staleness`; environment tokens of a multi-turn sample are left out)."""
    return trainer_updates - min(updates_of(v) for v in set(sample.model_values(sample.token_versions)))


def sample_staleness(sample: Sample, trainer_updates: int, updates_of: UpdateCount = labels_as_updates) -> int:
    """Staleness of one sample in training steps::

        s = max(0, U_trainer - min_t U(v_t))

    - U_trainer = ``trainer_updates``: training steps the trainer's current weights have
      received, i.e. its step count before this update (after a restart: the checkpoint's
      step plus the steps done since). It is not the trainer's version label, which after
      a rollback is ahead of its updates by the steps the killed trainer published after
      the checkpoint.
    - U(v) = ``updates_of(v)``: training steps the weights of version v received, the
      ``step`` of v's lineage (:func:`asyncrl.storage.weight_lineage.lineage_updates`).
      A version published by a trainer killed after its last checkpoint keeps its step:
      its branch no longer exists, but its tokens were sampled by weights with that many
      updates and their behaviour log-probs are recorded, so they are valid behaviour data.
    - min over the model tokens t (the output tokens the model sampled; an environment
      token of a multi-turn sample was sampled by no weights): the token sampled by the
      weights with the fewest updates lags the most. Without a rollback U grows with the label, so this is the
      oldest token and s = trainer version - min(token_versions) as in AReaL; after a
      rollback a newer label can hold fewer updates (resumed from checkpoint step c, the
      trainer's first new version has c+1 updates, the killed trainer's last one k > c+1),
      so the label order no longer tells which token lags.

    Why the clamp: the difference is negative only when every token of the sample was
    sampled by weights with more updates than the trainer's, which happens only on a branch
    a rollback discarded (or with mislabelled data, which the run audit checks by label).
    Such a sample does not lag the trainer: max_staleness bounds how many updates behind
    the trainer's weights (pi_prox) the behaviour policy may be, and decoupled PPO corrects
    for whatever pi_prox / pi_behav these tokens have (capped or masked above
    ``behav_weight_cap``). So it counts as staleness 0, not as a negative value that would
    sit below every real lag in the staleness figures; :func:`~asyncrl.tasks.trainer.step.prepare_step` counts such
    samples (metric ``staleness_clamped``) and logs them.
    """
    return max(0, update_lag(sample, trainer_updates, updates_of))
