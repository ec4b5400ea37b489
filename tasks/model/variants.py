"""Weight variants of a model: copies of an HF model directory with seeded noise (benchmarks, tests)."""

from __future__ import annotations

import shutil
from pathlib import Path


def perturbed_copy(source: Path, target: Path, seed: int, std: float) -> Path:
    """Copy `source` to `target`, adding N(0, std^2) noise (a private generator seeded by
    `seed`, so deterministic) to every tensor of every safetensors file."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(target.glob("*.safetensors")):
        tensors = load_file(str(file))
        noisy = {
            name: tensor + std * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            for name, tensor in sorted(tensors.items())
        }
        save_file(noisy, str(file), metadata={"format": "pt"})
    return target
