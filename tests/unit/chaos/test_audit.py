"""The run-root audit on hand-made storage: a clean run passes, and each rule catches the
contents that break it (fast: no vLLM, no trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_root_builder import ETA, RUN_ID, RunRootBuilder, SAMPLES_PER_GROUP as N

from asyncrl.storage import fs, paths
from asyncrl.chaos.audit import AuditReport, audit_run
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.schema import Sample
from asyncrl.tasks.scheduler.group_schedule import group_id


@pytest.fixture
def build(tmp_path: Path) -> RunRootBuilder:
    return RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)


def audit(build: RunRootBuilder, max_staleness: int = ETA, in_flight_ok: bool = False) -> AuditReport:
    return audit_run(build.root, RUN_ID, max_staleness, in_flight_ok=in_flight_ok)


def only_violation(report: AuditReport, rule: str) -> str:
    assert len(report.violations) == 1, report.violations
    assert report.violations[0].startswith(f"({rule}) "), report.violations
    return report.violations[0]


def test_a_clean_run_passes_with_its_figures(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    report = audit(build)
    assert report.ok, report.violations
    assert (report.admitted, report.groups_written, report.unwritten_groups) == (4, 4, ())
    assert (report.shards, report.consumed_shards, report.ledger_steps) == (2, 2, 2)
    assert report.versions == (0, 1, 2) and report.step_versions == {1: 1, 2: 2}
    # step 1 at trainer version 0: all tokens v0 -> s = 0; step 2 at version 1: group 2 (min v0)
    # at s = 1, group 3 (min v1) at s = 0
    assert report.staleness_counts == {0: 3 * N, 1: N}
    assert report.trained_samples == 4 * N and report.dropped_stale == 0
    assert (report.shard_tokens, report.left_out_tokens) == (4 * N * 2, 0)  # 2 output tokens a sample
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_a_group_in_two_shards_is_produced_twice(build: RunRootBuilder) -> None:
    build.clean_run()
    again = build.shard({3: [1, 1]})
    message = only_violation(audit(build), "a")
    assert "group g00000003 was produced 2 times" in message and again in message


def test_an_admitted_group_in_no_shard_is_missing_unless_in_flight_is_allowed(build: RunRootBuilder) -> None:
    build.clean_run()
    build.admit(6)
    message = only_violation(audit(build), "a")
    assert "2 of 6 admitted groups are in no shard: g00000004, g00000005" in message
    relaxed = audit(build, in_flight_ok=True)
    assert relaxed.ok and relaxed.unwritten_groups == ("g00000004", "g00000005")


def test_a_group_that_was_never_admitted(build: RunRootBuilder) -> None:
    build.clean_run()
    build.admit(3)
    assert "group g00000003 (in shard-00000001" in only_violation(audit(build), "a")
    assert "never admitted: the scheduler admitted 3 groups" in audit(build).violations[0]


def test_a_shard_consumed_by_two_steps(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    build.record(2, [second, first])
    build.publish(3, 2, 1, [second, first])
    assert f"shard {first} was consumed 2 times: by steps [1, 2]" in only_violation(audit(build), "b")


def test_a_gap_in_the_ledger_and_a_consumed_shard_that_is_gone(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    fs.delete(build.root, paths.ledger_entry(1))
    fs.delete(build.root, paths.shard_path(second))
    violations = audit(build, in_flight_ok=True).violations
    assert any("the ledger's steps are [2], not 1..1: missing steps [1]" in v for v in violations), violations
    assert any(f"shard {second}, consumed by step 2, is in neither trajectories/ nor consumed/" in v for v in violations), violations


def test_an_invalid_shard_is_reported_and_left_in_place(build: RunRootBuilder) -> None:
    build.clean_run()
    bad = paths.shard_path(paths.shard_name(7, 0, 0))
    fs.put_if_absent(build.root, bad, b"not arrow")
    message = only_violation(audit(build), "b")
    assert "shard-00000007-v000000-v000000.arrow is not a valid shard" in message
    assert fs.exists(build.root, bad) and not fs.list_dir(build.root, paths.QUARANTINE_DIR)


def test_weights_published_out_of_order(build: RunRootBuilder) -> None:
    build.clean_run()
    marker = paths.weights_complete_marker(2)
    manifest = json.loads(fs.read_bytes(build.root, marker))
    manifest["published_at"] = 0.0
    fs.put_atomic_replace(build.root, marker, json.dumps(manifest).encode())
    assert "weight version 2 was published at 0.000, not after version 1" in only_violation(audit(build), "c")


def test_latest_pointer_behind_the_newest_version(build: RunRootBuilder) -> None:
    build.clean_run()
    fs.put_atomic_replace(build.root, paths.WEIGHTS_LATEST, json.dumps({"version": 1, "published_at": 9.0}).encode())
    assert "LATEST names version 1, the newest complete version is 2" in only_violation(audit(build), "c")


def test_steps_published_in_the_wrong_order(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    # step 1 redone after step 2 (a rollback that skipped one): its newest version is 3 > step 2's
    build.publish(3, 1, 2, [first])
    message = only_violation(audit(build, max_staleness=5), "c")
    assert "step 2 was published as version 2, not after step 1's version 3" in message


def test_a_redone_step_uses_its_newest_publish(build: RunRootBuilder) -> None:
    """A trainer killed after publishing step 2 resumes from checkpoint 1 at label 2 and
    publishes step 2 again as version 3: staleness is counted in steps (1 step done), not
    from the label 2, so the v0 sample is 1 step stale, as in the first run, and trained."""
    first, second = build.clean_run()
    build.publish(3, 2, 2, [second])
    report = audit(build)
    assert report.ok, report.violations
    assert report.step_versions == {1: 1, 2: 3}
    assert report.staleness_counts == {0: 3 * N, 1: N} and report.dropped_stale == 0  # group 2 (min v0) at s = 1


def test_weights_for_a_step_trained_on_other_shards(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    build.publish(3, 2, 2, [first])
    message = only_violation(audit(build), "d")
    assert f"step 2: the ledger names shards ['{second}'], but weight version 3" in message


def test_a_consumed_step_without_published_weights(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    third = build.shard({4: [2, 2], 5: [2, 2]})
    build.admit(6)
    build.record(3, [third])
    assert "step 3 is in the ledger but no published weights name it" in only_violation(audit(build), "d")


def test_tokens_not_older_than_the_step_s_own_weights_are_mislabelled(build: RunRootBuilder) -> None:
    build.admit(2)
    shard = build.shard({0: [1, 1], 1: [0, 0]})
    build.publish(0, 0, None, [])
    build.record(1, [shard])
    build.publish(1, 1, 0, [shard])  # step 1 published as version 1: its shard cannot hold version 1 tokens
    violations = audit(build).violations
    assert len(violations) == N, violations
    assert "group g00000000 sample 0: tokens of version 1 trained by step 1, published as version 1" in violations[0]
    assert "(not older than the step's own weights: mislabelled tokens)" in violations[0]


def test_tokens_of_a_discarded_branch_trained_after_a_resume_are_not_mislabelled(build: RunRootBuilder) -> None:
    """A trainer killed after publishing version 1, resumed from checkpoint version 0: its
    first version (2) names version 0 as parent, and may train tokens of version 1."""
    build.admit(2)
    shard = build.shard({0: [1, 1], 1: [0, 0]})
    build.publish(0, 0, None, [])
    build.publish(1, 1, 0, [])  # the killed trainer's step 1 (rolled back: no ledger entry)
    build.record(1, [shard])
    build.publish(2, 1, 0, [shard])
    report = audit(build)
    assert report.ok, report.violations
    assert report.step_versions == {1: 2} and report.staleness_counts == {0: 2 * N}


def test_token_versions_never_published(build: RunRootBuilder) -> None:
    build.admit(2)
    shard = build.shard({0: [0, 4], 1: [0, 0]})
    build.publish(0, 0, None, [])
    build.record(1, [shard])
    build.publish(5, 1, 0, [shard])
    violations = audit(build).violations
    assert len(violations) == N and "group g00000000 sample 0: token versions [4] were never published" in violations[0]


def test_samples_over_the_bound_are_dropped_not_trained_and_fail_the_audit(build: RunRootBuilder) -> None:
    build.clean_run()
    report = audit(build, max_staleness=0)
    assert not report.ok
    # group 2 of step 2 (min token version 0, trainer at 1 step) is 1 step stale: its N samples dropped
    assert only_violation(report, "e") == (
        f"(e) {N} samples were dropped as staler than max_staleness 0 (generated, then thrown away): {N} at step 2"
    )
    assert report.staleness_counts == {0: 3 * N} and report.dropped_stale == N and report.dropped_steps == {2: N}
    assert report.dropped_tokens == N * 2  # the builder's samples hold 2 output tokens
    assert json.loads(json.dumps(report.to_json()))["dropped_steps"] == {"2": N}
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        audit(build, max_staleness=-1)


def _record_trainer_drops(build: RunRootBuilder, version: int, dropped: int) -> None:
    """Add the trainer's step figures to the lineage of ``version`` (as `step_lineage` writes them)."""
    relpath = paths.weights_file(version, "asyncrl_lineage.json")
    lineage = json.loads(fs.read_bytes(build.root, relpath))
    lineage["metrics"] = {"dropped_stale": float(dropped), "loss": 0.1}
    fs.put_atomic_replace(build.root, relpath, json.dumps(lineage).encode())


def test_the_drops_the_trainer_recorded_are_counted(build: RunRootBuilder) -> None:
    build.clean_run()
    _record_trainer_drops(build, 1, 0)
    _record_trainer_drops(build, 2, 0)
    report = audit(build)
    assert report.ok and report.trainer_dropped_stale == 0 and report.dropped_steps == {}
    _record_trainer_drops(build, 2, 3)  # the trainer says it dropped 3 where the audit counts none
    report = audit(build)
    assert not report.ok and report.trainer_dropped_stale == 3 and report.dropped_steps == {2: 3}
    assert report.violations == (
        "(e) step 2: the trainer recorded 3 samples dropped as too stale, the audit counts 0",
        "(e) 3 samples were dropped as staler than max_staleness 1 (generated, then thrown away): 3 at step 2",
    )


def test_the_ledger_class_agrees_with_the_hand_written_entries(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    assert [(e.step, e.shards) for e in Ledger(build.root).entries()] == [(1, (first,)), (2, (second,))]


def test_a_corrupt_scheduler_state_is_reported(build: RunRootBuilder) -> None:
    build.clean_run()
    fs.put_atomic_replace(build.root, paths.SCHEDULER_STATE, b'{"gate": {"admitted": "four"}}')
    violations = audit(build, in_flight_ok=True).violations
    assert any(v.startswith("(a) ") and "corrupt scheduler state" in v for v in violations), violations


def _filter(build: RunRootBuilder, index: int) -> None:
    from asyncrl.storage.schema import Sample
    from asyncrl.tasks.scheduler.filtered import save_filtered
    from asyncrl.tasks.scheduler.group_schedule import group_id

    save_filtered(build.root, [Sample(f"p{index}", group_id(index), [1], [3, 3], [-0.5] * 2, [0, 0], 1.0, "stop", 1.0, 2.0)])


def test_a_filtered_group_counts_as_produced_not_as_missing(build: RunRootBuilder) -> None:
    build.clean_run()
    build.admit(5)
    _filter(build, 4)
    report = audit(build)
    assert report.ok, report.violations
    assert (report.filtered_groups, report.unwritten_groups, report.groups_written) == (1, (), 4)
    assert (report.shard_tokens, report.left_out_tokens) == (4 * N * 2, 2)


def test_a_left_out_record_without_its_token_count_is_reported(build: RunRootBuilder) -> None:
    from asyncrl.tasks.scheduler.filtered import filtered_record_path

    build.clean_run()
    build.admit(5)
    fs.put_atomic_replace(build.root, filtered_record_path(4), json.dumps({"group_id": group_id(4)}).encode())
    violation = only_violation(audit(build), "a")
    assert "a left-out group's record is incomplete" in violation and "g00000004.json" in violation


def test_a_filtered_group_in_a_shard_or_never_admitted(build: RunRootBuilder) -> None:
    first, _ = build.clean_run()
    _filter(build, 1)
    assert f"group g00000001 was filtered out but is also in shards {first}" in only_violation(audit(build), "a")
    _filter(build, 9)
    violations = audit(build).violations
    assert any("group g00000009 was filtered out but never admitted: the scheduler admitted 4 groups" in v
               for v in violations), violations


def test_dropped_tokens_and_versions_of_agent_episodes_count_model_tokens_only(build: RunRootBuilder) -> None:
    """A multi-turn row: 2 model tokens (v0, v1) with 3 environment tokens between them, which
    repeat v0 and are not counted as generated tokens."""
    build.admit(4)
    first = build.shard({0: [0, 0], 1: [0, 0]})
    episode = Sample("p2", group_id(2), [1, 2], [3, 9, 9, 9, 3], [-0.5, 0.0, 0.0, 0.0, -0.5], [0, 0, 0, 0, 1], 1.0,
                     "stop", 1.0, 2.0, output_mask=[True, False, False, False, True], turn_starts=[0, 4])  # fmt: skip
    single = Sample("p3", group_id(3), [1, 2], [3, 3], [-0.5, -0.5], [1, 1], 1.0, "stop", 1.0, 2.0)
    second = build.writer.write_groups([[episode] * N, [single] * N]).name
    build.publish(0, 0, None, [])
    for step, shard in ((1, first), (2, second)):
        build.record(step, [shard])
        build.publish(step, step, step - 1, [shard])
    report = audit(build, max_staleness=0)
    assert only_violation(report, "e").endswith(f": {N} at step 2")
    assert report.staleness_counts == {0: 3 * N} and report.dropped_stale == N
    assert report.dropped_tokens == N * 2  # the episode's 2 model tokens, not its 5 output tokens


# ----- quarantined shards: each group generated again once, neither lost nor trained twice -----


def quarantine(build: RunRootBuilder, name: str) -> None:
    from asyncrl.storage.shards import ShardReader

    reader = ShardReader(build.root, RUN_ID)
    reader.quarantine(reader.locate(name) or name)


def test_a_quarantined_shard_generated_again_is_counted_not_lost(build: RunRootBuilder) -> None:
    build.admit(4)
    bad = build.shard({0: [0, 0], 1: [0, 0]})
    second = build.shard({2: [0, 0], 3: [0, 0]})
    again = build.shard({0: [0, 0], 1: [0, 0]})  # the regeneration: the same groups, a new shard
    quarantine(build, bad)
    build.publish(0, 0, None, [])
    build.record(1, [second])
    build.publish(1, 1, 0, [second])
    build.record(2, [again])
    build.publish(2, 2, 1, [again])
    report = audit(build)
    assert report.ok, report.violations
    assert (report.quarantined_shards, report.quarantined_groups, report.regenerated_groups) == (1, 2, 2)
    assert report.awaiting_regeneration == () and report.unwritten_groups == () and report.groups_written == 4
    assert report.to_json()["regenerated_groups"] == 2


def test_a_quarantined_shard_not_generated_again_is_awaited_or_lost(build: RunRootBuilder) -> None:
    build.admit(2)
    quarantine(build, build.shard({0: [0, 0], 1: [0, 0]}))
    message = only_violation(audit(build), "a")
    assert "2 groups of quarantined shards are not generated again: g00000000, g00000001" in message
    relaxed = audit(build, in_flight_ok=True)
    assert relaxed.ok and relaxed.awaiting_regeneration == ("g00000000", "g00000001")
    assert (relaxed.quarantined_groups, relaxed.regenerated_groups, relaxed.unwritten_groups) == (2, 0, ())


def test_one_quarantine_generated_again_twice(build: RunRootBuilder) -> None:
    build.admit(2)
    bad = build.shard({0: [0, 0], 1: [0, 0]})
    build.shard({0: [0, 0]})
    build.shard({0: [0, 0], 1: [0, 0]})
    quarantine(build, bad)
    violations = audit(build).violations
    assert any("group g00000000 was produced 3 times for 1 quarantines" in v for v in violations), violations
    assert not any("g00000001" in v for v in violations), violations


def test_a_trained_shard_quarantined_then_generated_again_is_trained_twice(build: RunRootBuilder) -> None:
    build.admit(2)
    first = build.shard({0: [0, 0], 1: [0, 0]})
    build.publish(0, 0, None, [])
    build.record(1, [first])
    build.publish(1, 1, 0, [first])
    quarantine(build, first)  # after its step: a regeneration would be trained a second time
    build.shard({0: [0, 0], 1: [0, 0]})
    violations = audit(build).violations
    assert any("group g00000000 was produced 2 times for 0 quarantines" in v for v in violations), violations
    assert any(f"shard {first}, consumed by step 1" in v and "(quarantined after it was trained)" in v
               for v in violations), violations  # fmt: skip
