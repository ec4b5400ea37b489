"""A short mixed math + code run end to end on the real stack: a mixture file of synthetic
arithmetic and synthetic code prompts, vLLM rollout, the reward service scoring code in the
bubblewrap sandbox and math with math-verify, DeepSpeed training, evaluation per task.

The tiny model is untrained (no warm start), so rewards are mostly 0; what is checked is
where each sample went and that every figure exists per task: the shards' task column,
the scheduler's reasons per task (code answers ran in the sandbox: a crash or wrong answer,
never a sandbox or request failure), the trainer's per-task metrics in MLflow, and
pass@1 / pass@2 per task in summary.json and the Prefect summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ports import restartable_base_port
import yaml
from mlflow import MlflowClient

from asyncrl.configs.loading import config_from_dict
from asyncrl.flows.pipeline import SUMMARY_FILE, pipeline
from asyncrl.storage import fs
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardReader
from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, write_problems
from asyncrl.tasks.data.synthetic_code import make_code_dataset, write_code_problems
from asyncrl.tasks.scheduler.cycle_stats import CYCLE_STATS_FILE, combine_cycle_stats, read_cycle_stats

pytestmark = pytest.mark.slow

RUN = "mixed"
STEPS = 2
B = 4


def write_mixture(data: Path, name: str, n: int, seed: int) -> Path:
    """``name``.yaml mixing n arithmetic and n code problems with equal weights."""
    math_path = write_problems(data / f"{name}-math.parquet", make_arithmetic_dataset(n, seed))
    code_path = write_code_problems(data / f"{name}-code.parquet", make_code_dataset(n, seed))
    mixture = {"seed": seed, "sources": [{"path": math_path.name, "weight": 1.0}, {"path": code_path.name, "weight": 1.0}]}
    path = data / f"{name}.yaml"
    path.write_text(yaml.safe_dump(mixture))
    return path


def test_a_mixed_math_and_code_run_routes_and_reports_per_task(prefect_server: None, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    train, heldout = write_mixture(data, "train", 32, seed=1), write_mixture(data, "heldout", 3, seed=2)
    config = config_from_dict({
        "name": RUN,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(train), "eval_path": str(heldout), "max_prompt_tokens": 96},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "shard_groups": B, "shard_seconds": 2.0},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": B, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": 2},
        "reward": {"code": {"extract": "whole"}},  # every answer is a program: the sandbox runs each one
        "pipeline": {"init_tiny_model": True, "eval_samples": 2, "registered_model": "mixed-policy"},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "mixed", "pass_k": [2]},
    })  # fmt: skip

    state = pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()

    root = open_root(config.storage.root)
    recorded = [s for e in Ledger(root).entries() for s in e.shards]
    reader = ShardReader(root, RUN)
    tasks = {sample.task for name in recorded for group in reader.read_groups(name) for sample in group}
    assert tasks == {"math", "code"}

    rollout = combine_cycle_stats(read_cycle_stats(tmp_path / "work" / RUN / CYCLE_STATS_FILE))
    assert rollout["samples/math"] > 0 and rollout["samples/code"] > 0
    code_reasons = {key.split("/")[2] for key in rollout if key.startswith("reasons/code/")}
    assert code_reasons and code_reasons <= {"ok", "wrong_answer", "crash", "timeout", "output_limit", "no_answer"}
    assert code_reasons & {"ok", "wrong_answer", "crash", "timeout", "output_limit"}  # programs ran in the sandbox
    assert not {key for key in rollout if key.startswith("reasons/") and key.endswith(("bad_request", "sandbox_unavailable"))}

    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    logged = set(run.data.metrics)
    assert {"reward_mean/math", "reward_mean/code", "pass_at_1/code", "pass_at_2/math"} <= logged, sorted(logged)

    stored = json.loads(fs.read_bytes(root, SUMMARY_FILE))
    for when in ("by_task_before", "by_task_after"):
        figures = stored[when]
        assert {f"pass_at_{k}/{task}" for k in (1, 2) for task in ("math", "code")} <= set(figures), figures
        assert figures["prompts/code"] == 3 and figures["prompts/math"] == 3
        assert all(0.0 <= value <= 1.0 for name, value in figures.items() if name.startswith("pass_at_"))
