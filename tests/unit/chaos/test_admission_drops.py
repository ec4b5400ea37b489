"""Rule (e)'s second source: the dropped-sample count from the scheduler's admission records
(each group's admission version against the step that trained it), independent of the
trainer's staleness formula over token versions; hand-built records, no vLLM, no trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_root_builder import ETA, RUN_ID, RunRootBuilder, SAMPLES_PER_GROUP as N

from asyncrl.chaos.audit import AuditReport, audit_run
from asyncrl.chaos.waste import admission_drops
from asyncrl.storage.admissions import Admission
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import LedgerEntry


@pytest.fixture
def build(tmp_path: Path) -> RunRootBuilder:
    return RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)


def audit(build: RunRootBuilder) -> AuditReport:
    return audit_run(build.root, RUN_ID, ETA)


def test_a_group_admitted_at_v_is_over_stale_only_when_trained_more_than_eta_steps_later() -> None:
    """Admitted on weights with v = 2 updates, eta = 1: step k trains with k - 1 updates, so
    step 4 (lag 1) is within the bound and step 5 (lag 2) is not; each sample of the group
    counts. A group with no record is listed, and its step is not compared."""
    entries = [LedgerEntry(4, ("s4",), 1.0), LedgerEntry(5, ("s5",), 1.0), LedgerEntry(6, ("s6",), 1.0)]
    groups = {"s4": {"g00000001": 3}, "s5": {"g00000002": 3, "g00000003": 2}, "s6": {"g00000004": 3}}
    admissions = {
        "s4": {"g00000001": Admission(2, 2)},
        "s5": {"g00000002": Admission(2, 2), "g00000003": Admission(7, 3)},  # a label ahead of its updates
        "s6": None,  # a shard written without records
    }
    counted = admission_drops(entries, groups, admissions, max_staleness=1)
    assert dict(counted.by_step) == {5: 3}  # g2 at lag 2; g3 lags 4 - 3 = 1 (updates count, not the label)
    assert counted.unrecorded == ("s6 group g00000004",) and counted.unrecorded_steps == {6}
    assert dict(admission_drops(entries, groups, admissions, max_staleness=2).by_step) == {}


def test_a_clean_run_with_records_passes_with_both_counts_zero(build: RunRootBuilder) -> None:
    build.clean_run(records=True)
    report = audit(build)
    assert report.ok, report.violations
    assert (report.dropped_stale, report.admission_dropped_stale, report.unrecorded_admissions) == (0, 0, 0)
    out = json.loads(json.dumps(report.to_json()))
    assert (out["dropped_stale"], out["admission_dropped_stale"], out["unrecorded_admissions"]) == (0, 0, 0)


def three_steps(build: RunRootBuilder, last_tokens: dict[int, list[int]], last_admitted: dict[int, int]) -> None:
    """The clean run (records kept) and a third step on version 3 training groups 4 and 5."""
    build.clean_run(records=True)
    build.admit(6, records=True)
    third = build.shard(last_tokens, last_admitted)
    build.record(3, [third])
    build.publish(3, 3, 2, [third])


def test_records_catch_a_group_admitted_too_early_that_the_token_versions_hide(build: RunRootBuilder) -> None:
    """Group 5's tokens say version 2 (staleness 2 - 2 = 0 by the trainer's formula), but the
    scheduler admitted it on version 0: step 3 trains it 2 steps after its admission."""
    three_steps(build, {4: [1, 2], 5: [2, 2]}, {4: 1, 5: 0})
    report = audit(build)
    assert (report.dropped_stale, report.admission_dropped_stale) == (0, N)
    assert report.dropped_steps == {3: N}
    assert report.violations == (
        f"(e) step 3: the scheduler's admission records put {N} samples over max_staleness {ETA}, "
        "the trainer's staleness formula 0",
        f"(e) {N} samples were dropped as staler than max_staleness {ETA} (generated, then thrown away): "
        f"{N} at step 3",
    )


def test_a_drop_by_the_trainers_formula_that_the_records_do_not_confirm_is_reported_too(build: RunRootBuilder) -> None:
    """Group 5's tokens are of version 0 (staleness 2 at step 3, dropped), its admission on
    version 1 (lag 1): both the drop and the disagreement are violations."""
    three_steps(build, {4: [1, 2], 5: [0, 0]}, {4: 1, 5: 1})
    report = audit(build)
    assert (report.dropped_stale, report.admission_dropped_stale) == (N, 0)
    assert report.violations[0] == (
        f"(e) step 3: the scheduler's admission records put 0 samples over max_staleness {ETA}, "
        f"the trainer's staleness formula {N}"
    )
    assert report.violations[1].startswith(f"(e) {N} samples were dropped") and len(report.violations) == 2


def test_a_run_that_keeps_records_fails_on_a_trained_group_without_one(build: RunRootBuilder) -> None:
    first, second = build.clean_run()
    assert audit(build).ok  # a scheduler that keeps no records (an older one, a hand-made root)
    build.admit(4, records=True)  # now the state says the scheduler records admissions
    report = audit(build)
    assert report.unrecorded_admissions == 4 and not report.ok
    assert report.violations == (
        "(e) 4 trained groups have no admission record, though the scheduler keeps them (their drops have no "
        f"second count): {first} group g00000000, {first} group g00000001, {second} group g00000002, "
        f"{second} group g00000003",
    )
