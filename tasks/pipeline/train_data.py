"""The pipeline's choice of train files, before the data stage: for a folder
``data.train_path``, the files no earlier run of ``pipeline.registered_model`` trained on (plus
``data.replay_fraction`` of those it did), recorded once in the run root; with
``data.require_new_files`` and nothing new, why the run ends without training.

The earlier runs' files come from MLflow (:mod:`asyncrl.tasks.tracking.train_history`); the
choice itself from :func:`asyncrl.tasks.data.train_files.choose_train_files`.
"""

from __future__ import annotations

import logging

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.train_manifest import TrainFile
from asyncrl.tasks.data.train_files import TrainChoice, choose_train_files, describe
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.train_history import earlier_train_files, mark_skipped, tag_registered_model

LOG = logging.getLogger("asyncrl.pipeline")


def choose_train_data(config: RunConfig, lineage: RunLineage | None) -> TrainChoice:
    """The run's train files (:func:`~asyncrl.tasks.data.train_files.choose_train_files`),
    against the train files of the FINISHED runs of ``pipeline.registered_model`` in
    ``tracking.experiment``. ``lineage``: the run's own MLflow run, tagged with the registered
    model (so later runs find it), left out of the earlier runs, and tagged with the reason
    when the run is skipped; None only looks (nothing recorded: the nightly flow asks before it
    downloads the model)."""
    name = config.pipeline.registered_model
    if lineage is not None:
        tag_registered_model(lineage, name)
    if not (config.data.train_folder or config.data.require_new_files):
        return TrainChoice(None, reused=False)  # one file, read as it is: nothing to choose or ask

    def earlier() -> frozenset[TrainFile]:
        run_id = None if lineage is None else lineage.run_id
        return earlier_train_files(config.tracking.mlflow_uri, config.tracking.experiment, name, exclude_run_id=run_id)

    choice = choose_train_files(
        config.data, config.seed, run_paths(config).root, earlier,
        earlier_runs=f"an earlier run of registered model {name!r} (pipeline.registered_model)",
        record=lineage is not None,
    )  # fmt: skip
    if choice.skipped is not None:
        LOG.warning("%s", choice.skipped)
        if lineage is not None:
            mark_skipped(lineage, choice.skipped)
    elif choice.selection is not None and config.data.train_folder:
        how = "kept from the run's first start" if choice.reused else "chosen"
        LOG.info("train files %s: %s at %s", how, describe(choice.selection), config.data.train_path)
    return choice
