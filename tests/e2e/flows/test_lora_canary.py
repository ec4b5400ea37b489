"""The run's own mismatch canary catches a LoRA delivery that goes wrong without an error.

A LoRA run's servers get each version through the project's delivery path: the scheduler's
loader has each server's worker fetch the published adapter into the run's weight cache
(``work_dir/weights-cache``), load it as a vLLM adapter and check its fingerprint against the
files. A cache entry is trusted once written, so a cache left by an earlier run on the same
storage root (its outputs deleted, not its cache) is served under the new run's version
names: every check passes, the servers sample another policy, and only the train/inference
mismatch shows it. Here such a cache is made by the product's own fetch from an earlier
publish; the `train` flow then runs for real (vLLM with LoRA, DeepSpeed, the scheduler) and
its canary, not one built in the test, must raise the Prefect event and the run's warning.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest
from lora_adapter_builder import write_adapter
from ports import restartable_base_port
from prefect_runs import read_events

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.synthetic import write_synthetic_splits
from asyncrl.tasks.launch.canary import EVENT as CANARY_EVENT
from asyncrl.tasks.model.weight_fetch import fetch_weight_version
from asyncrl.tasks.system.run_paths import run_paths

pytestmark = pytest.mark.slow

STEPS = 4
RANK, ALPHA = 8, 16


def lora_config(tmp_path: Path, model_dir: Path, name: str) -> RunConfig:
    splits = write_synthetic_splits(tmp_path / "data", n_train=64, n_heldout=4, seed=0)
    return RunConfig.model_validate({
        "name": name,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(splits["train"]), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "interrupt_mode": "keep", "shard_groups": 1},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": 2, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": STEPS + 1,
                    "zero_stage": 0, "optimizer": {"lr": 1.0e-3}, "lora": {"rank": RANK, "alpha": ALPHA}},
        "reward": {"pool": {"workers": 1}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name,
                     "mismatch_canary": {"min_tokens": 8}},
    })  # fmt: skip


def leave_a_stale_cache(config: RunConfig, model_dir: Path, scratch: Path) -> None:
    """What an earlier run on the same storage root leaves once its store is deleted: its
    versions (other adapters than this run will train) in the run's weight cache, fetched
    there by the servers' own fetch."""
    cache = run_paths(config).work_dir / "weights-cache"
    store = WeightStore(open_root(config.storage.root))
    for version in range(STEPS + 1):
        adapter = write_adapter(model_dir, scratch / f"v{version}", seed=100 + version, rank=RANK, alpha=ALPHA, b_std=0.5)
        store.publish(version, adapter)
        fetch_weight_version(config.storage.root, dict(config.storage.options), version, cache)
    shutil.rmtree(config.storage.root)


def test_a_stale_adapter_cache_is_served_silently_and_the_runs_canary_trips(
    prefect_server: None, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrl.flows.train import train

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    name = "lora-canary"
    config = lora_config(tmp_path, tiny_model_dir, name)
    leave_a_stale_cache(config, tiny_model_dir, tmp_path / "earlier-run")
    since = datetime.now(timezone.utc)

    state = train(config, return_state=True)

    assert state.is_completed(), state.message  # the canary warns; it does not stop the run
    assert state.result()["steps"] == STEPS
    (event, *_) = read_events(CANARY_EVENT, f"asyncrl.run.{name}", since, 1)
    crossed = event.payload["crossed"]
    assert "mismatch/abs_logp_diff_mean" in crossed, event.payload
    assert crossed["mismatch/abs_logp_diff_mean"]["value"] > crossed["mismatch/abs_logp_diff_mean"]["threshold"]
    assert 1 <= event.payload["step"] <= STEPS
    (metrics_file,) = (tmp_path / "work").rglob("trainer-metrics.jsonl")
    figures = {r["step"]: r for r in map(json.loads, metrics_file.read_text().splitlines())}
    assert figures[event.payload["step"]]["mismatch/abs_logp_diff_mean"] == crossed["mismatch/abs_logp_diff_mean"]["value"]
