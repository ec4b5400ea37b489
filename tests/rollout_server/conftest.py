"""Fixtures for the rollout-server tests: weight variants of the session's tiny model.

A real vLLM server start costs ~30 s on an idle 2-core machine (minutes under load), so
the live tests share one server per module (see ``test_server_live.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def perturbed_copy(src: Path, dst: Path, seed: int, scale: float) -> Path:
    """Copy model directory ``src`` to ``dst`` with every weight w replaced by w + scale * N(0, 1).

    The noise comes from a private generator seeded with ``seed`` (deterministic).
    """
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        noisy = {
            name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            for name, tensor in sorted(tensors.items())
        }
        save_file(noisy, str(file), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def weight_variants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Local model directories of versions 0 (the tiny model), 1 and 2 (seeded perturbations)."""
    base = tmp_path_factory.mktemp("rollout-variants")
    return {
        0: tiny_model_dir,
        1: perturbed_copy(tiny_model_dir, base / "v1", seed=1, scale=0.05),
        2: perturbed_copy(tiny_model_dir, base / "v2", seed=2, scale=0.05),
    }
