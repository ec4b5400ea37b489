"""``asyncrl register`` and ``asyncrl lineage`` on a real run root and a real MLflow store:
the registered version loads through MLflow and generates; the chain reads both ways."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from mlflow_run import TinyRun, tiny_run

from asyncrl.cli.main import main
from asyncrl.storage.weights import WeightStore


@pytest.fixture
def run(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TinyRun:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    return tiny_run(tmp_path, tiny_model_dir, steps=2)


def test_register_then_load_through_mlflow_and_generate(run: TinyRun, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(run.root.path)
    assert main(["register", "2", "--root", store, "--name", "tiny-policy", "--alias", "best"]) == 0
    model_id = run.recorder.logged_versions[2]
    assert capsys.readouterr().out.strip() == (
        f"weight version 2 (LoggedModel {model_id}) registered as models:/tiny-policy/1, models:/tiny-policy@best"
    )
    assert 2 in WeightStore(run.root).pinned_versions()
    # Once per registered version: registering it again logs nothing new and keeps version 1.
    assert main(["register", "2", "--root", store, "--name", "tiny-policy", "--alias", "current"]) == 0
    assert "models:/tiny-policy/1" in capsys.readouterr().out
    files = {a.path for a in run.lineage.client.list_logged_model_artifacts(model_id)}
    assert {"MLmodel", "lineage"} <= files
    assert not {a.path for a in run.lineage.client.list_logged_model_artifacts(run.recorder.logged_versions[1])} - {"lineage"}

    mlflow.set_tracking_uri(run.lineage.tracking_uri)
    try:
        generator = mlflow.transformers.load_model("models:/tiny-policy@best")
        out = generator("12+3=", max_new_tokens=6, do_sample=False)
        assert out[0]["generated_text"].startswith("12+3=") and len(out[0]["generated_text"]) > len("12+3=")
        # The byte-level tokenizer survives the round trip: same ids, lossless decode.
        from transformers import AutoTokenizer

        text = "Compute 12 + 3 * 4.\n#### 24 <|im_end|>"
        original = AutoTokenizer.from_pretrained(tiny_model_dir)
        assert generator.tokenizer(text)["input_ids"] == original(text)["input_ids"]
        assert generator.tokenizer.decode(original(text)["input_ids"]) == text
        # The pyfunc flavor (what `mlflow models serve` serves) generates too.
        served = mlflow.pyfunc.load_model("models:/tiny-policy/1")
        assert served.predict(["7-2="], params={"max_new_tokens": 4})[0].startswith("7-2=")
    finally:
        mlflow.set_tracking_uri(None)


def test_lineage_of_a_version_both_ways(run: TinyRun, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(run.root.path)
    assert main(["register", "2", "--root", store, "--name", "tiny-policy", "--alias", "best"]) == 0
    capsys.readouterr()
    models = run.recorder.logged_versions

    assert main(["lineage", "models:/tiny-policy@best", "--root", store]) == 0
    chain = capsys.readouterr().out
    assert main(["lineage", "2", "--root", store]) == 0
    assert capsys.readouterr().out == chain
    lines = chain.splitlines()
    assert lines[0].startswith(f"weight version 2 of run 'tiny' (MLflow run {run.lineage.run_id}")
    assert lines[1] == "  registered      models:/tiny-policy/1 (aliases: best)"
    assert lines[2].startswith(f"  LoggedModel     {models[2]} 'policy-v2' [READY, transformers flavor]")
    assert f"  weights         {run.root.display('weights/v000002')} (pinned)" in lines
    assert f"  step            2, parent version 1 (LoggedModel {models[1]})" in lines
    assert any(line.startswith("  shards manifest ") and line.endswith(": 1 shards, 4 rows, 2 groups") for line in lines)
    assert any(line.startswith(f"    {run.shards[2]} sha256:") for line in lines)
    assert any(line.startswith("  prompt dataset  train.jsonl sha256:") and line.endswith(str(run.data_file)) for line in lines)

    # Up from the dataset: the run and its versions, and the registered one.
    assert main(["lineage", "--dataset", str(run.data_file), "--root", store]) == 0
    up = capsys.readouterr().out.splitlines()
    assert up[0].endswith(f"used by 1 run(s) in {run.lineage.tracking_uri}")
    assert up[1] == f"  run 'tiny' {run.lineage.run_id} [RUNNING] as training"
    assert up[2:] == ["    weight versions 0..2: 3 LoggedModels",
                      f"    registered models:/tiny-policy/1 = weight version 2 ({models[2]})"]  # fmt: skip


def test_lineage_refuses_bad_input_by_name(run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(run.root.path)
    assert main(["lineage", "999", "--root", store]) == 2
    err = capsys.readouterr().err
    assert f"weight version 999: MLflow run {run.lineage.run_id}" in err and "it holds versions [0, 1, 2]" in err
    assert main(["lineage", "models:/nope@best", "--root", store]) == 2
    assert "models:/nope@best: not in the registry" in capsys.readouterr().err
    assert main(["lineage", "2", "--root", str(tmp_path / "elsewhere")]) == 2
    assert "tracking.json: not found" in capsys.readouterr().err
    assert main(["lineage", "2", "--root", store, "--mlflow-uri", f"sqlite:///{tmp_path / 'missing.db'}"]) == 2
    assert "no such SQLite file" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
    assert main(["lineage", "--root", store]) == 2
    assert "give a VERSION" in capsys.readouterr().err


def test_a_lora_version_registers_its_adapter_and_the_merged_model_that_loads(
    run: TinyRun, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A LoRA run's version is an adapter: registered with its base model, the LoggedModel
    holds the adapter (``adapter/``, tagged with its base) and the merged model, which loads
    through MLflow and computes the adapted model's logits; without the base it is refused."""
    import json

    import torch
    from lora_adapter_builder import peft_model, write_adapter

    from asyncrl.storage.weight_lineage import LINEAGE_FILE
    from asyncrl.tasks.tracking.mlflow_run import BASE_MODEL_TAG

    adapter = write_adapter(tiny_model_dir, tmp_path / "adapter-v3", seed=3, rank=4, alpha=8.0, b_std=0.3)
    (adapter / LINEAGE_FILE).write_text(json.dumps({"version": 3, "parent_version": 2, "step": 3, "shards": []}))
    WeightStore(run.root).publish(3, adapter)
    run.recorder.poll()
    store = str(run.root.path)
    assert main(["register", "3", "--root", store, "--name", "lora-policy"]) == 2
    assert "weight version 3 is a LoRA adapter: registering it needs its base model" in capsys.readouterr().err
    assert main(["register", "3", "--root", store, "--name", "lora-policy", "--base-model", str(tiny_model_dir)]) == 0
    model_id = run.recorder.logged_versions[3]
    assert f"weight version 3 (LoggedModel {model_id}) registered as models:/lora-policy/1" in capsys.readouterr().out
    files = {a.path for a in run.lineage.client.list_logged_model_artifacts(model_id)}
    assert {"MLmodel", "adapter"} <= files
    assert run.lineage.client.get_logged_model(model_id).tags[BASE_MODEL_TAG] == str(tiny_model_dir)

    mlflow.set_tracking_uri(run.lineage.tracking_uri)
    try:
        merged = mlflow.transformers.load_model("models:/lora-policy/1").model
    finally:
        mlflow.set_tracking_uri(None)
    tokens = torch.tensor([[3, 9, 4, 12, 7]])
    with torch.no_grad():
        adapted, base = peft_model(tiny_model_dir, adapter)(tokens).logits, peft_model(tiny_model_dir, None)(tokens).logits
        loaded = merged.float()(tokens).logits
    assert float((loaded - adapted).abs().max()) < 1e-4 < float((loaded - base).abs().max())
