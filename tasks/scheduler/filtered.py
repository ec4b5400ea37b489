"""Records of the groups left out on purpose (``scheduler/filtered/g########.json``): groups
whose rewards are all equal under dynamic filtering, or whose episodes none could be kept.
A recorded group counts as written though no shard holds it; the audit lists them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import Sample
from asyncrl.tasks.scheduler.group_schedule import group_id, group_index
from asyncrl.tasks.scheduler.written_index import WrittenGroups


FILTERED_DIR = f"{paths.SCHEDULER_DIR}/filtered"
FILTER_REASON = "equal_rewards"
NO_EPISODE_KEPT = "no_episode_kept"


def filtered_record_path(index: int) -> str:
    """Where the record of filtered group ``index`` lies: ``scheduler/filtered/g{index:08d}.json``."""
    return f"{FILTERED_DIR}/{group_id(index)}.json"


def save_filtered(root: RunRoot, samples: Sequence[Sample]) -> None:
    """Record that the group of ``samples`` was left out by dynamic filtering (one PUT)."""
    save_left_out(root, group_index(samples[0].group_id), samples[0].prompt_id, FILTER_REASON, samples)


def save_left_out(root: RunRoot, index: int, prompt_id: str, reason: str, samples: Sequence[Sample]) -> None:
    """Record that group ``index`` is in no shard on purpose (one PUT): dynamic filtering
    (``equal_rewards``) or a group of episodes none of which could be kept
    (``no_episode_kept``, ``samples`` empty). The group then counts as filtered."""
    record = {
        "group_id": group_id(index),
        "prompt_id": prompt_id,
        "reason": reason,
        "reward": float(samples[0].reward) if samples else None,
        "samples": len(samples),
        "output_tokens": sum(s.model_token_count for s in samples),
        "filtered_at": time.time(),
    }
    fs.put_atomic_replace(root, filtered_record_path(index), json.dumps(record).encode())


def filtered_groups(root: RunRoot) -> list[int]:
    """Indices of every group dynamic filtering left out, ascending: one listing, O(filtered
    groups) (for audits; the controller checks single records, :func:`count_filtered`)."""
    found = []
    for name in fs.list_dir(root, FILTERED_DIR):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.startswith("g") and stem[1:].isdigit():
            found.append(group_index(stem))
    return sorted(found)


def left_out_tokens(root: RunRoot, indices: Sequence[int]) -> int:
    """Model tokens of left-out groups ``indices``, from their records (``output_tokens``; one
    read per group, for audits); a missing or unreadable record raises ``ValueError`` naming it."""
    total = 0
    for index in indices:
        record = fs.read_json_object(root, filtered_record_path(index))
        tokens = None if record is None else record.get("output_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise ValueError(f"{root.display(filtered_record_path(index))}: no output_tokens count in the record")
        total += tokens
    return total


def count_filtered(root: RunRoot, written: WrittenGroups, admitted: int) -> int:
    """Count in ``written`` the admitted groups it lacks that have a filtered record (recorded
    after the index was last saved); returns how many. One existence check per admitted
    group no shard holds: O(groups in flight)."""
    found = [k for k in written.missing_below(admitted) if fs.exists(root, filtered_record_path(k))]
    written.add(found)
    written.filtered += len(found)
    return len(found)


def all_equal_rewards(samples: Sequence[Sample]) -> bool:
    """The group has no advantage signal: every reward the same (what dynamic filtering leaves out)."""
    return len({float(s.reward) for s in samples}) == 1
