"""Weight retention after each publish (:mod:`asyncrl.tasks.trainer.retention`): a run of
publishes keeps exactly the current version, the staleness window, the initial version,
checkpointed and pinned versions and ``keep_versions`` extra ones; nothing without a
policy (the trainer hands its own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3_servers
from safetensors.numpy import save_file

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weight_lineage import LINEAGE_FILE, read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.trainer.checkpoint import CHECKPOINT_COMPLETE, prune_checkpoints
from asyncrl.tasks.trainer.retention import (
    RetentionPolicy,
    prune_after_publish,
    versions_to_keep,
)


def publish(store: WeightStore, base: Path, version: int, step: int) -> None:
    local = base / f"v{version}"
    local.mkdir(parents=True)
    save_file({"w": np.full(3, float(version), dtype=np.float32)}, str(local / "model.safetensors"))
    (local / "config.json").write_text("{}")
    (local / LINEAGE_FILE).write_text(json.dumps({"version": version, "step": step}))
    store.publish(version, local)


def checkpoint(root: RunRoot, step: int, version: int, keep: int = 2) -> None:
    """A complete checkpoint manifest as save_checkpoint writes it, then its pruning."""
    manifest = {"format": 1, "step": step, "version": version, "saved_at": 1.0, "files": {"state.pt": 1}}
    fs.put_if_absent(root, paths.join(paths.checkpoint_dir(step), CHECKPOINT_COMPLETE), json.dumps(manifest).encode())
    prune_checkpoints(root, keep)


def test_a_run_of_publishes_keeps_exactly_the_retained_versions(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    policy = RetentionPolicy(max_staleness=2)
    store = WeightStore(root)
    kept_after: dict[int, list[int]] = {}
    for version in range(11):
        publish(store, tmp_path / "local", version, step=version)
        if version % 3 == 0:
            checkpoint(root, version, version)
        if version == 5:
            store.pin(4)  # the register stage registered version 4
        prune_after_publish(store, version, policy)
        kept_after[version] = store.list_versions()
    # m = 2: keep U(v) >= U(current) - 3.
    assert kept_after[3] == [0, 1, 2, 3]
    assert kept_after[5] == [0, 2, 3, 4, 5]
    assert kept_after[7] == [0, 3, 4, 5, 6, 7]
    # Version 10: window 7..10, initial 0, pinned 4, checkpoints 6 and 9 (3 and 0 pruned:
    # 0 stays as the initial version).
    assert kept_after[10] == [0, 4, 6, 7, 8, 9, 10]
    assert store.latest() == 10
    assert store.pruned_versions() == [1, 2, 3, 5]
    for version in store.pruned_versions():  # staleness and audit still read them
        assert read_lineage(root, version)["step"] == version
        assert not fs.exists(root, paths.weights_file(version, LINEAGE_FILE))  # moved out of weights/

    # A trainer restart from checkpoint step 6: label 11 holds 7 updates. The killed branch
    # (labels 7..10, steps 7..10) stays within the window; only what is older than
    # U = 7 - 3 = 4 and not otherwise kept goes (nothing here).
    publish(store, tmp_path / "local", 11, step=7)
    prune_after_publish(store, 11, policy)
    assert store.list_versions() == [0, 4, 6, 7, 8, 9, 10, 11]
    publish(store, tmp_path / "local", 12, step=8)
    checkpoint(root, 8, 12)  # checkpoints {8, 9}: version 6 loses its checkpoint ...
    prune_after_publish(store, 12, policy)
    assert store.list_versions() == [0, 4, 6, 7, 8, 9, 10, 11, 12]  # ... but U(6) = 6 >= 8 - 3
    publish(store, tmp_path / "local", 13, step=9)
    publish(store, tmp_path / "local", 14, step=10)
    prune_after_publish(store, 14, policy)
    assert store.list_versions() == [0, 4, 7, 8, 9, 10, 11, 12, 13, 14]


def test_keep_versions_keeps_extra_newest_ones(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    policy = RetentionPolicy(max_staleness=0, keep_versions=2)
    store = WeightStore(root)
    for version in range(8):
        publish(store, tmp_path / "local", version, step=version)
        prune_after_publish(store, version, policy)
    # window U >= 7 - 1: 6, 7; keep_versions: 5, 6; initial 0.
    assert store.list_versions() == [0, 5, 6, 7]


def test_the_versions_the_evaluator_still_needs_are_kept(tmp_path: Path) -> None:
    """Rule 7: the version in evaluation and the evaluator's next pick (the newest multiple of
    its period above its last record) survive; the multiples it will skip do not."""
    from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState

    root = open_root(str(tmp_path / "run"))
    policy = RetentionPolicy(max_staleness=0)
    store = WeightStore(root)
    evaluations = EvaluationStore(root)
    evaluations.set_state(EvaluatorState(every=4, done=0, current=4))
    for version in range(11):
        publish(store, tmp_path / "local", version, step=version)
        prune_after_publish(store, version, policy)
    # window 9, 10; initial 0; in evaluation 4; next pick 8 (multiples above 0 up to 10: 4, 8)
    assert store.list_versions() == [0, 4, 8, 9, 10]
    evaluations.set_state(EvaluatorState(every=4, done=8, current=None))
    publish(store, tmp_path / "local", 11, step=11)
    prune_after_publish(store, 11, policy)
    assert store.list_versions() == [0, 10, 11]


def test_without_a_policy_nothing_is_pruned(tmp_path: Path) -> None:
    store = WeightStore(open_root(str(tmp_path / "run")))
    for version in range(4):
        publish(store, tmp_path / "local", version, step=version)
        assert prune_after_publish(store, version, None) is None
    assert store.list_versions() == [0, 1, 2, 3]


def test_a_bad_policy_is_refused_and_the_rule_is_the_documented_one() -> None:
    with pytest.raises(ValueError, match="keep_versions must be a non-negative int, got -1"):
        RetentionPolicy(max_staleness=1, keep_versions=-1)
    updates = {0: 0, 1: 1, 2: 2, 3: 3, 4: 1, 5: 2}.__getitem__  # 4, 5: after a rollback to step 0
    keep = versions_to_keep([0, 1, 2, 3, 4, 5], 5, RetentionPolicy(max_staleness=0), updates, checkpointed={3})
    assert keep == {0, 1, 2, 3, 4, 5}  # U(5) - 1 = 1: versions 1, 2, 4 in the window
    keep = versions_to_keep([1, 2, 3, 4, 5, 6], 6, RetentionPolicy(max_staleness=1), lambda v: v)
    assert keep == {1, 4, 5, 6}


def test_the_pass_after_a_publish_aborts_a_killed_trainers_multipart_uploads(moto_endpoint: Any, tmp_path: Path) -> None:
    bucket = s3_servers.create_bucket(moto_endpoint)
    root = open_root(f"s3://{bucket}/run", s3_servers.storage_options(moto_endpoint))
    store = WeightStore(root)
    publish(store, tmp_path / "local", 0, step=0)

    def start_upload(relpath: str) -> None:
        _, key, _ = root.fs.split_path(root.full_path(relpath))
        root.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)

    start_upload("weights/v000001/model-00001-of-00002.safetensors")
    start_upload("checkpoints/step-00000001/mp_rank_00_model_states.pt")
    start_upload("trajectories/not-the-trainers.arrow")
    publish(store, tmp_path / "local", 1, step=1)
    assert prune_after_publish(store, 1, None) is None  # no policy: nothing pruned, uploads still cleaned
    left = root.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["run/trajectories/not-the-trainers.arrow"]
    start_upload("weights/v000002/model.safetensors")
    publish(store, tmp_path / "local", 2, step=2)
    report = prune_after_publish(store, 2, RetentionPolicy(max_staleness=0))
    assert report is not None and report.aborted_uploads == ("weights/v000002/model.safetensors",)
    assert report.deleted == () and store.list_versions() == [0, 1, 2]


def test_the_rl_trainer_s_loop_retains_by_the_run_s_staleness_bound_and_keep_versions() -> None:
    from asyncrl.configs.trainer import TrainerConfig
    from asyncrl.tasks.trainer.loop import LoopSettings

    loop = LoopSettings.from_config(TrainerConfig(keep_versions=3, batch_groups=5, checkpoint_every=7), 2, 0.5, 9.0)
    assert loop.retention == RetentionPolicy(max_staleness=2, keep_versions=3)
    assert (loop.batch_groups, loop.checkpoint_every, loop.poll_interval_s, loop.wait_timeout_s) == (5, 7, 0.5, 9.0)
