"""The written-groups index (``scheduler/written.json``): which groups some published shard
holds or filtering left out, kept small (a dense prefix plus the groups past the first gap)
and brought up to date from the shard claims after a kill. A restart re-dispatches exactly
the admitted groups it lacks. The groups of a quarantined shard are un-written once
(:func:`learn_quarantines`) and admitted again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardInfo, ShardReader, quarantined_shard, quarantined_shard_names, read_claims
from asyncrl.tasks.scheduler.group_schedule import group_index, scheduler_group_index


LOG = logging.getLogger("asyncrl.scheduler")
WRITTEN_FORMAT = 1


@dataclass
class WrittenGroups:
    """Group indices some published shard holds, or that dynamic filtering left out
    (``filtered`` of them), as a dense prefix plus the rest, less the groups of quarantined
    shards waiting to be generated again (``regenerate``).

    Every k < ``prefix`` is written, and so is every k in ``extra`` (all >= ``prefix``),
    except the keys of ``regenerate``; ``next_seq`` says which shards are counted: the
    groups of every shard published with a sequence number below it. Groups finish out of
    order, so ``extra`` holds the groups written past the first gap: O(groups in flight),
    not O(run), and the saved object stays small however long the run (``quarantined``
    grows by one number per quarantined shard: rare).
    """

    next_seq: int = 0
    prefix: int = 0
    extra: set[int] = field(default_factory=set)
    filtered: int = 0
    """How many of the groups counted were left out by dynamic filtering (in no shard)."""
    quarantined: set[int] = field(default_factory=set)
    """Sequence numbers of the quarantined shards already counted (:func:`learn_quarantines`):
    each is counted once, so it is generated again once."""
    regenerate: dict[int, int] = field(default_factory=dict)
    """Group index -> the sequence number of the quarantined shard that held it: un-written
    groups to generate again (the same prompt group, new samples), in the order found, which
    is the order the controller admits them in. Each key is also in the prefix or ``extra``."""
    regenerated: int = 0
    """Groups of quarantined shards written again since the run began (in a shard or left out)."""

    def add(self, indices: Iterable[int]) -> None:
        """Count ``indices`` as written (amortised O(1) each); a group of ``regenerate`` is
        then written again (``regenerated``)."""
        for index in indices:
            if self.regenerate.pop(index, None) is not None:
                self.regenerated += 1
            if index >= self.prefix:
                self.extra.add(index)
        while self.prefix in self.extra:
            self.extra.remove(self.prefix)
            self.prefix += 1

    def unwrite(self, indices: Iterable[int], seq: int) -> list[int]:
        """Un-write the written groups among ``indices`` (those of quarantined shard ``seq``):
        they go to ``regenerate``; returns them. ``seq`` counts as seen either way."""
        self.quarantined.add(seq)
        found = [index for index in indices if index in self]
        for index in found:
            self.regenerate[index] = seq
        return found

    def _counted(self, index: int) -> bool:
        return index < self.prefix or index in self.extra

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self._counted(index) and index not in self.regenerate

    @property
    def total(self) -> int:
        """How many groups are written or filtered."""
        return self.prefix + len(self.extra) - len(self.regenerate)

    @property
    def in_shards(self) -> int:
        """How many groups some shard holds (the kept groups; quarantined ones not)."""
        return self.total - self.filtered

    @property
    def quarantined_groups(self) -> int:
        """Groups taken out of the run by a quarantine so far (once per quarantine: a group
        whose regeneration was quarantined too counts twice): not trained, released from the
        gate (:meth:`RolloutController._learn_quarantines`)."""
        return self.regenerated + len(self.regenerate)

    def count_below(self, limit: int) -> int:
        """How many of the groups 0 .. limit-1 are written: O(|extra| + |regenerate|)."""
        counted = min(self.prefix, limit) + sum(1 for index in self.extra if index < limit)
        return counted - sum(1 for index in self.regenerate if index < limit)

    def missing_below(self, limit: int) -> list[int]:
        """The groups 0 .. limit-1 never written, ascending: O(limit - prefix). Groups of
        quarantined shards (``regenerate``) are not among them: they are admitted again."""
        return [k for k in range(self.prefix, limit) if k not in self.extra]

    def to_json(self) -> str:
        return json.dumps(
            {"format": WRITTEN_FORMAT, "next_seq": self.next_seq, "prefix": self.prefix,
             "extra": sorted(self.extra), "filtered": self.filtered, "quarantined": sorted(self.quarantined),
             "regenerate": [[k, seq] for k, seq in self.regenerate.items()], "regenerated": self.regenerated,
             "saved_at": time.time()}
        )  # fmt: skip

    @staticmethod
    def from_json(raw: bytes, source: str) -> WrittenGroups:
        """Parse a saved index; ``ValueError`` names ``source`` if it is not one."""
        try:
            content = json.loads(raw)
            written = WrittenGroups(int(content["next_seq"]), int(content["prefix"]), {int(k) for k in content["extra"]},
                                    int(content.get("filtered", 0)), {int(q) for q in content.get("quarantined", ())},
                                    {int(k): int(seq) for k, seq in content.get("regenerate", ())},
                                    int(content.get("regenerated", 0)))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{source}: corrupt written-groups index ({exc})") from None
        if (written.next_seq < 0 or written.prefix < 0 or any(k < written.prefix for k in written.extra)
                or not 0 <= written.filtered <= written.total or written.regenerated < 0
                or not all(written._counted(k) and seq in written.quarantined
                           for k, seq in written.regenerate.items())):  # fmt: skip
            raise ValueError(f"{source}: inconsistent written-groups index {content!r}")
        return written


def save_written_groups(root: RunRoot, written: WrittenGroups) -> None:
    """Replace ``scheduler/written.json`` with ``written`` (one PUT)."""
    fs.put_atomic_replace(root, paths.SCHEDULER_WRITTEN, written.to_json().encode())


def _published(reader: ShardReader, name: str, quarantined: list[str]) -> bool:
    return reader.locate(name) is not None or any(q == name or q.startswith(f"{name}.") for q in quarantined)


def _scan_all_shards(root: RunRoot, run_id: str) -> WrittenGroups:
    """The index rebuilt by reading every shard (waiting and consumed): O(run), used only for a
    root whose claims predate the index (they name no groups)."""
    reader = ShardReader(root, run_id)
    written = WrittenGroups()
    for shard in reader.list_shards():
        table = reader.read(shard)
        written.add({group_index(g) for g in set(table.column("group_id").to_pylist())})
        written.next_seq = max(written.next_seq, shard.seq + 1)
    return written


def load_written_groups(root: RunRoot, run_id: str, save: bool = True) -> WrittenGroups:
    """The groups some shard of this run holds: the saved index, brought up to date.

    The index is saved (by the controller, :meth:`RolloutController._flush`) only after
    the shard it counts was published, and one shard write at a time, so it never counts
    a group that is not in a shard; what it may lack are the shards published after the
    last save (a kill in between). Those have sequence numbers >= ``next_seq``: their
    claims (:func:`asyncrl.storage.shards.read_claims`) name the shard and its group ids,
    and a claimed shard counts once it exists, waiting, consumed or quarantined (a claim
    whose shard never appeared was cut by a kill: its groups are generated again). Work:
    one read of the index, one read per claim since it plus one, at most three existence
    checks per such claim, and one listing of ``quarantine/`` when there are claims to
    check; no shard is listed or read. A quarantined shard counts here like any other: its
    groups are un-written afterwards, once, by :func:`learn_quarantines`.

    A root whose claims name no groups (written before claims did) is scanned in full
    once. With ``save``, an index that moved forward is saved back.
    """
    raw: bytes | None
    try:
        raw = fs.read_bytes(root, paths.SCHEDULER_WRITTEN)
    except FileNotFoundError:
        raw = None
    written = WrittenGroups() if raw is None else WrittenGroups.from_json(raw, root.display(paths.SCHEDULER_WRITTEN))
    claims = read_claims(root, written.next_seq)
    rebuilt = any(claim.group_ids is None for claim in claims)
    if rebuilt:
        written = _scan_all_shards(root, run_id)
        claims = read_claims(root, written.next_seq)
    if claims:
        reader = ShardReader(root, run_id)
        quarantined = fs.list_dir(root, paths.QUARANTINE_DIR)
        for claim in claims:
            # A claim naming no groups after a full scan: its shard is not in the run (never
            # published, or quarantined before the index existed).
            if claim.shard is not None and claim.group_ids is not None and _published(reader, claim.shard, quarantined):
                written.add({group_index(g) for g in claim.group_ids})
            written.next_seq = claim.seq + 1
    if save and (claims or rebuilt):
        save_written_groups(root, written)
    return written


def learn_quarantines(root: RunRoot, written: WrittenGroups) -> list[int]:
    """Un-write the groups of the shards quarantined since ``written`` last looked (the
    caller saves it); returns them, in the order they are to be generated again.

    The rule: a quarantined shard (one whose sequence number ``written`` counts and has not
    counted as quarantined yet) is counted once (``quarantined``); its groups, named by its
    claim (the file itself may be unreadable), become un-written (``regenerate``) and the
    controller admits each again: the same prompt group (same id and prompt), new samples,
    as a new admission at the version of the time (:meth:`RolloutController._admit_one`).
    Exactly once: the shard's number is saved with its un-written groups in one PUT of the
    index, so a restart neither forgets nor repeats it; the regenerated group's shard is
    another shard, and its own quarantine regenerates the group again. Not regenerated: a
    shard a ledger entry names (trained before it was quarantined: a regeneration would be
    trained twice), and a shard whose claim names no groups (written before claims did).

    Work: one listing of ``quarantine/``; for each new quarantined shard one claim read, and
    the ledger's entries read once (O(steps), only when there is a new one)."""
    new = {}
    for name, copies in quarantined_shard_names(root).items():
        info = ShardInfo.from_name(name)
        if info is not None and info.seq < written.next_seq and info.seq not in written.quarantined:
            new[name] = copies
    if not new:
        return []
    trained = Ledger(root).consumed()
    found: list[int] = []
    for name, copies in new.items():
        shard = quarantined_shard(root, name, copies)
        indices = [k for k in map(scheduler_group_index, shard.group_ids or ()) if k is not None]
        if name in trained or not indices:
            why = "a ledger entry names it (trained before it was quarantined)" if name in trained else (
                "its claim names no scheduler groups")
            LOG.warning("quarantined shard %s is not generated again: %s", name, why)
            written.quarantined.add(shard.seq)
            continue
        regenerated = written.unwrite(indices, shard.seq)
        LOG.warning("shard %s was quarantined (%s): its %d groups are generated again", name,
                    ", ".join(root.display(c) for c in copies), len(regenerated))  # fmt: skip
        found.extend(regenerated)
    return found


def written_group_indices(root: RunRoot, run_id: str) -> WrittenGroups:
    """Indices of the groups some shard of this run already holds (:func:`load_written_groups`,
    without saving: for a look that changes nothing)."""
    return load_written_groups(root, run_id, save=False)
