"""`asyncrl bench e2e` for real, in its quick setting: a standalone vLLM server, then the
synchronous run and one asynchronous run (each a real `train_run`: vLLM, DeepSpeed,
scheduler, reward pool, MLflow), rollout and trainer pinned to separate CPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli.main import main
from asyncrl.storage.fs import open_root
from asyncrl.storage.shards import ShardReader
from asyncrl.tasks.data.loader import load_prompts

pytestmark = pytest.mark.slow

STEPS, B, N, MAX_NEW = 3, 2, 2, 96


def test_quick_sweep_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    code = main(["bench", "e2e", "--etas", "0,2", "--modes", "recompute", "--work-dir", str(tmp_path / "work"),
                 "--json", str(out), f"trainer.max_steps={STEPS}", f"trainer.batch_groups={B}", f"rollout.n_samples={N}",
                 f"rollout.max_new_tokens={MAX_NEW}"])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0, result["runs"]
    assert "| 0 | sync |" in printed and "| 2 | recompute |" in printed and "ideal overlap bound" in printed

    sync, async_run = result["runs"]
    assert (sync["eta"], async_run["eta"]) == (0, 2)
    for run in (sync, async_run):
        assert run["steps"] == STEPS
        assert 0 < run["wall_s"] < run["train_run_wall_s"]  # the RL phase leaves start-up and shutdown out
        assert run["trained_tokens"] > 0 and run["trained_tokens_per_s"] > 0
        assert sum(run["staleness_counts"].values()) == STEPS * B * N  # every trained sample, once
        assert run["staleness_max"] <= run["eta"] and run["dropped_stale"] == 0
        assert 0 < run["rollout_utilisation"] and 0 <= run["weight_sync_stall_fraction"] < 1
        assert 0 < run["packing_efficiency"] <= 1
        # wall = the wait for the first batch + the steps + the trainer's waits after it
        assert 0 < run["first_batch_wait_s"] < run["wall_s"] and run["trainer_idle_s"] >= -0.01
        assert run["first_batch_wait_s"] + run["training_only_s"] + run["trainer_idle_s"] == pytest.approx(run["wall_s"])
    # Synchronous: generation waits for every step's weights. Asynchronous, the updates the
    # scheduler made are checked against the versions in the shards below (with eta = 2 it may
    # have generated every group before the trainer published anything).
    assert sync["weight_updates"] >= STEPS - 1
    assert sync["staleness_counts"] == {"0": STEPS * B * N}  # synchronous: nothing stale
    assert sync["speedup"] == pytest.approx(1.0)
    assert async_run["speedup"] == pytest.approx(sync["wall_s"] / async_run["wall_s"])

    standalone = result["standalone"]
    assert standalone["t_gen_s"] > 0 and len(standalone["batch_seconds"]) == STEPS
    assert [r["concurrency"] for r in standalone["throughput"]] == [B * N, STEPS * B * N]  # eta 0 and 2 (capped)
    assert result["t_train_s"] == pytest.approx(sync["training_only_s"])
    assert 1.0 <= result["overlap_bound"] <= 2.0
    assert result["ideal_sync_s"] == pytest.approx(standalone["t_gen_s"] + sync["training_only_s"])
    assert sync["limit_s"] == pytest.approx(result["ideal_sync_s"])
    assert sync["t_gen_s"] == pytest.approx(standalone["t_gen_s"])
    at_c = next(r["seconds"] for r in standalone["throughput"] if r["concurrency"] == STEPS * B * N)
    assert async_run["t_gen_s"] == pytest.approx(at_c)  # eta 2: every sample in flight (capped)
    assert async_run["limit_s"] == pytest.approx(max(at_c, async_run["training_only_s"]))
    for run in (sync, async_run):
        assert run["efficiency"] == pytest.approx(run["limit_s"] / run["wall_s"])
        assert run["speedup_over_ideal_sync"] == pytest.approx(result["ideal_sync_s"] / run["wall_s"])
    config = result["config"]  # the base run config: the bench's file with the overrides above
    assert (config["trainer"]["max_steps"], config["rollout"]["n_samples"], config["rollout"]["max_new_tokens"]) == (STEPS, N, MAX_NEW)
    assert config["inference"]["cpu_cores"] != config["trainer"]["cpu_cores"]  # the CPUs split between them

    # The workload: every sample was generated to its prompt's budget (EOS ignored), in both runs.
    budgets = {r.prompt_id: r.max_new_tokens for r in load_prompts(tmp_path / "work" / "data" / "train.parquet")}
    assert max(budgets.values()) == MAX_NEW and min(budgets.values()) < MAX_NEW // 3  # long-tailed
    for name, run in (("bench-e2e-eta0-recompute", sync), ("bench-e2e-eta2-recompute", async_run)):
        reader = ShardReader(open_root(str(tmp_path / "work" / "runs" / name / "store")), name)
        samples = [s for shard in reader.list_shards() for g in reader.read_groups(shard) for s in g]
        assert len(samples) >= STEPS * B * N
        assert all(len(s.output_token_ids) == budgets[s.prompt_id] for s in samples)
        # Every version after the first that generated a token reached the server through an
        # update of its own (the scheduler may skip versions, never merge two).
        assert run["weight_updates"] >= len({v for s in samples for v in s.token_versions}) - 1
