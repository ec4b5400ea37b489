"""A LoRA run end to end (``trainer.lora``), as the Prefect flow users run: tiny model,
synthetic task, SFT warm start and asynchronous RL of adapters (``keep`` mode), the rollout
servers and the evaluator's server loading every version as a vLLM LoRA adapter, evaluation,
and registration of the adapter with its merged model, which loads through MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from ports import restartable_base_port
from mlflow import MlflowClient

from asyncrl.configs.loading import config_from_dict
from asyncrl.flows.pipeline import pipeline
from asyncrl.storage.evaluations import EvaluationStore
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.model.lora_adapter import is_adapter_dir
from asyncrl.tasks.tracking.mlflow_run import BASE_MODEL_TAG

pytestmark = pytest.mark.slow

STEPS = 3


def test_a_lora_pipeline_trains_serves_evaluates_and_registers_adapters(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns: not the checkout's
    config = config_from_dict({
        "name": "lora-e2e",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "data" / "train.parquet"),
                 "eval_path": str(tmp_path / "data" / "heldout.parquet"), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "interrupt_mode": "keep"},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": 2, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": 2,
                    "zero_stage": 0, "optimizer": {"lr": 1.0e-3}, "lora": {"rank": 8, "alpha": 16}},
        "pipeline": {"init_tiny_model": True, "synthetic_data": {"n_train": 64, "n_heldout": 6},
                     "sft_steps": 2, "sft_batch_size": 4, "eval_samples": 2, "registered_model": "lora-e2e-policy",
                     "eval_every": 1, "training_eval": {"prompts": 3, "samples": 2, "nice": 0}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "lora-e2e"},
    }, source="test")  # fmt: skip

    state = pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["steps"] == STEPS

    # Every version, the SFT warm start's included, is an adapter: no base weights moved.
    store = WeightStore(open_root(config.storage.root))
    for version in store.list_versions():
        local = store.download(version, tmp_path / "versions" / f"v{version}")
        assert is_adapter_dir(local) and not list(local.glob("model*.safetensors")), version
    # The servers sampled with the trainer's adapters: trainer and server log-probs of the
    # current version's tokens agree to float32 numerics.
    (metrics_file,) = (tmp_path / "work").rglob("trainer-metrics.jsonl")
    figures = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    checked = [r["mismatch/abs_logp_diff_mean"] for r in figures if r.get("mismatch/current_version_tokens")]
    assert all(value < 1e-4 for value in checked), checked
    # The evaluator's server loaded versions as adapters too.
    assert STEPS in EvaluationStore(open_root(config.storage.root)).versions()

    # Registered: the adapter (tagged with its base) and the merged model, which loads.
    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri, registry_uri=config.tracking.mlflow_uri)
    registered = client.get_model_version_by_alias("lora-e2e-policy", "best")
    model_id = registered.tags["asyncrl.model_id"]
    assert "adapter" in {a.path for a in client.list_logged_model_artifacts(model_id)}
    assert client.get_logged_model(model_id).tags[BASE_MODEL_TAG] == config.model.path
    mlflow.set_tracking_uri(config.tracking.mlflow_uri)
    try:
        generator = mlflow.transformers.load_model("models:/lora-e2e-policy@best")
        assert generator("1+2=", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("1+2=")
    finally:
        mlflow.set_tracking_uri(None)
