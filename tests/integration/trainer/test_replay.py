"""`asyncrl replay`: a real trainer run on stored shards, then the trainer alone over its ledger
from its first weights, reproduces every weight version bit for bit without writing to the
original (made read-only); a fork with another learning rate differs from version 1 on, and
the tensor is named; a run root that cannot be replayed is refused, naming what is missing."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fixtures_trainer import Trajectories

from asyncrl.cli.main import main
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardWriter
from asyncrl.tasks.launch.context import open_run_context
from asyncrl.tasks.launch.supervisor import ComponentFailed
from asyncrl.tasks.pipeline.replay import ReplayError, ReplayRequest, replay_run
from asyncrl.tasks.pipeline.stages import run_with_metrics
from asyncrl.tasks.placement.launch_settings import trainer_launch

RUN_ID = "replay-test"
STEPS = 4


@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """Every directory and file under ``directory`` without write permission while the block runs."""
    entries = [directory, *directory.rglob("*")]
    modes = {entry: entry.stat().st_mode for entry in entries}
    for entry in entries:
        entry.chmod(modes[entry] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield
    finally:
        for entry in reversed(entries):
            entry.chmod(modes[entry])


@pytest.fixture(scope="module")
def original(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run root: STEPS steps of one group each, trained by the real trainer process
    as a run trains (its process config written by ``prepare_run``), with its MLflow run and a
    LoggedModel per version (``open_run_context`` and the lineage recorder, as ``train_run``)."""
    from asyncrl.tasks.tracking.lineage_recorder import LineageRecorder
    from transformers import AutoTokenizer

    base = tmp_path_factory.mktemp("replay")
    store = base / "store"
    config = RunConfig.model_validate({
        "name": RUN_ID, "work_dir": str(base / "work"), "model": {"path": str(tiny_model_dir)},
        "data": {"train_path": str(base / "unused.parquet"), "max_prompt_tokens": 32},
        "rollout": {"n_samples": 3, "max_new_tokens": 16, "eta": 2},
        "trainer": {"batch_groups": 1, "max_steps": STEPS, "micro_batch_tokens": 128, "checkpoint_every": 2,
                    "mini_batches": 1, "optimizer": {"lr": 1.0e-3}},
        "storage": {"root": str(store)}, "tracking": {"mlflow_uri": f"sqlite:///{base / 'mlflow.db'}"},
    })  # fmt: skip
    trajectories = Trajectories(AutoTokenizer.from_pretrained(tiny_model_dir))
    writer = ShardWriter(open_root(str(store)), RUN_ID)
    for k in range(STEPS):
        writer.write_groups([trajectories.group(f"g{k}", [1.0, 0.0, 0.5], versions=max(0, k - 1))])
    context = open_run_context(config)
    launch = trainer_launch(config, context.paths)
    run_with_metrics(launch, lambda step, metrics: None)
    assert launch.metrics_file is not None
    LineageRecorder(context.lineage, context.paths.root, launch.metrics_file).poll()
    context.lineage.end()
    assert Ledger(open_root(str(store))).last_step() == STEPS
    return store


def test_a_replay_from_a_kept_checkpoint_reproduces_the_steps_after_it(original: Path, tmp_path: Path) -> None:
    from asyncrl.tasks.trainer.checkpoint import complete_checkpoints

    kept = complete_checkpoints(open_root(str(original)))
    assert 2 in kept
    report = replay_run(ReplayRequest(str(original), tmp_path / "from2", from_step=2))
    assert [c["step"] for c in report["comparisons"]] == [3, 4] and report["first_difference"] is None
    missing = min(set(range(1, STEPS)) - set(kept))
    with pytest.raises(ReplayError, match=rf"--from-step {missing}: .* holds complete checkpoints of steps {re.escape(str(kept))}"):
        replay_run(ReplayRequest(str(original), tmp_path / "nope", from_step=missing))


def test_a_fork_with_another_lr_differs_from_its_first_trained_version(original: Path, tmp_path: Path, capsys: Any) -> None:
    code = main(["replay", str(original), "trainer.optimizer.lr=3e-3", "--work-dir", str(tmp_path / "fork"),
                 "--json", str(tmp_path / "fork.json")])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((tmp_path / "fork.json").read_text())
    first = report["first_difference"]
    assert report["overrides"] == ["trainer.optimizer.lr=3e-3"]
    assert report["comparisons"][0]["identical"] and (first["step"], first["version"]) == (1, 1)
    assert first["first_tensor"] and first["max_abs_diff"] > 0 and "model.safetensors" in first["files_differing"]
    assert "first difference: the weights after step 1 (version 1, replay version 1)" in printed

    # `asyncrl compare` lines the run and its fork up by step and names the same step.
    code = main(["compare", str(original), str(tmp_path / "fork" / "store"), "--json", str(tmp_path / "cmp.json"),
                 "--png", str(tmp_path / "cmp.png"), "--work-dir", str(tmp_path / "cmp")])  # fmt: skip
    printed = capsys.readouterr().out
    compared = json.loads((tmp_path / "cmp.json").read_text())
    assert code == 0 and compared["steps"] == list(range(STEPS + 1))
    assert compared["first_difference"]["step"] == 1 and "first difference: the weights after step 1" in printed
    rows = compared["rows"]
    assert rows[0]["identical"] and rows[0]["weight_distance"] == 0.0
    assert all(row["weight_distance"] > 0 for row in rows[1:])
    assert rows[-1]["weight_distance"] > rows[1]["weight_distance"]  # the branches drift apart
    assert all("loss" in row["a"] and "loss" in row["b"] for row in rows[1:])
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_what_cannot_be_replayed_is_refused_naming_it(original: Path, tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match=r"rollout.eta: a replay trains on the original run's samples"):
        replay_run(ReplayRequest(str(original), tmp_path / "a", overrides=("rollout.eta=0",)))
    with pytest.raises(ReplayError, match=r"config.yaml: not found; .* is not a run root"):
        replay_run(ReplayRequest(str(tmp_path / "empty"), tmp_path / "b"))
    with pytest.raises(ReplayError, match=r"inside the original run root"):
        replay_run(ReplayRequest(str(original), tmp_path / "c", to=str(original / "nested")))
    assert main(["replay", str(original), "rollout.n_samples=2", "--work-dir", str(tmp_path / "d")]) == 2


def test_a_shard_the_ledger_names_that_is_gone_fails_naming_it(original: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    gone = Ledger(open_root(str(copy))).entry(3).shards[0]
    os.remove(copy / paths.consumed_shard_path(gone))
    with pytest.raises(ComponentFailed, match=rf"shard {gone}, trained by the original run's step 3, is in neither"):
        replay_run(ReplayRequest(str(copy), tmp_path / "replay"))


def test_steps_are_matched_to_versions_through_the_lineage_after_a_rollback(tmp_path: Path) -> None:
    """A trainer killed after publishing step 3 as version 3 resumed from step 2's checkpoint:
    it published step 3 again as version 4 (labels only grow). The weights after step 3 are
    version 4's; version 3 is the discarded branch. Pruned versions count by their kept lineage."""
    from asyncrl.storage.weight_lineage import LINEAGE_FILE
    from asyncrl.storage.weights import WeightStore
    from asyncrl.tasks.pipeline.replay import step_versions

    store = WeightStore(open_root(str(tmp_path / "store")))
    for version, step in ((0, 0), (1, 1), (2, 2), (3, 3), (4, 3), (5, 4)):
        local = tmp_path / f"v{version}"
        local.mkdir()
        (local / "config.json").write_text("{}")
        (local / "model.safetensors").write_bytes(b"x" * (version + 1))
        (local / LINEAGE_FILE).write_text(json.dumps({"step": step, "parent_version": version - 1 if version else None}))
        store.publish(version, local)
    store.prune(keep_latest=2)
    assert store.list_versions() == [4, 5]
    assert step_versions(store) == {0: 0, 1: 1, 2: 2, 3: 4, 4: 5}


def test_a_replay_reproduces_every_version_leaves_the_original_untouched_and_shows_in_prefect(
    prefect_server: None, original: Path, tmp_path: Path
) -> None:
    """The `replay` flow (what the deployment runs) on the read-only original: every version
    identical, each phase a task run, the comparison a table artifact."""
    from prefect.client.orchestration import get_client
    from prefect_runs import run_tree

    from asyncrl.flows.replay import replay

    with read_only(original):
        state = replay(root=str(original), work_dir=str(tmp_path / "flow"), return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert report["steps"] == STEPS and report["versions_compared"] == STEPS + 1
    assert report["versions_identical"] == STEPS + 1, report["comparisons"]
    assert report["first_difference"] is None and report["steps_without_digests"] == []
    replayed = open_root(str(tmp_path / "flow" / "store"))
    assert [e.shards for e in Ledger(replayed).entries()] == [e.shards for e in Ledger(open_root(str(original))).entries()]
    assert not fs.list_dir(replayed, paths.CONSUMED_DIR)  # the shards stay the original's, read in place
    assert run_tree(state.state_details.flow_run_id) == {
        "prepare-replay": "Completed", "replay-trainer": "Completed", "compare": "Completed", "record": "Completed",
    }  # fmt: skip
    with get_client(sync_client=True) as client:
        table = next(a for a in client.read_latest_artifacts() if a.key == "asyncrl-replay")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [row["step"] for row in rows] == list(range(STEPS + 1)) and all(row["identical"] for row in rows)


def test_a_fork_is_an_mlflow_run_linked_to_its_parent_and_lineage_follows_the_link(
    original: Path, tmp_path: Path, capsys: Any
) -> None:
    """The fork's MLflow run names the parent run and step; its first LoggedModel names the
    parent's LoggedModel of that step; `asyncrl lineage` on the fork's root walks into the parent."""
    from mlflow import MlflowClient

    report = replay_run(ReplayRequest(str(original), tmp_path / "fork", overrides=("trainer.optimizer.lr=2e-3",)))
    recorded = json.loads((original / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=recorded["mlflow_uri"])
    fork = client.get_run(report["mlflow_run_id"])
    assert fork.data.tags["asyncrl.parent_run_id"] == recorded["mlflow_run_id"] and fork.data.tags["asyncrl.branch_step"] == "0"
    assert fork.data.tags["asyncrl.kind"] == "fork" and fork.info.status == "FINISHED"
    models = {m.tags["asyncrl.version"]: m for m in client.search_logged_models(experiment_ids=[fork.info.experiment_id])
              if m.source_run_id == fork.info.run_id}  # fmt: skip
    parents = {m.tags["asyncrl.version"]: m.model_id for m in client.search_logged_models(experiment_ids=[fork.info.experiment_id])
               if m.source_run_id == recorded["mlflow_run_id"]}  # fmt: skip
    assert sorted(models, key=int) == [str(v) for v in range(STEPS + 1)]
    assert models["0"].tags["asyncrl.parent_model_id"] == parents["0"]
    assert json.loads((tmp_path / "fork" / "store" / "tracking.json").read_text())["mlflow_run_id"] == report["mlflow_run_id"]
    assert main(["lineage", "0", "--root", str(tmp_path / "fork" / "store")]) == 0
    printed = capsys.readouterr().out
    assert f"branch of       run 'replay-test' (MLflow run {recorded['mlflow_run_id']}) from its step 0, fork of" in printed
    assert f"(LoggedModel {parents['0']})" in printed
