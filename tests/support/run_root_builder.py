"""Builds a run root piece by piece through the real storage classes: scheduler state,
trajectory shards, hand-written ledger entries, published weights with their lineage.
Plain functions and one class, no pytest."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.tasks.scheduler.gate_state import save_gate_state
from asyncrl.tasks.scheduler.group_schedule import group_id
from asyncrl.tasks.algo.staleness_gate import GateState
from asyncrl.storage import fs, paths
from asyncrl.storage.admissions import Admission
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.storage.weight_lineage import LINEAGE_FILE

RUN_ID = "audit-test"
BATCH_GROUPS, SAMPLES_PER_GROUP, ETA = 2, 2, 1


class RunRootBuilder:
    """Writes a run root piece by piece through the real storage classes."""

    def __init__(self, root: RunRoot, tmp_path: Path) -> None:
        self.root = root
        self.tmp_path = tmp_path
        self.writer = ShardWriter(root, RUN_ID)

    def admit(self, admitted: int, records: bool = False) -> None:
        """The scheduler's state; with ``records``, one that keeps admission records (the
        scheduler's own: its shards must then carry them)."""
        state = GateState(admitted=admitted, batch_groups=BATCH_GROUPS, eta=ETA)
        save_gate_state(self.root, state, admissions={} if records else None)

    def shard(self, groups: dict[int, list[int]], admitted_at: dict[int, int] | None = None) -> str:
        """A shard holding group k -> its samples' token versions (one list for every sample);
        with ``admitted_at``, group k's admission record: version = updates = admitted_at[k]."""
        admissions = None if admitted_at is None else {group_id(k): Admission(v, v) for k, v in admitted_at.items()}
        return self.writer.write_groups([
            [
                Sample(f"p{k}", group_id(k), [1, 2], [3] * len(versions), [-0.5] * len(versions), versions, 1.0,
                       "stop", 1.0, 2.0)
                for _ in range(SAMPLES_PER_GROUP)
            ]
            for k, versions in groups.items()
        ], admissions).name  # fmt: skip

    def record(self, step: int, shards: list[str]) -> None:
        """A ledger entry written as the file itself (the Ledger class refuses broken ones)."""
        content = {"format": 1, "step": step, "shards": shards, "recorded_at": 1.0}
        fs.put_atomic_replace(self.root, paths.ledger_entry(step), json.dumps(content).encode())

    def publish(self, version: int, step: int, parent: int | None, shards: list[str]) -> None:
        local = self.tmp_path / f"weights-v{version}-{step}"
        local.mkdir()
        (local / "config.json").write_text("{}")
        (local / "model.safetensors").write_bytes(b"not really tensors")
        lineage = {"version": version, "parent_version": parent, "step": step, "shards": shards}
        (local / LINEAGE_FILE).write_text(json.dumps(lineage))
        WeightStore(self.root).publish(version, local)

    def clean_run(self, records: bool = False) -> tuple[str, str]:
        """4 groups admitted, 2 shards, steps 1 and 2 on versions 1 and 2 (trainer versions 0,
        1); with ``records``, as the scheduler records admissions (each group admitted at its
        oldest token's version)."""
        self.admit(4, records)
        first = self.shard({0: [0, 0], 1: [0, 0]}, {0: 0, 1: 0} if records else None)
        second = self.shard({2: [0, 1], 3: [1, 1]}, {2: 0, 3: 1} if records else None)
        self.publish(0, 0, None, [])
        for step, shard in ((1, first), (2, second)):
            self.record(step, [shard])
            self.publish(step, step, step - 1, [shard])
        return first, second
