"""`asyncrl bench time-to-accuracy` and `asyncrl bench ablation` for real in a tiny setting, from
one warm start (the pipeline's inputs and a short SFT, made once): the synchronous run and one
asynchronous arm (each a real `train_run`), the saved versions of both evaluated afterwards on
one vLLM server, the JSON, PNG and MLflow run; then one staleness bound with standard PPO, the
ablation's table, JSON and PNG. `asyncrl bench learning` runs the same arms
(tests/unit/bench/test_time_to_accuracy_units.py checks its command around them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ports import restartable_base_port
import yaml

from asyncrl.cli.main import main
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore

pytestmark = pytest.mark.slow

STEPS = 2


def tiny_config(tmp_path: Path) -> Path:
    config = {
        "name": "t2a",
        "work_dir": str(tmp_path / "runs"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "data" / "train.parquet"),
                 "eval_path": str(tmp_path / "data" / "heldout.parquet"),
                 "sft_path": str(tmp_path / "data" / "sft.parquet"), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 48, "eta": 1},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": 2, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": STEPS},
        "reward": {"pool": {"workers": 1}},
        "pipeline": {"init_tiny_model": True, "sft_steps": 3, "sft_batch_size": 8, "eval_samples": 1, "eval_prompts": 4,
                     "synthetic_data": {"n_train": 32, "n_heldout": 4, "n_sft": 16, "max_steps": 2,
                                        "solution_style": "worked", "sft_answer_only_share": 0.5}},
        "storage": {"root": str(tmp_path / "unused-store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'unused.db'}"},
    }  # fmt: skip
    path = tmp_path / "t2a.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_sync_and_one_async_arm_from_one_warm_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow import MlflowClient

    path = tiny_config(tmp_path)
    work, png, out = tmp_path / "work", tmp_path / "t2a.png", tmp_path / "t2a.json"
    code = main(["bench", "time-to-accuracy", str(path), "--etas", "0,1", "--modes", "keep", "--seeds", "0",
                 "--eval-every", "1", "--smooth", "1", "--work-dir", str(work), "--png", str(png), "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0
    assert "| sync |" in printed and "| eta1-keep |" in printed and "best asynchronous arm: eta1-keep" in printed
    for key in ("time_to_target_speedup", "equal_steps_gap_points", "target_pass_at_1", "sync_generation_share"):
        assert key in result
    assert [arm["label"] for arm in result["arms"]] == ["sync", "eta1-keep"]
    for arm in result["arms"]:
        curve = arm["curve"]
        assert curve["versions"] == list(range(STEPS + 1))  # every version evaluated, the start once for all
        assert curve["pass_at_1"][0] == result["start_pass_at_1"] and curve["wall_s"][0] == 0.0
        assert curve["wall_s"] == sorted(curve["wall_s"]) and curve["wall_s"][-1] > 0
        assert all(0.0 <= value <= 1.0 for value in curve["pass_at_1"])
        assert sum(arm["staleness_counts"].values()) >= STEPS * 2 * 2 and max(map(int, arm["staleness_counts"])) <= arm["eta"]
        overlap = arm["overlap_per_seed"][0]
        assert overlap["generation_busy_s"] > 0 and overlap["training_busy_s"] > 0 and overlap["overlap_factor"] > 0
        store = WeightStore(open_root(str(work / "runs" / f"t2a-{arm['label']}-seed0" / "store")))
        assert store.list_versions() == list(range(STEPS + 1))  # every version kept for the evaluation
    warm = WeightStore(open_root(str(work / "runs" / "t2a-ablation-base" / "store"))).list_versions()
    assert warm == [0]  # the SFT warm start, published once for both arms
    assert png.read_bytes()[:4] == b"\x89PNG"
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["asyncrl.bench"] == "time-to-accuracy"
    assert len(client.get_metric_history(run.info.run_id, "pass_at_1_by_wall_s/sync")) == STEPS + 1
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "time-to-accuracy")}
    assert artifacts == {"time-to-accuracy/t2a.json", "time-to-accuracy/t2a.png"}

    sft_metrics = work / "runs" / "t2a-ablation-base" / "sft-metrics.jsonl"
    sft_written = sft_metrics.stat().st_mtime_ns

    # The ablation from the same warm start: one bound, the objective the arms above did not
    # train with (standard PPO), every version evaluated.
    png, out = tmp_path / "curves.png", tmp_path / "abl.json"
    code = main(["bench", "ablation", str(path), "--etas", "1", "--objectives", "standard", "--eval-every", "1",
                 "--work-dir", str(work), "--png", str(png), "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0, result["runs"]
    assert "| 1 | standard |" in printed and "| 1 | decoupled |" not in printed
    assert sft_metrics.stat().st_mtime_ns == sft_written  # the warm start, made once for every bench
    for run, objective in zip(result["runs"], ("standard",), strict=True):
        assert (run["eta"], run["objective"], run["steps"]) == (1, objective, STEPS)
        assert [step for step, _ in run["pass_at_1_curve"]] == list(range(STEPS + 1))  # every version evaluated
        assert all(0.0 <= value <= 1.0 for _, value in run["pass_at_1_curve"])
        # A step trains whole shards: at least B groups of n samples each.
        assert run["staleness_max"] <= 1 and sum(run["staleness_counts"].values()) >= STEPS * 2 * 2
        store = WeightStore(open_root(str(work / "runs" / f"t2a-eta1-{objective}" / "store")))
        assert store.list_versions() == list(range(STEPS + 1))
    assert png.read_bytes()[:4] == b"\x89PNG"
