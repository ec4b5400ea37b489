"""Rule (e) of the run audit (:mod:`asyncrl.chaos.audit`): no sample dropped as too stale,
counted from two independent sources.

- The trainer's formula: per sample trained by ledger step k, s = max(0, (k - 1) - min_t
  U(v_t)) over its model tokens' versions (rule (d), the trainer's own
  :func:`~asyncrl.tasks.trainer.staleness.sample_staleness`), and the count the trainer
  recorded (``dropped_stale`` in the ``metrics`` of each step's lineage).
- The scheduler's admission records (:mod:`asyncrl.storage.admissions`): a group's shard
  names the update count a of the weights the servers held when the gate admitted it; the
  weights trained by step k have k - 1 updates (the final ledger's steps are 1..N), so the
  group lagged

      lag = (k - 1) - a

  steps behind its admission, and each of its samples counts as over-stale when lag >
  ``max_staleness``. The gate admits group j only while floor(j / B) <= a + e (e <= eta)
  and groups are trained in admission order, by step floor(j / B) + 1, so lag <= eta
  holds in a correct run. This count reads neither token versions nor lineages.

Tokens are sampled after their group's admission by weights with at least a updates (a
trainer rollback aside), so per sample the first count is at most the second; in a clean
run both are 0. Violations: any drop by either count; a step where they differ (only steps
whose every trained group has a record); a trained group without a record in a run whose
scheduler keeps them (its state says so: :func:`~asyncrl.tasks.scheduler.gate_state.load_admissions`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.storage.admissions import Admission
from asyncrl.storage.ledger import LedgerEntry


@dataclass(frozen=True)
class AdmissionDrops:
    """What the admission records say of the trained groups."""

    by_step: Counter[int]
    """Final ledger step -> samples whose group's admission lags more than ``max_staleness``."""
    unrecorded: tuple[str, ...]
    """``<shard> group <id>`` of each trained group its shard has no admission record of."""
    unrecorded_steps: frozenset[int]
    """Steps that trained such a group: their counts are not compared."""


def admission_drops(
    entries: Sequence[LedgerEntry],
    shard_groups: Mapping[str, Mapping[str, int] | None],
    shard_admissions: Mapping[str, Mapping[str, Admission] | None],
    max_staleness: int,
) -> AdmissionDrops:
    """The second count of rule (e) (module docstring) over the final ledger ``entries``:
    ``shard_groups`` gives each shard's groups and their sample counts (None: unreadable, a
    rule (b) violation, skipped), ``shard_admissions`` its records (None: it has none)."""
    by_step: Counter[int] = Counter()
    unrecorded: list[str] = []
    unrecorded_steps: set[int] = set()
    for entry in entries:
        trainer_updates = entry.step - 1
        for name in entry.shards:
            admissions = shard_admissions.get(name)
            for gid, samples in (shard_groups.get(name) or {}).items():
                admission = None if admissions is None else admissions.get(gid)
                if admission is None:
                    unrecorded.append(f"{name} group {gid}")
                    unrecorded_steps.add(entry.step)
                elif trainer_updates - admission.updates > max_staleness:
                    by_step[entry.step] += samples
    return AdmissionDrops(by_step, tuple(unrecorded), frozenset(unrecorded_steps))


def recorded_drops(step_versions: dict[int, int], lineages: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Final ledger step -> samples the trainer recorded as dropped for staleness
    (``metrics.dropped_stale`` in the lineage of the step's weights); steps without the figure
    are left out."""
    recorded: dict[int, int] = {}
    for step, version in step_versions.items():
        metrics = lineages.get(version, {}).get("metrics")
        value = metrics.get("dropped_stale") if isinstance(metrics, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            recorded[step] = int(value)
    return recorded


def audit_waste(
    counted: Counter[int],
    recorded: dict[int, int],
    admitted: AdmissionDrops,
    audited_steps: Collection[int],
    records_required: bool,
    max_staleness: int,
    violations: list[str],
) -> dict[int, int]:
    """Rule (e) (module docstring): ``counted`` is rule (d)'s count by the trainer's formula
    over ``audited_steps``, ``recorded`` the trainer's own, ``admitted`` the admission
    records'. Returns step -> dropped samples (the largest of the counts) for the steps that
    dropped any."""
    for step in sorted(set(counted) | set(recorded)):
        if step in recorded and recorded[step] != counted.get(step, 0):
            violations.append(
                f"(e) step {step}: the trainer recorded {recorded[step]} samples dropped as too stale, "
                f"the audit counts {counted.get(step, 0)}"
            )
    for step in sorted(set(audited_steps) - admitted.unrecorded_steps):
        if admitted.by_step.get(step, 0) != counted.get(step, 0):
            violations.append(
                f"(e) step {step}: the scheduler's admission records put {admitted.by_step.get(step, 0)} samples "
                f"over max_staleness {max_staleness}, the trainer's staleness formula {counted.get(step, 0)}"
            )
    if records_required and admitted.unrecorded:
        shown = ", ".join(admitted.unrecorded[:10])
        more = f" and {len(admitted.unrecorded) - 10} more" if len(admitted.unrecorded) > 10 else ""
        violations.append(
            f"(e) {len(admitted.unrecorded)} trained groups have no admission record, though the scheduler "
            f"keeps them (their drops have no second count): {shown}{more}"
        )
    steps = sorted(set(counted) | set(recorded) | set(admitted.by_step))
    by_step = {
        step: n
        for step in steps
        if (n := max(counted.get(step, 0), recorded.get(step, 0), admitted.by_step.get(step, 0)))
    }
    if by_step:
        at = ", ".join(f"{n} at step {step}" for step, n in by_step.items())
        violations.append(
            f"(e) {sum(by_step.values())} samples were dropped as staler than max_staleness {max_staleness} "
            f"(generated, then thrown away): {at}"
        )
    return by_step
