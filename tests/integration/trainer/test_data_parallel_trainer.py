"""The real trainer process, data parallel: two processes under torchrun (then one resumes),
and two nodes on this machine (slow).

Each run trains a few steps on synthetic shards in a local run root; rank 0 alone writes
the ledger, the weights and the metrics; checkpoints carry every rank's optimizer part and
resume at another world size.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from trainer_runs import run_trainer

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.system.network import listen_port
from asyncrl.tasks.system.process_group import kill_group, read_log_tail
from asyncrl.tasks.trainer.checkpoint import complete_checkpoints, read_manifest
from asyncrl.tasks.trainer.metrics import read_jsonl_metrics
from asyncrl.tasks.trainer.process import TrainerLaunch, start_trainer

RUN_ID = "trainer-test"
ZERO_FILES = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}

def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"event"')]


def _shards(root: Any, trajectories: Any, first: int, count: int) -> list[str]:
    writer = ShardWriter(root, RUN_ID)
    # Varied output lengths: the ranks' shares and micro-batch counts differ.
    return [
        writer.write_groups([trajectories.group(f"g{k}", [1.0, 0.0, 0.5, 0.0], output_len=(3, 40))]).name
        for k in range(first, first + count)
    ]


def _config(writer: Callable[..., Path], tmp_path: Path, model: Path, **trainer: Any) -> Path:
    return writer(
        tmp_path / "run.yaml", model=model, store=tmp_path / "store", data=tmp_path / "unused.parquet",
        trainer={"batch_groups": 1, "max_staleness": 100, "zero_stage": 2, **trainer},
    )  # fmt: skip


@pytest.mark.parametrize("zero_stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_two_processes_under_torchrun_then_resume_in_one(
    zero_stage: int, tiny_model_dir: Path, tmp_path: Path, trajectories: Any, run_config_writer: Callable[..., Path]
) -> None:
    """ZeRO 3: every rank takes part in each publish (the weights are gathered), and the
    checkpoint of two ranks is re-partitioned for one."""
    root = open_root(str(tmp_path / "store"))
    shards = _shards(root, trajectories, 0, 3)
    config = _config(run_config_writer, tmp_path, tiny_model_dir, max_steps=3, checkpoint_every=2, zero_stage=zero_stage)
    common = {"work_dir": tmp_path / "work", "metrics_file": tmp_path / "metrics.jsonl", "wait_timeout_s": 60.0}

    log = tmp_path / "two.log"
    assert run_trainer(TrainerLaunch(config, log, nproc=2, **common)) == 0
    events = _events(log)  # printed by rank 0 alone
    assert [e["event"] for e in events] == ["start", "done"]
    assert events[0]["world_size"] == 2 and events[0]["published_initial"] and events[1]["step"] == 3
    assert Ledger(root).steps() == [1, 2, 3]
    assert WeightStore(root).list_versions() == [0, 1, 2, 3]
    records = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]  # one line per step: rank 0 alone logs
    for record in records:
        assert record["optimizer_updates"] == 1 and record["trained_samples"] == 4 and record["loss"] is not None
        assert record["rank_token_imbalance"] >= 1.0
    assert complete_checkpoints(root) == [0, 2]
    manifest = read_manifest(root, 2)
    assert manifest["world_size"] == 2 and ZERO_FILES <= set(manifest["files"])
    assert not [p.name for p in (tmp_path / "work").iterdir() if p.name.startswith("checkpoint-")]

    # One more shard; one process resumes from checkpoint 2 (saved by two) and redoes step 3.
    shards += _shards(root, trajectories, 3, 1)
    log = tmp_path / "one.log"
    assert run_trainer(TrainerLaunch(config, log, overrides=("trainer.max_steps=4",), **common)) == 0
    start = _events(log)[0]
    assert (start["world_size"], start["resumed_from"], start["rolled_back"]) == (1, 2, [3])
    entries = Ledger(root).entries()
    assert [e.step for e in entries] == [1, 2, 3, 4]
    assert [name for e in entries for name in e.shards] == shards
    assert read_manifest(root, 4)["world_size"] == 1
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")][-2:] == [3, 4]


def _run_nodes(
    config: Path, tmp_path: Path, name: str, overrides: tuple[str, ...] = (), timeout_s: float = 300
) -> list[Path]:
    """Two trainer nodes of one process each on this machine, each with its own work
    directory (its "local disk"), meeting at a c10d rendezvous; returns their logs."""
    rendezvous = f"127.0.0.1:{listen_port()}"
    launches = [
        TrainerLaunch(config, tmp_path / f"{name}-node{n}.log", overrides=overrides, nnodes=2, rendezvous=rendezvous,
                      work_dir=tmp_path / f"node{n}", metrics_file=tmp_path / f"metrics-node{n}.jsonl",
                      wait_timeout_s=60.0)  # fmt: skip
        for n in (0, 1)
    ]
    processes = [start_trainer(launch) for launch in launches]
    try:
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        codes = [kill_group(p, 5.0) if p.poll() is None else p.returncode for p in processes]
    logs = [launch.log_path for launch in launches]
    assert codes == [0, 0], "\n".join(f"--- {log.name} ---\n{read_log_tail(log, 40)}" for log in logs)
    return logs


@pytest.mark.slow
def test_two_nodes_upload_their_own_checkpoint_files_and_both_resume(
    tiny_model_dir: Path, tmp_path: Path, trajectories: Any, run_config_writer: Callable[..., Path]
) -> None:
    root = open_root(str(tmp_path / "store"))
    _shards(root, trajectories, 0, 2)
    config = _config(run_config_writer, tmp_path, tiny_model_dir, max_steps=2, checkpoint_every=2)
    logs = _run_nodes(config, tmp_path, "first")
    assert [e["event"] for e in _events(logs[0])] == ["start", "done"] and _events(logs[1]) == []
    # Node 1's local disk held rank 1's optimizer file only: it is in the store because
    # node 1 uploaded it; the manifest (rank 0's) names both nodes' files.
    manifest = read_manifest(root, 2)
    assert manifest["world_size"] == 2 and ZERO_FILES <= set(manifest["files"])
    assert all(fs.exists(root, paths.join(paths.checkpoint_dir(2), name)) for name in manifest["files"])
    assert Ledger(root).steps() == [1, 2] and WeightStore(root).list_versions() == [0, 1, 2]
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "metrics-node0.jsonl")] == [1, 2]
    assert not (tmp_path / "metrics-node1.jsonl").exists()

    # Both nodes download checkpoint 2 to their own disk and go on.
    _shards(root, trajectories, 2, 1)
    logs = _run_nodes(config, tmp_path, "second", overrides=("trainer.max_steps=3",))
    start = _events(logs[0])[0]
    assert (start["resumed_from"], start["world_size"]) == (2, 2)
    assert Ledger(root).steps() == [1, 2, 3] and WeightStore(root).list_versions()[-1] == 3


@pytest.mark.slow
def test_sft_mode_under_torchrun_publishes_one_version_and_logs_once(
    tiny_model_dir: Path, tmp_path: Path, run_config_writer: Callable[..., Path]
) -> None:
    from asyncrl.tasks.data.synthetic import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "train.parquet", n=8, seed=4)
    config = run_config_writer(tmp_path / "run.yaml", model=tiny_model_dir, store=tmp_path / "store", data=data,
                               trainer={"processes": 2})  # fmt: skip
    log = tmp_path / "sft.log"
    launch = TrainerLaunch(config, log, mode="sft", nproc=2, work_dir=tmp_path / "work", metrics_file=tmp_path / "sft.jsonl",
                           overrides=("pipeline.sft_steps=2", "pipeline.sft_batch_size=4"))  # fmt: skip
    assert run_trainer(launch) == 0
    assert [e["event"] for e in _events(log)] == ["done"]
    assert WeightStore(open_root(str(tmp_path / "store"))).list_versions() == [0]
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "sft.jsonl")] == [1, 2]
