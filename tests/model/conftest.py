"""One tiny model directory per test session (writing it costs the transformers import)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.tasks.model.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
