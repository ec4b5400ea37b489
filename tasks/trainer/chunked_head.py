"""The output head's log-probs a chunk of positions at a time, forward and backward, so a
packed micro-batch's (tokens x vocabulary) logits are never held whole (at a 151,936-token
vocabulary they are 0.6 MB per token in float32).

:class:`ChunkedHeadLogprobs` is one autograd node with its own backward: it keeps the hidden
states, the head's weight and one logsumexp per position, and recomputes each chunk's logits
in backward. :func:`head_returns_logprobs` makes it the head's ``forward`` for one call of
the model, so the head still runs once per pass, inside the model's forward: under ZeRO
stage 3 its parameter hooks gather the weight before that call and again before its
backward, as for any module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""Causal LMs whose logits are exactly lm_head(last hidden state): no soft-capping or scale."""


class ChunkedHeadLogprobs(torch.autograd.Function):
    """out_j = z_j[t_j] - logsumexp(z_j), z_j = W h_j, for rows j of ``hidden`` (N, H), ``chunk``
    rows at a time. Backward, per chunk, with g_j the incoming gradient of out_j:

        dL/dz_j = g_j (onehot(t_j) - softmax(z_j)),   softmax(z_j) = exp(z_j - logsumexp(z_j))
        dL/dh_j = W^T dL/dz_j,                        dL/dW = sum_j dL/dz_j h_j^T

    z is taken in float32 (float64 stays float64) as the whole-logits path takes it; the
    gradient of z is cast back to the weights' dtype for the two matmuls, as autograd casts it.
    Peak extra memory: one chunk's (chunk, V) logits and their softmax.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        out = hidden.new_empty(hidden.shape[0], dtype=_wide(hidden.dtype))
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = (hidden[rows] @ weight.t()).to(out.dtype)
            lse[rows] = torch.logsumexp(z, dim=-1)
            out[rows] = z.gather(1, targets[rows, None])[:, 0] - lse[rows]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = grad_out[rows].to(lse.dtype)
            z = (hidden[rows] @ weight.t()).to(lse.dtype)
            grad_z = torch.exp(z - lse[rows, None]).mul_(-g[:, None])  # -g softmax(z)
            grad_z.scatter_add_(1, targets[rows, None], g[:, None])  # + g onehot(t)
            grad_z = grad_z.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.t(), hidden[rows])
        return grad_hidden, grad_weight, None, None


def _wide(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype == torch.float64 else torch.float32


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """log_softmax(W h_j)[targets_j] for each row j of ``hidden`` (N, H), shape (N,), computed
    ``chunk_tokens`` rows at a time (:class:`ChunkedHeadLogprobs`); equal to the whole-logits
    values and gradients up to rounding."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return ChunkedHeadLogprobs.apply(hidden, weight, targets, chunk_tokens)


def chunkable_head(module: torch.nn.Module) -> torch.nn.Linear | None:
    """``module``'s output head when its logits are W h alone: a model type in
    PLAIN_HEAD_MODEL_TYPES whose head is a bias-free ``nn.Linear`` (not a wrapped one such as
    a LoRA layer); None otherwise (the whole-logits path then)."""
    if getattr(getattr(module, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear and head.bias is None:
        return head
    return None


@contextmanager
def head_returns_logprobs(head: torch.nn.Linear, targets: torch.Tensor, chunk_tokens: int) -> Iterator[None]:
    """Within the block, ``head(hidden)`` (..., H) returns the log-probs of ``targets``
    (flat, one per position) instead of the logits: the next model forward's ``logits``
    are then (R, S) log-probs. The head's hooks (ZeRO stage 3's gathers) still run."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return chunked_token_logprobs(flat, head.weight, targets, chunk_tokens).reshape(hidden.shape[:-1])

    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward
