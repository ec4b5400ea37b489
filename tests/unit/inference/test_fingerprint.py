"""The load check's tensor fingerprint: strided rows of large tensors, every row of small ones."""

from __future__ import annotations

import torch

from asyncrl.tasks.inference.weight_sync import FINGERPRINT_ROWS, tensor_fingerprint


def test_a_small_tensor_is_fingerprinted_whole() -> None:
    tensor = torch.randn(FINGERPRINT_ROWS, 8)
    changed = tensor.clone()
    changed[-1, -1] += 1.0
    assert tensor_fingerprint(tensor) == tensor_fingerprint(tensor.clone())
    assert tensor_fingerprint(tensor) != tensor_fingerprint(changed)


def test_a_large_tensor_is_fingerprinted_by_strided_rows_of_its_own_dtype() -> None:
    rows = 10 * FINGERPRINT_ROWS + 3
    tensor = torch.randn(rows, 4)
    stride = -(-rows // FINGERPRINT_ROWS)
    sampled, skipped = tensor.clone(), tensor.clone()
    sampled[stride * 7] += 1.0
    skipped[stride * 7 + 1] += 1.0
    assert tensor_fingerprint(tensor) != tensor_fingerprint(sampled)
    assert tensor_fingerprint(tensor) == tensor_fingerprint(skipped)  # the manifest checks files in full
    assert tensor_fingerprint(tensor) != tensor_fingerprint(tensor.to(torch.bfloat16))
    # the model side cuts vocab padding before fingerprinting: the same rows, the same value
    padded = torch.cat([tensor, torch.zeros(61, 4)])
    assert tensor_fingerprint(padded[:rows]) == tensor_fingerprint(tensor)
