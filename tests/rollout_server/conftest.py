"""Fixtures for the rollout-server tests: the tiny model, weight variants, S3 helpers.

A real vLLM server start costs ~30 s on an idle 2-core machine (minutes under load), so
the live tests share one server per module (see ``test_server_live.py``).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest


def load_s3_servers() -> ModuleType:
    """Import ``tests/storage/s3_servers.py`` (tests are not a package under importlib mode).

    Same module name as the storage tests' conftest, so both share one module object.
    """
    module_name = "asyncrl_tests_s3_servers"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = Path(__file__).parent.parent / "storage" / "s3_servers.py"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


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
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.tasks.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("rollout-model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def weight_variants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Local model directories of versions 0 (the tiny model), 1 and 2 (seeded perturbations)."""
    base = tmp_path_factory.mktemp("rollout-variants")
    return {
        0: tiny_model_dir,
        1: perturbed_copy(tiny_model_dir, base / "v1", seed=1, scale=0.05),
        2: perturbed_copy(tiny_model_dir, base / "v2", seed=2, scale=0.05),
    }


@pytest.fixture(scope="session")
def s3_servers() -> ModuleType:
    return load_s3_servers()
