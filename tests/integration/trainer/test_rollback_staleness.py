"""Staleness after a trainer rollback is counted in training steps, not version labels.

The scenario (no vLLM; DeepSpeed only in the last test): a trainer published versions
0..K (steps 0..K), was killed, and its successor resumed from checkpoint step S < K: the
ledger entries after S
were rolled back and the successor publishes steps S+1.. as versions K+1... The shards it
consumes again hold tokens of versions up to K. Counted in labels they look K - S steps
staler than they are and a bound of eta drops them; counted in steps they are exactly as
stale as when the killed trainer trained them, and only a sample that really lags more
than eta steps is dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from run_root_builder import ETA, RUN_ID, SAMPLES_PER_GROUP, RunRootBuilder

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weight_lineage import LINEAGE_FILE, VersionUpdates, lineage_updates, read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.chaos.audit import audit_run
from asyncrl.tasks.scheduler.gate_state import save_gate_state
from asyncrl.tasks.scheduler.group_schedule import group_id
from asyncrl.tasks.algo.staleness_gate import GateState
from asyncrl.tasks.trainer.loop import LoopSettings, RLTrainer, TrainerState
from asyncrl.tasks.trainer.metrics import JsonlMetricsSink, read_jsonl_metrics
from asyncrl.tasks.trainer.step import prepare_step
from asyncrl.tasks.trainer.staleness import sample_staleness, update_lag
from asyncrl.tasks.trainer.rl_settings import RLSettings

K, S = 4, 1
"""The killed trainer's last step (= its last version) and the checkpoint step resumed from."""

# Versions 0..K: steps 0..K (killed trainer); K+1..: the resumed trainer's steps S+1, S+2, ...
UPDATES = {v: v for v in range(K + 1)} | {K + j: S + j for j in range(1, 5)}

# Each step's shard: group -> token versions of its samples, as the killed trainer's rollout
# produced them with eta = 1 (a sample started at most one version before its step's).
SHARD_TOKENS = {
    1: {0: [0, 0], 1: [0, 0]},
    2: {2: [0, 1], 3: [1, 1]},
    3: {4: [1, 2], 5: [2, 2]},
    4: {6: [2, 3], 7: [3, 3]},
    5: {8: [3, 4], 9: [4, 4]},  # in flight when the trainer was killed
}


def sample(versions: list[int]) -> Sample:
    n = len(versions)
    return Sample("p", "g00000000", [1, 2], [3] * n, [-0.5] * n, versions, 1.0, "stop", 1.0, 2.0)


# --- the formula ---------------------------------------------------------------------


def test_staleness_counts_the_steps_the_weights_received() -> None:
    updates_of = UPDATES.__getitem__
    # Step S+2 after the restart (trainer at S+1 = 2 steps) on tokens of versions 1 and 2:
    # 2 - min(U(1), U(2)) = 1 step, where the labels (trainer label K+1 = 5) said 4.
    assert sample_staleness(sample([1, 2]), S + 1, updates_of) == 1
    assert sample_staleness(sample([1, 2]), K + 1) == 4  # labels as updates: the old reading
    # Without a rollback labels are the update counts: the DESIGN formula i - min(token_versions).
    assert sample_staleness(sample([3, 5, 4]), 6) == 3


def test_the_token_with_fewest_updates_sets_the_staleness_not_the_lowest_label() -> None:
    """Label K (K steps, killed branch) is older than label K+1 (S+1 steps), yet lags less."""
    updates_of = UPDATES.__getitem__
    spanning = sample([K, K, K + 1, K + 1])
    assert update_lag(spanning, K, updates_of) == K - (S + 1)
    assert sample_staleness(spanning, K, updates_of) == K - (S + 1)


def test_a_negative_lag_is_clamped_to_zero_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Tokens of the killed branch's version K (K steps) trained by the resumed trainer at
    S steps: they lag nothing, decoupled PPO corrects for them; staleness 0, and said so."""
    updates_of = UPDATES.__getitem__
    ahead = [sample([K, K]), sample([K - 1, K])]
    assert [update_lag(s, S, updates_of) for s in ahead] == [S - K, S - (K - 1)]
    assert [sample_staleness(s, S, updates_of) for s in ahead] == [0, 0]
    with caplog.at_level("INFO", logger="asyncrl.tasks.trainer.step"):
        prepared = prepare_step([ahead], RLSettings(max_staleness=0), S, updates_of)
    assert prepared.staleness == (0, 0) and prepared.dropped_stale == 0 and len(prepared.items) == 2
    assert prepared.clamped == 2
    assert "2 of 2 samples hold tokens of weights with more updates than the trainer's 1" in caplog.text


def test_prepare_step_keeps_the_reconsumed_samples_and_drops_a_really_stale_one() -> None:
    """The resumed trainer's steps S+1..K+1 on the rolled-back shards: nothing is dropped at
    eta = 1, where the labels dropped every sample; a sample 2 steps behind still goes."""
    updates_of = UPDATES.__getitem__
    settings = RLSettings(max_staleness=ETA)
    for step in range(S + 1, K + 2):
        groups = [[sample(v)] * SAMPLES_PER_GROUP for v in SHARD_TOKENS[step].values()]
        label = K + (step - S - 1)  # the resumed trainer's version label before this step
        by_steps = prepare_step(groups, settings, step - 1, updates_of)
        by_labels = prepare_step(groups, settings, label)
        assert by_steps.dropped_stale == 0 and max(by_steps.staleness) <= ETA, step
        assert by_labels.dropped_stale == len(by_labels.staleness), step  # the bug: all dropped
    stale = prepare_step([[sample([1, 2]), sample([2, 2])]], settings, 3, updates_of)
    assert stale.staleness == (2, 1) and stale.dropped_stale == 1 and len(stale.items) == 1


# --- update counts from the lineage files -----------------------------------------------


def _publish(root: RunRoot, tmp_path: Path, version: int, lineage: dict[str, object] | None) -> None:
    local = tmp_path / f"w{version}"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"\0" * 16)
    if lineage is not None:
        (local / LINEAGE_FILE).write_text(json.dumps({"version": version, **lineage}))
    WeightStore(root).publish(version, local)


def test_version_updates_read_the_lineage_step(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    _publish(root, tmp_path, 0, {"parent_version": None, "stage": "sft", "steps": 50})
    _publish(root, tmp_path, 3, {"parent_version": 0, "step": 1})
    _publish(root, tmp_path, 4, None)
    updates = VersionUpdates(root)
    assert updates(3) == 1  # a resumed trainer's version: its step, not its label
    assert updates(0) == 0  # SFT weights: RL counts its steps from them
    assert updates(4) == 4  # no lineage (not the trainer's): the label
    assert updates(7) == 7  # not published yet: the label, and not cached ...
    _publish(root, tmp_path, 7, {"parent_version": 4, "step": 2})
    assert updates(7) == 2  # ... so the lineage is read once it is there
    assert lineage_updates(9, {"step": True}) == 0 and lineage_updates(9, None) == 9
    fs.put_atomic_replace(root, paths.weights_file(3, LINEAGE_FILE), b"[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_lineage(root, 3)


# --- the run audit on a rolled-back run root ----------------------------------------------


def _rolled_back_root(build: RunRootBuilder, extra_stale: bool) -> dict[int, str]:
    """Versions 0..K by a trainer killed after step K; its successor resumed from checkpoint
    S, rolled the ledger back and redid steps S+1..K+1 on the same shards as versions K+1..."""
    tokens = dict(SHARD_TOKENS)
    if extra_stale:  # a group whose samples started 2 steps before the step that trains them
        tokens[K + 1] = {**tokens[K + 1], 10: [2, 4]}
    shards = {step: build.shard(groups) for step, groups in tokens.items()}
    build.admit(2 * len(SHARD_TOKENS) + (1 if extra_stale else 0))
    build.publish(0, 0, None, [])
    for step in range(1, K + 1):  # the killed trainer
        build.record(step, [shards[step]])
        build.publish(step, step, step - 1, [shards[step]])
    assert Ledger(build.root).rollback_after(S) == list(range(S + 1, K + 1))
    label, parent = K, S
    for step in range(S + 1, K + 2):  # the resumed trainer: label K at step S, holding version S
        build.record(step, [shards[step]])
        build.publish(label + 1, step, parent, [shards[step]])
        label += 1
        parent = label
    return shards


@pytest.fixture
def build(tmp_path: Path) -> RunRootBuilder:
    return RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)


def test_the_audit_counts_reconsumed_shards_as_trained(build: RunRootBuilder) -> None:
    _rolled_back_root(build, extra_stale=False)
    report = audit_run(build.root, RUN_ID, ETA)
    assert report.ok, report.violations
    assert report.step_versions == {1: 1, 2: K + 1, 3: K + 2, 4: K + 3, 5: K + 4}
    # Every step as in the killed run: its first group 1 step stale, its second 0 (step 1: both 0).
    n = SAMPLES_PER_GROUP
    assert report.staleness_counts == {0: 6 * n, 1: 4 * n}
    assert report.dropped_stale == 0 and report.trained_samples == 10 * n


def test_the_audit_still_drops_a_sample_more_than_eta_steps_behind(build: RunRootBuilder) -> None:
    _rolled_back_root(build, extra_stale=True)
    report = audit_run(build.root, RUN_ID, ETA)
    # Group 10 (tokens of versions 2 and 4, steps 2 and 4) trained by step K+1 at K steps: 2 behind.
    # Rule (e): the drop is the one violation, and it names the step (the resumed run's last).
    assert not report.ok
    assert list(report.violations) == [
        f"(e) {SAMPLES_PER_GROUP} samples were dropped as staler than max_staleness {ETA} "
        f"(generated, then thrown away): {SAMPLES_PER_GROUP} at step {K + 1}"
    ]
    assert report.dropped_stale == SAMPLES_PER_GROUP and report.dropped_steps == {K + 1: SAMPLES_PER_GROUP}
    assert report.staleness_counts == {0: 6 * SAMPLES_PER_GROUP, 1: 4 * SAMPLES_PER_GROUP}
    assert audit_run(build.root, RUN_ID, 2).dropped_stale == 0


# --- the trainer itself, resumed on such a root (one small DeepSpeed engine, CPU) ---------


def _write_step_shards(root: RunRoot, trajectories: Any) -> dict[int, str]:
    """Step j's shard: a group whose two samples were sampled at versions j-2 and j-1 (1 and
    0 steps behind step j's trainer); step K+1's also holds a group sampled at version K-2,
    2 steps behind (really stale with eta = 1)."""
    writer = ShardWriter(root, RUN_ID)
    shards: dict[int, str] = {}
    for step in range(1, K + 2):  # group ids g0..g{K}, then g{K+1}
        groups = [trajectories.group(group_id(step - 1), [1.0, 0.0], versions=[max(step - 2, 0), step - 1])]
        if step == K + 1:
            groups.append(trajectories.group(group_id(K + 1), [0.0, 1.0], versions=K - 2))
        shards[step] = writer.write_groups(groups).name
    return shards


def test_a_resumed_trainer_trains_the_reconsumed_shards(
    run_root: RunRoot, engine: Any, trajectories: Any, tmp_path: Path
) -> None:
    settings = RLSettings(micro_batch_tokens=256, max_staleness=ETA)
    loop = LoopSettings(batch_groups=1, max_steps=K + 1, checkpoint_every=100, poll_interval_s=0.05, wait_timeout_s=5)

    def trainer(name: str) -> RLTrainer:
        return RLTrainer(run_root, RUN_ID, engine, settings, loop, tmp_path / name,
                         JsonlMetricsSink(tmp_path / f"{name}.jsonl"))  # fmt: skip

    first = trainer("killed")
    assert first.start().state == TrainerState(0, 0)  # version 0 and checkpoint 0 (S = 0)
    shards = _write_step_shards(run_root, trajectories)
    save_gate_state(run_root, GateState(admitted=K + 2, batch_groups=1, eta=ETA))
    ledger = Ledger(run_root)
    for step in range(1, K + 1):  # what the killed trainer did after checkpoint 0
        ledger.record(step, [shards[step]])
        _publish(run_root, tmp_path, step, {"parent_version": step - 1, "step": step, "shards": [shards[step]]})

    resumed = trainer("resumed")
    report = resumed.start()
    assert report.resumed_from == 0 and report.rolled_back == tuple(range(1, K + 1))
    assert report.state == TrainerState(0, K, parent=0)  # label K, no step done, holding version 0
    assert resumed.run() == TrainerState(K + 1, 2 * K + 1)
    first = read_lineage(run_root, K + 1)  # its first version: a child of the checkpoint's version 0
    assert first is not None and (first["step"], first["parent_version"]) == (1, 0)

    records = read_jsonl_metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in records] == list(range(1, K + 2))
    # With labels, every step after the first would have measured s >= K and dropped all.
    assert [r["dropped_stale"] for r in records] == [0.0] * K + [2.0]
    assert [r["staleness_max"] for r in records] == [0.0] + [1.0] * (K - 1) + [2.0]
    assert [r["trained_samples"] for r in records] == [2.0] * (K + 1)
    lineage = read_lineage(run_root, 2 * K + 1)
    assert lineage is not None and (lineage["step"], lineage["parent_version"]) == (K + 1, 2 * K)

    # The audit measures the same: same drops, same staleness of every trained sample.
    audit = audit_run(run_root, RUN_ID, ETA)
    assert list(audit.violations) == [
        f"(e) 2 samples were dropped as staler than max_staleness {ETA} (generated, then thrown away): 2 at step {K + 1}"
    ]
    assert audit.dropped_stale == 2 and audit.trainer_dropped_stale == 2
    assert audit.staleness_counts == {0: K + 2, 1: K}
