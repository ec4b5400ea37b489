"""``asyncrl promote`` and ``asyncrl rollback`` from the command line: their help, and the one
line a user sees when the version is not there (the registry logic itself is tested in
tests/unit/tracking/test_promotion_registry.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.cli.main import main


@pytest.mark.parametrize("command", ["promote", "rollback"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: asyncrl {command}" in out and "--mlflow-uri" in out


def test_a_missing_version_or_model_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["promote", "policy", "3", "--mlflow-uri", uri]) == 2
    assert "asyncrl promote: error: models:/policy/3: no such registered model version" in capsys.readouterr().err
    assert main(["rollback", "policy", "--mlflow-uri", uri]) == 2
    assert "asyncrl rollback: error: models:/policy@best: no such model or alias" in capsys.readouterr().err


def test_no_store_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["rollback", "policy"]) == 2
    assert "name the MLflow store" in capsys.readouterr().err
