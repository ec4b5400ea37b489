"""The trainer tests' tiny model as ``tiny_model_dir`` for this directory's tests, in place of
the session's (tests/conftest.py); the trainer fixtures themselves are the plugin
tests/support/fixtures_trainer.py, listed in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(trainer_model_dir: Path) -> Path:
    return trainer_model_dir
