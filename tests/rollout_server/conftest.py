"""Fixtures for the rollout-server tests: weight variants of the session's tiny model.

A real vLLM server start costs ~30 s on an idle 2-core machine (minutes under load), so
the live tests share one server per module (see ``test_server_live.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from asyncrl.tasks.model.variants import perturbed_copy


@pytest.fixture(scope="session")
def weight_variants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Local model directories of versions 0 (the tiny model), 1 and 2 (seeded perturbations)."""
    base = tmp_path_factory.mktemp("rollout-variants")
    return {
        0: tiny_model_dir,
        1: perturbed_copy(tiny_model_dir, base / "v1", seed=1, std=0.05),
        2: perturbed_copy(tiny_model_dir, base / "v2", seed=2, std=0.05),
    }
