"""Audit of a run root: exactly-once production and consumption, monotone weights and the
staleness bound, checked over what is in storage (nothing is moved or written). Each
violation is one line naming the objects involved. Rules:

(a) production: each admitted group (ids below the scheduler's persisted count) is in
    exactly one shard or has a dynamic-filter record; in-flight ones only with ``in_flight_ok``.
    A quarantined shard (in ``quarantine/``, its groups named by its claim) owes one
    regeneration of each of its groups unless a ledger entry names it (trained): a group is
    produced (in a shard, quarantined or not, or left out) once plus once per quarantine
    it owes, so it is neither lost nor trained twice; one still owed is awaiting
    regeneration (like an in-flight group);
(b) consumption: ledger steps 1..N without a gap, no shard named twice, every named shard valid;
(c) weights: publish order is version order, ``LATEST`` is the newest, lineages are consistent;
(d) staleness: per sample of step k, s = max(0, (k - 1) - min_t U(v_t)) as the trainer counts
    it (:func:`sample_staleness`, imported); samples above ``max_staleness`` count as dropped,
    and a token version never published or not older than the version step k published is
    a violation (labels grow in publish order; a trainer resumed from a checkpoint names that
    checkpoint's version as its next parent, and trains tokens of later labels legitimately);
(e) no waste: a sample dropped as too stale is a violation, counted from two sources
    (:mod:`asyncrl.chaos.waste`): the trainer's formula, by (d) over the consumed shards and
    as the trainer recorded it (``dropped_stale`` in the ``metrics`` of the lineage of each
    final step's weights), and the scheduler's admission records in the shards (each group's
    admission version against the step that trained it); one line names how many were
    dropped at which steps, others any step where the counts differ.
The rules in full: ``docs/internals/launch.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from asyncrl.chaos.waste import admission_drops, audit_waste, recorded_drops
from asyncrl.storage import fs, paths
from asyncrl.storage.admissions import Admission, read_admissions
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.ledger import Ledger, LedgerEntry
from asyncrl.storage.schema import Sample, table_to_groups, upgrade_table, validate_table
from asyncrl.storage.shards import QuarantinedShard, ShardReader, list_quarantined
from asyncrl.storage.weight_lineage import lineage_updates, read_lineage
from asyncrl.storage.weights import WeightStore

# The audit checks the contracts of the scheduler (group ids, its persisted state) and of
# the trainer (the lineage file beside each version, the staleness formula): it imports
# their definitions rather than restating them.
from asyncrl.tasks.scheduler.filtered import filtered_groups, left_out_tokens
from asyncrl.tasks.scheduler.gate_state import load_admissions, load_gate_state
from asyncrl.tasks.scheduler.group_schedule import group_id, scheduler_group_index
from asyncrl.tasks.trainer.staleness import sample_staleness


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit_run` found; ``ok`` when ``violations`` is empty."""

    admitted: int
    """Groups admitted by the scheduler (its persisted gate count)."""
    groups_written: int
    """Distinct group ids held by the shards."""
    unwritten_groups: tuple[str, ...]
    """Admitted groups no shard holds (in flight when the scheduler stopped), filtered ones aside."""
    filtered_groups: int
    """Admitted groups dynamic filtering left out (recorded in ``scheduler/filtered/``, in no shard)."""
    quarantined_shards: int
    """Shards in ``quarantine/``."""
    quarantined_groups: int
    """Groups of quarantined shards no ledger entry names: each owes one regeneration (a group
    quarantined twice counts twice)."""
    regenerated_groups: int
    """Of those, the ones generated again since (a later shard holds the group, or it was left out)."""
    awaiting_regeneration: tuple[str, ...]
    """Groups whose every production is quarantined: to be generated again (in flight)."""
    shards: int
    consumed_shards: int
    ledger_steps: int
    """Steps in the final ledger (N)."""
    versions: tuple[int, ...]
    """Complete weight versions, ascending."""
    step_versions: dict[int, int]
    """Final ledger step -> the weight version published for it."""
    trained_samples: int
    dropped_stale: int
    """Samples of consumed shards staler than ``max_staleness``: dropped by the trainer, not trained."""
    dropped_tokens: int
    """Model tokens of those samples (environment tokens of multi-turn samples left out):
    generated, then thrown away (0 in a healthy run, where the scheduler's write order keeps
    every sample within the bound)."""
    staleness_counts: dict[int, int]
    """Staleness -> number of trained samples."""
    max_staleness: int
    dropped_steps: dict[int, int] = field(default_factory=dict)
    """Final ledger step -> samples it dropped as too stale (the largest of the audit's count,
    the trainer's recorded one and the admission records' count); only steps that dropped
    any. Rule (e): any is a violation."""
    trainer_dropped_stale: int = 0
    """Samples the trainer recorded as dropped for staleness over the final ledger steps
    (``dropped_stale`` in each step's lineage metrics; steps whose lineage has none count 0)."""
    admission_dropped_stale: int = 0
    """Trained samples whose group's admission record lags the step that trained it by more
    than ``max_staleness`` (rule (e)'s second source, :func:`~asyncrl.chaos.waste.admission_drops`)."""
    unrecorded_admissions: int = 0
    """Trained groups whose shard holds no admission record of them (a violation when the
    scheduler's state says it keeps records)."""
    shard_tokens: int = 0
    """Model tokens of every sample in the run's readable shards, trained or not."""
    left_out_tokens: int = 0
    """Model tokens of the groups left out on purpose (their records' ``output_tokens``)."""
    violations: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["step_versions"] = {str(k): v for k, v in self.step_versions.items()}
        out["staleness_counts"] = {str(k): v for k, v in self.staleness_counts.items()}
        out["dropped_steps"] = {str(k): v for k, v in self.dropped_steps.items()}
        return out


@dataclass(frozen=True)
class _ShardContent:
    """The groups of one shard by id, each its samples in row order."""

    groups: dict[str, list[Sample]]
    admissions: dict[str, Admission] | None
    """The scheduler's admission record of each group (None: the shard has none)."""


def audit_run(root: RunRoot, run_id: str, max_staleness: int, *, in_flight_ok: bool = False) -> AuditReport:
    """Check rules (a)-(d) of the module docstring on run ``run_id`` in ``root``.

    ``max_staleness`` is the trainer's bound (``RunConfig.max_staleness``:
    ``trainer.max_staleness``, else ``rollout.eta``)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
    violations: list[str] = []
    admitted = admitted_groups(root, violations)
    contents = read_shards(root, run_id, violations)
    filtered = filtered_groups(root)
    entries = read_ledger(root, violations)
    quarantined = list_quarantined(root)
    regeneration = audit_regeneration(contents, quarantined, entries, filtered, in_flight_ok, violations)
    unwritten = audit_production(
        admitted, contents, in_flight_ok, violations, filtered, regeneration.quarantined_holders
    )
    audit_consumption(entries, contents, violations, {q.name for q in quarantined})
    versions, lineages = audit_weights(root, violations)
    pruned = pruned_lineages(root, lineages, violations)
    step_versions = steps_published(entries, lineages, violations)
    staleness, dropped_by_step, dropped_tokens = audit_staleness(
        entries, contents, step_versions, lineages, set(versions) | set(pruned), max_staleness, violations
    )
    recorded = recorded_drops(step_versions, lineages)
    admitted_drops = admission_drops(
        entries,
        {name: {gid: len(group) for gid, group in c.groups.items()} if c else None for name, c in contents.items()},
        {name: c.admissions if c else None for name, c in contents.items()},
        max_staleness,
    )
    dropped_steps = audit_waste(
        dropped_by_step, recorded, admitted_drops, step_versions, records_admissions(root), max_staleness, violations
    )
    try:
        left_out = left_out_tokens(root, filtered)
    except ValueError as exc:
        violations.append(f"(a) a left-out group's record is incomplete: {exc}")
        left_out = 0
    return AuditReport(
        admitted=admitted,
        groups_written=len({gid for content in contents.values() if content for gid in content.groups}),
        unwritten_groups=tuple(unwritten),
        filtered_groups=len(filtered),
        quarantined_shards=len(quarantined),
        quarantined_groups=regeneration.owed,
        regenerated_groups=regeneration.regenerated,
        awaiting_regeneration=regeneration.awaiting,
        shards=len(contents),
        consumed_shards=sum(len(e.shards) for e in entries),
        ledger_steps=len(entries),
        versions=tuple(versions),
        step_versions=step_versions,
        trained_samples=sum(staleness.values()),
        dropped_stale=sum(dropped_by_step.values()),
        dropped_tokens=dropped_tokens,
        staleness_counts=dict(sorted(staleness.items())),
        max_staleness=max_staleness,
        dropped_steps=dropped_steps,
        trainer_dropped_stale=sum(recorded.values()),
        admission_dropped_stale=sum(admitted_drops.by_step.values()),
        unrecorded_admissions=len(admitted_drops.unrecorded),
        shard_tokens=sum(s.model_token_count for c in contents.values() if c for g in c.groups.values() for s in g),
        left_out_tokens=left_out,
        violations=tuple(violations),
    )


def admitted_groups(root: RunRoot, violations: list[str]) -> int:
    """The scheduler's persisted gate count (0 if it never saved one)."""
    try:
        state = load_gate_state(root)
    except ValueError as exc:
        violations.append(f"(a) {exc}")
        return 0
    return 0 if state is None else state.admitted


def records_admissions(root: RunRoot) -> bool:
    """Whether the run's scheduler keeps admission records (its state has them); a corrupt
    state is rule (a)'s violation (:func:`admitted_groups`) and requires none."""
    try:
        return load_admissions(root) is not None
    except ValueError:
        return False


def read_shards(root: RunRoot, run_id: str, violations: list[str]) -> dict[str, _ShardContent | None]:
    """Every shard of the run (``trajectories/`` and ``consumed/``) by name (None: unreadable
    or invalid, a violation).
    Read without :class:`ShardReader`'s quarantine: an audit moves nothing."""
    contents: dict[str, _ShardContent | None] = {}
    for info in ShardReader(root, run_id).list_shards():
        source = root.display(info.relpath)
        try:
            stored = pa.ipc.open_file(pa.py_buffer(fs.read_bytes(root, info.relpath))).read_all()
            admissions = read_admissions(stored.schema.metadata, source)
            table = upgrade_table(stored)
            validate_table(table, source, run_id=run_id)
        except (pa.ArrowException, OSError, ShardValidationError) as exc:
            violations.append(f"(b) shard {info.name} is not a valid shard of run {run_id!r}: {exc}")
            contents[info.name] = None
            continue
        contents[info.name] = _ShardContent({group[0].group_id: group for group in table_to_groups(table)}, admissions)
    return contents


@dataclass(frozen=True)
class _Regeneration:
    quarantined_holders: dict[str, list[str]]
    """Group id -> the quarantined shards that held it."""
    owed: int
    regenerated: int
    awaiting: tuple[str, ...]


def audit_regeneration(
    contents: dict[str, _ShardContent | None],
    quarantined: Sequence[QuarantinedShard],
    entries: Sequence[LedgerEntry],
    filtered: Sequence[int],
    in_flight_ok: bool,
    violations: list[str],
) -> _Regeneration:
    """Rule (a) for the groups of quarantined shards: per group, P productions (shards that
    hold it, quarantined or not, and a left-out record) against Q regenerations owed (its
    quarantined shards no ledger entry names): P = Q + 1 when every one was made, P = Q
    while the last is awaited (``in_flight_ok``); P > Q + 1 was produced (and maybe trained)
    too often. Regenerations made: min(Q, P - 1) per group."""
    trained = {name for entry in entries for name in entry.shards}
    holders: dict[str, list[str]] = {}
    for name, content in contents.items():
        for gid in content.groups if content else ():
            holders.setdefault(gid, []).append(name)
    in_quarantine: dict[str, list[str]] = {}
    owed: Counter[str] = Counter()
    for shard in quarantined:
        if shard.group_ids is None:
            violations.append(f"(a) quarantined shard {shard.name}: its claim names no groups, they cannot be accounted for")
            continue
        for gid in shard.group_ids:
            in_quarantine.setdefault(gid, []).append(shard.name)
            owed[gid] += shard.name not in trained
    left_out = {group_id(k) for k in filtered}
    regenerated = 0
    awaiting: list[str] = []
    for gid, names in sorted(in_quarantine.items()):
        productions = len(names) + len(holders.get(gid, ())) + (gid in left_out)
        regenerated += min(owed[gid], productions - 1)
        if productions > owed[gid] + 1:
            violations.append(
                f"(a) group {gid} was produced {productions} times for {owed[gid]} quarantines: in shards "
                f"{', '.join(sorted([*names, *holders.get(gid, ())]))}{' and left out' if gid in left_out else ''}"
            )
        elif productions == owed[gid]:
            awaiting.append(gid)
    if awaiting and not in_flight_ok:
        shown = ", ".join(awaiting[:10]) + (f" and {len(awaiting) - 10} more" if len(awaiting) > 10 else "")
        violations.append(f"(a) {len(awaiting)} groups of quarantined shards are not generated again: {shown}")
    return _Regeneration(in_quarantine, sum(owed.values()), regenerated, tuple(awaiting))


def audit_production(
    admitted: int,
    contents: dict[str, _ShardContent | None],
    in_flight_ok: bool,
    violations: list[str],
    filtered: Sequence[int] = (),
    quarantined: dict[str, list[str]] | None = None,
) -> list[str]:
    """Rule (a); returns the admitted groups no shard holds (quarantined or not) and no
    filtered record names (the groups of quarantined shards: :func:`audit_regeneration`)."""
    holders: dict[str, list[str]] = {}
    for name, content in contents.items():
        for gid in content.groups if content else ():
            holders.setdefault(gid, []).append(name)
    for gid, shards in sorted(holders.items()):
        index = scheduler_group_index(gid)
        if len(shards) > 1:
            violations.append(f"(a) group {gid} was produced {len(shards)} times: in shards {', '.join(shards)}")
        if index is None:
            violations.append(f"(a) group id {gid!r} (in {shards[0]}) is not a scheduler group id (g########)")
        elif index >= admitted:
            violations.append(
                f"(a) group {gid} (in {shards[0]}) was never admitted: the scheduler admitted {admitted} groups"
            )
    for index in filtered:
        gid = group_id(index)
        if index >= admitted:
            violations.append(f"(a) group {gid} was filtered out but never admitted: the scheduler admitted {admitted} groups")
        if gid in holders:
            violations.append(f"(a) group {gid} was filtered out but is also in shards {', '.join(holders[gid])}")
    left_out = set(filtered)
    quarantined = quarantined or {}
    for gid, shards in sorted(quarantined.items()):
        index = scheduler_group_index(gid)
        if index is not None and index >= admitted and gid not in holders:
            violations.append(
                f"(a) group {gid} (in quarantined {shards[0]}) was never admitted: the scheduler admitted {admitted} groups"
            )
    unwritten = [group_id(k) for k in range(admitted)
                 if group_id(k) not in holders and group_id(k) not in quarantined and k not in left_out]  # fmt: skip
    if unwritten and not in_flight_ok:
        shown = ", ".join(unwritten[:10]) + (f" and {len(unwritten) - 10} more" if len(unwritten) > 10 else "")
        violations.append(f"(a) {len(unwritten)} of {admitted} admitted groups are in no shard: {shown}")
    return unwritten


def read_ledger(root: RunRoot, violations: list[str]) -> list[LedgerEntry]:
    try:
        return Ledger(root).entries()
    except (ValueError, FileNotFoundError) as exc:
        violations.append(f"(b) the ledger cannot be read: {exc}")
        return []


def audit_consumption(
    entries: Sequence[LedgerEntry],
    contents: dict[str, _ShardContent | None],
    violations: list[str],
    quarantined: Collection[str] = (),
) -> None:
    """Rule (b)."""
    steps = [e.step for e in entries]
    if steps != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, max(steps, default=0) + 1)) - set(steps))
        violations.append(f"(b) the ledger's steps are {steps}, not 1..{len(steps)}: missing steps {missing}")
    consumers: dict[str, list[int]] = {}
    for entry in entries:
        for name in entry.shards:
            consumers.setdefault(name, []).append(entry.step)
    for name, by_steps in sorted(consumers.items()):
        if len(by_steps) > 1:
            violations.append(f"(b) shard {name} was consumed {len(by_steps)} times: by steps {by_steps}")
        if name not in contents:
            where = " (quarantined after it was trained)" if name in quarantined else ""
            violations.append(
                f"(b) shard {name}, consumed by step {by_steps[0]}, is in neither "
                f"{paths.TRAJECTORIES_DIR}/ nor {paths.CONSUMED_DIR}/{where}"
            )


def audit_weights(root: RunRoot, violations: list[str]) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """Rule (c) except the per-step order; returns the complete versions and their lineages."""
    store = WeightStore(root)
    versions = store.list_versions()
    lineages: dict[int, dict[str, Any]] = {}
    published: list[tuple[int, float]] = []
    for version in versions:
        try:
            published.append((version, float(store.manifest(version)["published_at"])))
            lineage = read_lineage(root, version)
        except (ValueError, KeyError, TypeError) as exc:
            violations.append(f"(c) weight version {version}: unreadable manifest or lineage ({exc})")
            continue
        if lineage is None:
            continue
        lineages[version] = lineage
        parent = lineage.get("parent_version")
        if lineage.get("version") != version:
            violations.append(f"(c) weight version {version}: its lineage names version {lineage.get('version')!r}")
        if parent is not None and (not isinstance(parent, int) or parent >= version):
            violations.append(f"(c) weight version {version}: parent version {parent!r} is not below it")
    for (before, at_before), (after, at_after) in zip(published, published[1:]):
        if at_after <= at_before:
            violations.append(
                f"(c) weight version {after} was published at {at_after:.3f}, not after version {before} ({at_before:.3f})"
            )
    try:
        latest = store.latest()
    except ValueError as exc:
        violations.append(f"(c) {exc}")
        latest = None
    if versions and latest != versions[-1]:
        violations.append(f"(c) LATEST names version {latest}, the newest complete version is {versions[-1]}")
    return versions, lineages


def pruned_lineages(root: RunRoot, lineages: dict[int, dict[str, Any]], violations: list[str]) -> list[int]:
    """Versions retention pruned (their weights gone, their lineage kept): added to
    ``lineages`` so steps and staleness are audited through them; returns them ascending."""
    pruned = WeightStore(root).pruned_versions()
    for version in pruned:
        try:
            lineage = read_lineage(root, version)
        except (ValueError, KeyError, TypeError) as exc:
            violations.append(f"(c) pruned weight version {version}: unreadable lineage ({exc})")
            continue
        if lineage is not None:
            lineages[version] = lineage
    return pruned


def steps_published(
    entries: Sequence[LedgerEntry], lineages: dict[int, dict[str, Any]], violations: list[str]
) -> dict[int, int]:
    """Final ledger step -> the newest version whose lineage names that step; checks that
    it was trained on the ledger's shards and that these versions increase with the step."""
    newest: dict[int, int] = {}
    for version, lineage in lineages.items():
        step = lineage.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            newest[step] = max(version, newest.get(step, -1))
    step_versions: dict[int, int] = {}
    for entry in entries:
        version = newest.get(entry.step)
        if version is None:
            violations.append(f"(d) step {entry.step} is in the ledger but no published weights name it")
            continue
        trained_on = tuple(lineages[version].get("shards") or ())
        if trained_on != entry.shards:
            violations.append(
                f"(d) step {entry.step}: the ledger names shards {list(entry.shards)}, but weight version {version} "
                f"published for it was trained on {list(trained_on)}"
            )
        step_versions[entry.step] = version
    ordered = sorted(step_versions.items())
    for (step_a, version_a), (step_b, version_b) in zip(ordered, ordered[1:]):
        if version_b <= version_a:
            violations.append(
                f"(c) step {step_b} was published as version {version_b}, not after step {step_a}'s version {version_a}"
            )
    return step_versions


def audit_staleness(
    entries: Sequence[LedgerEntry],
    contents: dict[str, _ShardContent | None],
    step_versions: dict[int, int],
    lineages: dict[int, dict[str, Any]],
    published: set[int],
    max_staleness: int,
    violations: list[str],
) -> tuple[Counter[int], Counter[int], int]:
    """Rule (d); returns (staleness -> trained samples, step -> samples dropped as too stale,
    their model tokens)."""
    trained: Counter[int] = Counter()
    dropped: Counter[int] = Counter()
    dropped_tokens = 0

    def updates_of(version: int) -> int:
        return lineage_updates(version, lineages.get(version))

    for entry in entries:
        if entry.step not in step_versions:
            continue
        step_version = step_versions[entry.step]
        if not isinstance(lineages[step_version].get("parent_version"), int):
            violations.append(f"(d) step {entry.step}: weight version {step_version} names no parent version")
            continue
        for name in entry.shards:
            content = contents.get(name)
            for gid, samples in (content.groups if content else {}).items():
                for index, sample in enumerate(samples):
                    versions = sample.model_values(sample.token_versions)
                    if not versions:
                        continue
                    unpublished = sorted(set(versions) - published)
                    if unpublished:
                        violations.append(
                            f"(d) {name} group {gid} sample {index}: token versions {unpublished} were never published"
                        )
                    newer = sorted(v for v in set(versions) - set(unpublished) if v >= step_version)
                    if newer:
                        violations.append(
                            f"(d) {name} group {gid} sample {index}: tokens of version {newer[-1]} trained by step "
                            f"{entry.step}, published as version {step_version} (not older than the step's own "
                            "weights: mislabelled tokens)"
                        )
                        continue
                    s = sample_staleness(sample, entry.step - 1, updates_of)
                    if s > max_staleness:
                        dropped[entry.step] += 1
                        dropped_tokens += sample.model_token_count
                    else:
                        trained[s] += 1
    return trained, dropped, dropped_tokens
