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
