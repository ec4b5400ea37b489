"""Adaptive staleness on the real stack: a short RL run (tiny model, vLLM server, DeepSpeed
trainer, reward pool, MLflow) whose drift budget any drift crosses. The scheduler reads each
version's figures from its lineage and lowers the bound (logged in its log, the run's MLflow
metric and its figures), and the staleness rule holds for every trained sample: nothing is
staler than the configured eta, nothing is dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from ports import restartable_base_port

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.launch.bound_watch import METRIC
from asyncrl.tasks.launch.rl import train_run

pytestmark = pytest.mark.slow

STEPS, ETA, B = 6, 2, 2


PLUGIN = """
def score(response, reference, **metadata):
    # a reward the untrained tiny model's outputs vary on: the policy moves every step
    return float(sum(ch in "aeiou" for ch in response) % 2)
"""


def test_an_over_budget_run_lowers_its_bound_and_keeps_the_rule(tmp_path: Path, tiny_model_dir: Path) -> None:
    plugin = tmp_path / "vowels.py"
    plugin.write_text(PLUGIN)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Write {k} words:", "task": "vowels"}) + "\n" for k in range(32)))
    config = RunConfig.model_validate({
        "name": "adaptive",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_path": str(train), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 4, "max_new_tokens": 24, "eta": ETA, "shard_groups": B, "shard_seconds": 2.0,
                    # any drift is over this budget, and the bound never comes back up
                    "adaptive_staleness": {"max_behav_weight_p99": 1.000001, "recover_steps": 1000}},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": B, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": STEPS,
                    "optimizer": {"lr": 1.0e-3}},
        "reward": {"pool": {"workers": 1}, "plugins": {"vowels": {"function": f"{plugin}:score"}}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "adaptive"},
    })  # fmt: skip
    result = train_run(config)

    assert result.steps == STEPS
    figures = result.scheduler
    assert figures["eta_changes"] >= 1 and figures["effective_eta_min"] < ETA, figures
    assert figures["drift_readings"] >= 1
    log = (config.run_work_dir / "logs" / "scheduler.log").read_text()
    assert f"effective staleness bound lowered {ETA} -> {ETA // 2}" in log, log[-3000:]
    # the rule: every trained sample within the configured eta, none dropped
    stale = {int(k.rsplit("_", 1)[1]) for m in result.step_metrics.values() for k, v in m.items()
             if k.startswith("staleness/count_") and v}  # fmt: skip
    assert stale and max(stale) <= ETA
    assert sum(m.get("dropped_stale", 0.0) for m in result.step_metrics.values()) == 0
    # the run's record: one MLflow point per change the flow saw, below eta
    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri)
    points = client.get_metric_history(result.mlflow_run_id, METRIC)
    assert points and all(p.value < ETA for p in points)
    assert client.get_run(result.mlflow_run_id).data.metrics["rollout_effective_eta_min"] == figures["effective_eta_min"]
