"""Activation checkpointing (``trainer.activation_checkpointing``) recomputes every decoder
layer in backward and leaves log-probs and gradients as they were (float64), chunked head
or not."""

from __future__ import annotations

import pytest
import torch

from asyncrl.tasks.model.tiny import TinyModelSpec, tiny_qwen2_config
from asyncrl.tasks.trainer.batch import TokenSequence, build_micro_batches
from asyncrl.tasks.trainer.engine import enable_activation_checkpointing
from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs

LAYERS = 3


def _model_and_batch():  # noqa: ANN202
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(TinyModelSpec(num_layers=LAYERS))).to(torch.float64)
    sequences = [TokenSequence([5, 6, 7], [8, 9, 10, 11]), TokenSequence([12, 13], [14, 15, 16])]
    (batch,) = build_micro_batches(sequences, [[0, 1]], "packed")
    return model, batch


def _run(model: torch.nn.Module, batch, chunk: int | None) -> tuple[torch.Tensor, list[torch.Tensor], int]:  # noqa: ANN001
    """log-probs, every parameter's gradient, and how many decoder-layer forwards began (a
    recompute may stop early, before the layer's forward hook)."""
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    model.zero_grad()
    logp = micro_batch_logprobs(model, batch, chunk)
    (logp * batch.loss_mask).sum().backward()
    for hook in hooks:
        hook.remove()
    return logp.detach(), [p.grad.clone() for p in model.parameters()], len(calls)


@pytest.mark.parametrize("chunk", [None, 4])
def test_checkpointed_layers_recompute_in_backward_with_equal_logprobs_and_gradients(chunk: int | None) -> None:
    model, batch = _model_and_batch()
    model.train()
    plain, plain_grads, plain_calls = _run(model, batch, chunk)
    enable_activation_checkpointing(model)
    checkpointed, grads, calls = _run(model, batch, chunk)

    assert plain_calls == LAYERS and calls == 2 * LAYERS  # each layer ran again in backward
    assert float((checkpointed - plain).abs().max()) < 1e-6
    assert len(grads) == len(plain_grads)
    assert max(float((g - p).abs().max()) for g, p in zip(grads, plain_grads, strict=True)) < 1e-6


def test_checkpointing_leaves_no_grad_passes_alone() -> None:
    model, batch = _model_and_batch()
    enable_activation_checkpointing(model)
    model.train()
    calls = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        micro_batch_logprobs(model, batch, None)
    assert len(calls) == LAYERS
