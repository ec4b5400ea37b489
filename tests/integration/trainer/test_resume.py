"""Exact resume: a real trainer process is killed with SIGKILL mid-run and restarted."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from trainer_runs import run_trainer

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.trainer.checkpoint import complete_checkpoints
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.tasks.trainer.metrics import read_jsonl_metrics
from asyncrl.tasks.trainer.process import TrainerLaunch, start_trainer
from asyncrl.tasks.system.process_group import group_alive

RUN_ID = "trainer-test"
STEPS = 6


def _events(log: Path) -> list[dict[str, Any]]:
    events = []
    for line in log.read_text().splitlines():
        if line.startswith('{"event"'):
            events.append(json.loads(line))
    return events


def _weights(store: WeightStore, version: int, into: Path) -> dict[str, torch.Tensor]:
    local = store.download(version, into / f"v{version}")
    return {k: v for f in sorted(local.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_kill_9_mid_run_then_resume_trains_every_shard_exactly_once(
    tiny_model_dir: Path, tmp_path: Path, trajectories: Any, run_config_writer: Callable[..., Path]
) -> None:
    store_dir = tmp_path / "store"
    root = open_root(str(store_dir))
    writer = ShardWriter(root, RUN_ID)
    shards = [writer.write_groups([trajectories.group(f"g{k}", [1.0, 0.0, 0.5])]).name for k in range(STEPS - 1)]
    config = run_config_writer(
        tmp_path / "run.yaml",
        model=tiny_model_dir,
        store=store_dir,
        data=tmp_path / "unused.parquet",
        # The resumed trainer keeps the last label published before the kill (4, or 5 if the
        # kill lands late), but staleness counts steps, so the redone step 4 sees the v0
        # samples as stale as run 1 did (3 steps); a bound that drops nothing in either run
        # keeps the two step-4 updates equal whatever the staleness rule.
        trainer={"batch_groups": 1, "max_steps": STEPS, "checkpoint_every": 3, "max_staleness": 2 * STEPS},
    )
    common = {"work_dir": tmp_path / "work", "metrics_file": tmp_path / "metrics.jsonl"}
    store, ledger = WeightStore(root), Ledger(root)

    # Run 1: five shards for six steps, so it cannot finish; kill -9 once version 4 is out.
    first = start_trainer(TrainerLaunch(config, tmp_path / "run1.log", **common))
    deadline = time.monotonic() + 240
    while (store.latest() or 0) < 4:
        assert first.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "trainer did not reach version 4"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert not group_alive(first.pid)

    killed_steps = ledger.steps()
    killed_versions = store.list_versions()
    assert killed_steps[:4] == [1, 2, 3, 4] and complete_checkpoints(root)[-1] == 3
    assert killed_versions[:5] == [0, 1, 2, 3, 4]
    lost_versions = {v: _weights(store, v, tmp_path / "before") for v in (3, 4)}

    # Run 2: the sixth shard arrives; the restarted trainer resumes and finishes.
    shards.append(writer.write_groups([trajectories.group("g5", [0.0, 1.0, 1.0])]).name)
    assert run_trainer(TrainerLaunch(config, tmp_path / "run2.log", **common)) == 0

    start = _events(tmp_path / "run2.log")[0]
    assert start["resumed_from"] == 3 and start["step"] == 3
    assert start["rolled_back"] == [s for s in killed_steps if s > 3]
    assert start["version"] == killed_versions[-1]

    entries = ledger.entries()
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    consumed = [name for e in entries for name in e.shards]
    assert consumed == shards  # each shard exactly once, oldest first, none lost
    assert ShardReader(root, RUN_ID).list_unconsumed(set(consumed)) == []

    versions = store.list_versions()
    resumed = [v for v in versions if v > killed_versions[-1]]
    assert versions == list(range(versions[-1] + 1)) and len(resumed) == STEPS - 3  # monotone, no gap
    lineage = [json.loads((store.download(v, tmp_path / f"l{v}") / LINEAGE_FILE).read_text()) for v in resumed]
    assert [entry["step"] for entry in lineage] == [4, 5, 6]
    # Its first version is a child of checkpoint 3's version, the weights it resumed from (not
    # of the newest label, whose weights were trained further on the discarded branch).
    assert lineage[0]["parent_version"] == 3 and [e["parent_version"] for e in lineage[1:]] == resumed[:-1]
    assert [entry["shards"] for entry in lineage] == [[name] for name in shards[3:]]
    assert complete_checkpoints(root)[-1] == STEPS

    # Exact resume: step 4 redone from checkpoint 3 on the same shard gives run 1's step-4 weights.
    redone = _weights(store, resumed[0], tmp_path / "after")
    assert redone.keys() == lost_versions[4].keys()
    assert max(float((redone[k] - lost_versions[4][k]).abs().max()) for k in redone) < 1e-6
    assert max(float((redone[k] - lost_versions[3][k]).abs().max()) for k in redone) > 1e-5

    steps_logged = [r["step"] for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")]
    assert steps_logged[-3:] == [4, 5, 6]
    assert not fs.list_dir(root, paths.QUARANTINE_DIR)
