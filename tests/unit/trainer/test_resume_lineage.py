"""The parent a resumed trainer names: the version it resumed from, not the newest label.

A trainer published versions 0..K (steps 0..K) and was killed; its successor resumes from
checkpoint step S (version S). Its labels go on from K, but its weights are version S's
trained further: the first version it publishes (K + 1) is S's child, and the next ones
are children of its own previous version. Real run root on local disk, no engine."""

from __future__ import annotations

from pathlib import Path

from run_root_builder import RUN_ID, RunRootBuilder

from asyncrl.storage.fs import open_root
from asyncrl.storage.weight_lineage import read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.trainer.checkpoint import CheckpointState
from asyncrl.tasks.trainer.loop import TrainerState, resumed_state, step_lineage

K, S = 4, 1


def killed_run(tmp_path: Path) -> RunRootBuilder:
    build = RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)
    build.publish(0, 0, None, [])
    for step in range(1, K + 1):
        build.publish(step, step, step - 1, [])
    return build


def test_the_first_version_after_a_resume_names_the_checkpoint_s_version_as_parent(tmp_path: Path) -> None:
    build = killed_run(tmp_path)
    store = WeightStore(build.root)
    state = resumed_state(store, CheckpointState(step=S, version=S))
    assert state == TrainerState(S, K, parent=S) and state.holds == S
    lineage = step_lineage(state, RUN_ID, ["shard-a"], {"loss": 0.5})
    assert (lineage["parent_version"], lineage["step"], lineage["shards"]) == (S, S + 1, ["shard-a"])

    # Published as K + 1 (what train_step does), the audit's and MLflow's parent is S's version.
    build.publish(K + 1, S + 1, lineage["parent_version"], ["shard-a"])  # type: ignore[arg-type]
    assert read_lineage(build.root, K + 1)["parent_version"] == S  # type: ignore[index]
    after = TrainerState(S + 1, K + 1)  # the state train_step leaves: its own version next
    assert after.holds == K + 1 and step_lineage(after, RUN_ID, [], {})["parent_version"] == K + 1

    # Resumed again, from a checkpoint of the newest version: no gap, the label is the parent.
    again = resumed_state(store, CheckpointState(step=S + 1, version=K + 1))
    assert again == TrainerState(S + 1, K + 1) and again.parent is None and again.holds == K + 1


def test_a_resume_with_no_newer_version_published_keeps_the_checkpoint_s_label(tmp_path: Path) -> None:
    build = RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)
    assert resumed_state(WeightStore(build.root), CheckpointState(step=0, version=0)) == TrainerState(0, 0)
    build.publish(0, 0, None, [])
    state = resumed_state(WeightStore(build.root), CheckpointState(step=0, version=0))
    assert state == TrainerState(0, 0) and step_lineage(state, RUN_ID, [], {})["parent_version"] == 0
