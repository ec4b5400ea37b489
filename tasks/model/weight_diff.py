"""Where two saved weight directories differ: the first tensor (in file, then name order) whose
values differ, the largest absolute difference over every tensor, and the distance
||a - b||_2 = sqrt(sum over every tensor element of (a - b)^2)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TensorDifference:
    """``first_tensor``: ``file:name`` of the first differing tensor (None: every tensor is
    equal, so only other files differ); ``max_abs_diff``: max |a - b| over all tensors, inf
    where a tensor is in one directory only or changed shape."""

    first_tensor: str | None
    max_abs_diff: float
    tensors_differing: int
    l2_distance: float
    """||a - b||_2 over the tensors present in both with one shape (inf if any is not)."""


def tensor_difference(a: Path, b: Path) -> TensorDifference:
    """Compare every ``*.safetensors`` tensor of directories ``a`` and ``b``, bit for bit."""
    import torch
    from safetensors.torch import load_file

    first: str | None = None
    largest, differing, squares = 0.0, 0, 0.0
    names = sorted({p.name for p in a.glob("*.safetensors")} | {p.name for p in b.glob("*.safetensors")})
    for file in names:
        left = load_file(a / file) if (a / file).is_file() else {}
        right = load_file(b / file) if (b / file).is_file() else {}
        for key in sorted(set(left) | set(right)):
            x, y = left.get(key), right.get(key)
            if x is not None and y is not None and x.shape == y.shape and x.dtype == y.dtype:
                if torch.equal(x, y):
                    continue
                delta = x.double() - y.double()
                gap = float(delta.abs().max())
                squares += float((delta * delta).sum())
            else:
                gap = squares = float("inf")
            differing += 1
            largest = max(largest, gap)
            first = first or f"{file}:{key}"
    return TensorDifference(first, largest, differing, squares**0.5)
