"""A short pipeline end to end, as the Prefect flow users run: tiny model, synthetic
task, SFT warm start, asynchronous RL on a real vLLM server and DeepSpeed, evaluation,
MLflow registration, with the run root on a real S3 server (SeaweedFS); held-out pass@1 is
also evaluated during training (every version, by the evaluator component) and shows as an
MLflow curve, in the RL report and in the summary. The Prefect server holds one run per
stage and per component; a second run of the same config takes data, model, SFT and
evaluation from the cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ports import restartable_base_port
import s3_servers
from prefect_runs import latest_artifacts, run_records_text, run_tree
import mlflow
import yaml
from mlflow import MlflowClient

from asyncrl.configs.loading import config_from_dict
from asyncrl.flows.pipeline import SUMMARY_FILE, pipeline
from asyncrl.storage import fs, paths
from asyncrl.storage.evaluations import EvaluationStore
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.shards import ShardReader
from asyncrl.storage.weights import WeightStore

pytestmark = pytest.mark.slow

RUN = "e2e"
API_KEY = "e2e-canary-api-key-5b21"
STEPS = 2
B = 2


def e2e_config(tmp_path: Path, root_uri: str, options: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": RUN,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {
            "train_path": str(tmp_path / "data" / "train.parquet"),
            "eval_path": str(tmp_path / "data" / "heldout.parquet"),
            "max_prompt_tokens": 64,
        },
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "shard_groups": B, "shard_seconds": 2.0},
        "inference": {"api_key": API_KEY, "base_port": restartable_base_port()},
        "trainer": {"batch_groups": B, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": 1,
                    "optimizer": {"lr": 1.0e-4}},
        "pipeline": {"init_tiny_model": True, "synthetic_data": {"n_train": 64, "n_heldout": 6},
                     "sft_steps": 2, "sft_batch_size": 4, "eval_samples": 2, "registered_model": "e2e-policy",
                     # nice 0: a loaded test machine starved a nice 10 server for minutes
                     "eval_every": 1, "training_eval": {"prompts": 3, "samples": 2, "nice": 0}},
        "storage": {"root": root_uri, "options": options},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "e2e"},
    }


def stored_text(root: Any) -> str:  # noqa: ANN401 - a RunRoot
    """Every object of the run root but weights, shards and checkpoints' tensors, concatenated."""
    binary = (".arrow", ".safetensors", ".bin", ".pt", ".pkl")
    names = [p for p in root.fs.find(root.path) if not p.endswith(binary)]
    return "\n".join(root.fs.cat_file(name).decode(errors="replace") for name in names)


def test_pipeline_on_seaweedfs(
    prefect_server: None, seaweedfs_endpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    bucket = s3_servers.create_bucket(seaweedfs_endpoint)
    options = {"endpoint_url": seaweedfs_endpoint.url}  # credentials: the environment's
    config = config_from_dict(e2e_config(tmp_path, f"s3://{bucket}/{RUN}", options))

    state = pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()

    root = open_root(config.storage.root, options)
    # weights: v0 = the SFT warm start, then one version per RL step
    assert WeightStore(root).list_versions() == list(range(STEPS + 1))
    assert summary["final_version"] == STEPS and summary["steps"] == STEPS
    # ledger: every step recorded once, no shard twice, each recorded shard readable
    entries = Ledger(root).entries()
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    recorded = [s for e in entries for s in e.shards]
    assert len(recorded) == len(set(recorded))
    reader = ShardReader(root, RUN)
    groups = [g for name in recorded for g in reader.read_groups(name)]
    assert len(groups) >= STEPS * B
    group_ids = [g[0].group_id for g in groups]
    assert len(group_ids) == len(set(group_ids))
    for group in groups:
        for sample in group:
            assert len(sample.output_token_ids) == len(sample.behaviour_logprobs) == len(sample.token_versions)
    # summary.json in the run root and the figures
    stored = json.loads(fs.read_bytes(root, SUMMARY_FILE))
    assert stored["mlflow_run_id"] == summary["mlflow_run_id"]
    assert 0.0 <= stored["pass_at_1_before"] <= 1.0 and 0.0 <= stored["pass_at_1_after"] <= 1.0

    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri, registry_uri=config.tracking.mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    by_version = {int(m.tags["asyncrl.version"]): m for m in models}
    assert sorted(by_version) == list(range(STEPS + 1))
    for step, entry in enumerate(entries, start=1):
        trained_on = by_version[step].tags["asyncrl.trained_on"].split(",")
        assert trained_on == list(entry.shards)
    # the prompt dataset is the run's input; each version's shards are one manifest artifact
    inputs = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert "train.parquet" in inputs and not set(recorded) & inputs
    final = mlflow.artifacts.load_dict(f"{by_version[STEPS].artifact_location}/{by_version[STEPS].tags['asyncrl.lineage_artifact']}")
    assert [shard["name"] for shard in final["shards"]] == list(entries[-1].shards) and final["step"] == STEPS
    assert [d["name"] for d in final["datasets"]] == ["train.parquet"]
    assert "trainer.batch_groups" in run.data.params
    registered = client.get_model_version_by_alias("e2e-policy", "best")
    assert int(registered.tags["asyncrl.version"]) == summary["best_version"]
    # The run a person reads: frozen config, plots, summary, system metrics; eval on the models.
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "plots")}  # fmt: skip
    assert {"config.yaml", "summary.json", "plots/reward.png", "plots/pass_at_1.png", "plots/staleness.png"} <= artifacts
    assert "system/cpu_utilization_percentage" in client.get_run(run.info.run_id).data.metrics
    # (the SQL registry keeps no model id on a version: the version's tag names its LoggedModel)
    assert "eval_pass_at_1" in {m.key for m in client.get_logged_model(registered.tags["asyncrl.model_id"]).metrics}
    # Evaluation during training: one record per evaluated version (the last step's always: the
    # run waits for it), each an MLflow point at step = version, listed in the summary.
    evaluated = EvaluationStore(root).versions()
    assert STEPS in evaluated and set(evaluated) <= set(range(STEPS + 1)), evaluated
    curve = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_at_1")}
    assert sorted(curve) == evaluated
    assert {m.step for m in client.get_metric_history(run.info.run_id, "eval/pass_at_1/math")} == set(evaluated)
    assert {int(v): p for v, p in stored["pass_at_1_during_training"].items()} == curve
    # The registered version loads through MLflow and generates.
    mlflow.set_tracking_uri(config.tracking.mlflow_uri)
    try:
        generator = mlflow.transformers.load_model("models:/e2e-policy@best")
        assert generator("1+2=", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("1+2=")
    finally:
        mlflow.set_tracking_uri(None)

    # the Prefect UI's artifacts: RL progress at 100 %, the reward-curve report, the summary
    artifacts = latest_artifacts([f"{RUN}-rl-progress", f"{RUN}-rl-report", f"{RUN}-summary"])
    assert artifacts[f"{RUN}-rl-progress"].type == "progress" and artifacts[f"{RUN}-rl-progress"].data == 100.0
    report = artifacts[f"{RUN}-rl-report"].data
    assert "Reward curve" in report and f"| steps | {STEPS} |" in report
    assert "## Held-out pass@1 during training" in report
    assert all(f"| {v} | {100 * curve[v]:.1f}% |" in report for v in evaluated), report
    assert f"{100 * stored['pass_at_1_after']:.1f}%" in artifacts[f"{RUN}-summary"].data

    # Secrets (the servers' API key from the config, the store's secret key from the
    # environment) reach no place that shows or keeps the run: Prefect's parameters, logs and
    # artifacts, MLflow, the run root, the local logs; the frozen config keeps the endpoint.
    frozen = yaml.safe_load(fs.read_bytes(root, paths.CONFIG))
    assert frozen["storage"]["options"]["endpoint_url"] == options["endpoint_url"]
    places = {
        "prefect": run_records_text(state.state_details.flow_run_id),
        "mlflow": json.dumps([run.data.params, run.data.tags, [m.tags for m in models]])
        + "".join(Path(client.download_artifacts(run.info.run_id, name, str(tmp_path / "mlflow-artifacts"))).read_text()
                  for name in ("config.yaml", "summary.json")),
        "run root": stored_text(root),
        "local logs": "\n".join(p.read_text(errors="replace") for p in (tmp_path / "work").rglob("*.log")),
    }
    for secret in (API_KEY, seaweedfs_endpoint.secret):
        leaked = [place for place, text in places.items() if secret in text]
        assert not leaked, f"secret found in {leaked}"

    # One Prefect run per stage and per component, read back from the server.
    tree = run_tree(state.state_details.flow_run_id)
    stages = ["prepare-data", "init-model", "sft", "evaluate", "register"]
    components = ["rollout-server-0", "reward-service", "trainer", "scheduler", "evaluator"]
    assert all(tree.get(name) == "Completed" for name in stages + components), tree
    assert tree[f"flow:{RUN}-train"] == "Completed" and tree[f"flow:{RUN}-scheduler"] == "Completed", tree
    assert summary["stages"] == {"prepare-data": "run", "init-model": "run", "sft": "run", "evaluate": "run"}
    assert summary["restarts"] == {name: 0 for name in components}

    # The same config again: nothing is computed twice; the MLflow record is the same run.
    again = pipeline(config, return_state=True)
    assert again.is_completed(), again.message
    second = again.result()
    print(f"\npipeline wall time: first run {summary['wall_s']:.0f} s, second run {second['wall_s']:.0f} s")
    assert second["stages"] == {"prepare-data": "cached", "init-model": "cached", "sft": "cached", "evaluate": "cached"}
    assert run_tree(again.state_details.flow_run_id)["sft"] == "Cached"
    assert second["mlflow_run_id"] == summary["mlflow_run_id"] and second["final_version"] == STEPS
    assert second["pass_at_1_after"] == summary["pass_at_1_after"]
    assert second["pass_at_1_during_training"] == summary["pass_at_1_during_training"]
    assert len(client.get_metric_history(run.info.run_id, "eval/pass_at_1")) == len(evaluated)  # not logged twice
    assert [e.step for e in Ledger(root).entries()] == list(range(1, STEPS + 1))  # nothing trained twice
    assert len(client.search_logged_models(experiment_ids=[run.info.experiment_id])) == STEPS + 1
