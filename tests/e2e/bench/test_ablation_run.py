"""`asyncrl bench ablation` for real in a tiny setting: the pipeline's inputs and a short
SFT warm start once, then one staleness bound with both objectives (each a real `train_run`
and the pipeline's vLLM evaluation), the table, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from asyncrl.cli.main import main
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore

pytestmark = pytest.mark.slow

STEPS = 2


def test_one_eta_both_objectives_from_one_warm_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "name": "abl",
        "work_dir": str(tmp_path / "runs"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "data" / "train.parquet"),
                 "eval_path": str(tmp_path / "data" / "heldout.parquet"), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1},
        "trainer": {"batch_groups": 2, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": STEPS},
        "reward": {"pool": {"workers": 1}},
        "pipeline": {"init_tiny_model": True, "sft_steps": 3, "sft_batch_size": 8, "eval_samples": 1, "eval_prompts": 4,
                     "synthetic_data": {"n_train": 32, "n_heldout": 4, "max_steps": 2}},
        "storage": {"root": str(tmp_path / "unused-store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'unused.db'}"},
    }  # fmt: skip
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(config))
    work, png, out = tmp_path / "work", tmp_path / "curves.png", tmp_path / "abl.json"
    code = main(["bench", "ablation", str(path), "--etas", "1", "--eval-every", "1",
                 "--work-dir", str(work), "--png", str(png), "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0, result["runs"]
    assert "| 1 | decoupled |" in printed and "| 1 | standard |" in printed

    warm = WeightStore(open_root(str(work / "runs" / "abl-ablation-base" / "store"))).list_versions()
    assert warm == [0]  # the SFT warm start, published once for both runs
    for run, objective in zip(result["runs"], ("decoupled", "standard"), strict=True):
        assert (run["eta"], run["objective"], run["steps"]) == (1, objective, STEPS)
        assert [step for step, _ in run["pass_at_1_curve"]] == list(range(STEPS + 1))  # every version evaluated
        assert all(0.0 <= value <= 1.0 for _, value in run["pass_at_1_curve"])
        # A step trains whole shards: at least B groups of n samples each.
        assert run["staleness_max"] <= 1 and sum(run["staleness_counts"].values()) >= STEPS * 2 * 2
        store = WeightStore(open_root(str(work / "runs" / f"abl-eta1-{objective}" / "store")))
        assert store.list_versions() == list(range(STEPS + 1))
    assert png.read_bytes()[:4] == b"\x89PNG"
