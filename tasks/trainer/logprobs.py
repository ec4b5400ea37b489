"""Per-token log-probabilities of a causal LM over a micro-batch, with the logits computed
in chunks of positions so that a packed micro-batch's (tokens x vocabulary) logits are never
held whole (at a 151,936-token vocabulary they are 0.6 MB per token in float32).

Under ZeRO stage 3 a forward pass is a collective: every module all-gathers its parameters
as it runs, so every rank must run the same modules in the same order. The chunked path
calls the output head once per chunk (and again per chunk in backward, recomputing it), a
count that depends on the rank's own token count: ranks with different micro-batches would
pair one rank's gather of the head with another's gather of a different parameter (seen:
gloo's "Received data size doesn't match expected size"). It also calls the decoder and
the head outside the DeepSpeed engine's forward, whose hook starts each pass of ZeRO-3's
module trace. So under stage 3 every micro-batch takes the whole-logits path through the
engine (:func:`micro_batch_logprobs`), and passes over a rank's own micro-batches are
padded to the same count on every rank (:func:`lockstep_passes`, :func:`filler_passes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from asyncrl.tasks.trainer.batch import MicroBatch, TokenSequence, build_micro_batches, filler_micro_batch
from asyncrl.tasks.trainer.data_parallel import all_reduce_floats
from asyncrl.tasks.trainer.zero3 import parameters_partitioned

if TYPE_CHECKING:
    import torch

ModelCall = Callable[..., object]


# Causal LMs whose logits are exactly lm_head(last hidden state): no soft-capping or scale,
# so the decoder and the head can be called apart. Others take the whole-logits path.
PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def micro_batch_logprobs(model: ModelCall, batch: MicroBatch, chunk_tokens: int | None = None) -> torch.Tensor:
    """log pi(target_j | tokens <= j of the same sequence) at every position j, shape (R*S,).

        logp_j = log_softmax(z_j)[targets_j] = -cross_entropy(z_j, targets_j),  z_j = W h_j

    computed in float32 from the raw logits (no temperature: the rollout reports log-probs
    of the raw model distribution). Positions outside ``loss_mask`` hold meaningless
    values. ``model`` is an HF causal LM or a DeepSpeed engine wrapping one; gradients
    flow if autograd is enabled. With ``chunk_tokens`` (and a model in
    PLAIN_HEAD_MODEL_TYPES, its parameters not partitioned by ZeRO stage 3: see the module
    docstring) the decoder runs once and z is computed ``chunk_tokens`` positions at a
    time (:func:`chunked_token_logprobs`); otherwise in one piece, through ``model``.
    """
    device = _device_of(model)
    batch = batch.to(device)
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": batch.attention_mask,
        "use_cache": False,  # with a cache, transformers ignores the packed position_ids
    }
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    plain_head = getattr(getattr(module, "config", None), "model_type", None) in PLAIN_HEAD_MODEL_TYPES
    if chunk_tokens is not None and plain_head and not parameters_partitioned(module):
        hidden = module.get_decoder()(**inputs).last_hidden_state  # (R, S, H)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return chunked_token_logprobs(flat, module.get_output_embeddings(), batch.targets, chunk_tokens)
    logits = model(**inputs).logits  # (R, S, V)
    return _logprobs_of_logits(logits.reshape(-1, logits.shape[-1]), batch.targets)  # (R*S,)


def chunked_token_logprobs(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """log_softmax(head(h_j))[targets_j] for each row j of ``hidden`` (N, H), shape (N,).

    Rows are taken ``chunk_tokens`` at a time; under autograd each chunk is checkpointed
    (its logits recomputed in backward), so at most one chunk's (chunk_tokens, V) logits,
    with their float32 copy, is alive at once: peak memory O(chunk_tokens * V) instead of
    O(N * V), for one extra head matmul in backward. Each row's value is the same
    computation as the unchunked one, so the two agree to rounding.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    pieces = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows, rows_targets = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and rows.requires_grad:
            pieces.append(checkpoint(_head_logprobs, head, rows, rows_targets, use_reentrant=False))
        else:
            pieces.append(_head_logprobs(head, rows, rows_targets))
    return torch.cat(pieces) if pieces else hidden.new_zeros((0,), dtype=torch.float32)


def _head_logprobs(head: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _logprobs_of_logits(head(rows), targets)


def _logprobs_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-cross_entropy in at least float32 (float64 logits stay float64)."""
    import torch
    import torch.nn.functional as F

    wide = logits if logits.dtype == torch.float64 else logits.to(torch.float32)
    return -F.cross_entropy(wide, targets, reduction="none")


def sequence_logprobs(
    model: ModelCall,
    sequences: Sequence[TokenSequence],
    groups: Sequence[Sequence[int]],
    chunk_tokens: int | None = None,
) -> list[torch.Tensor]:
    """Trained-token log-probs of each sequence (no grad), computed over packed micro-batches ``groups``.

    Returns one (M_i,) float32 CPU tensor per sequence, in ``sequences`` order, M_i =
    ``sequences[i].trained_count``: log pi(y_t | tokens before t) for each trained output
    token t; untrained (environment) tokens are context of the forward pass only.
    """
    import torch

    result: list[torch.Tensor | None] = [None] * len(sequences)
    with torch.no_grad():
        for batch in build_micro_batches(sequences, groups, "packed"):
            per_sample = batch.split(micro_batch_logprobs(model, batch, chunk_tokens).cpu())
            for index, values in zip(batch.sample_ids, per_sample):
                result[index] = values
    missing = [i for i, value in enumerate(result) if value is None]
    if missing:
        raise ValueError(f"sequences {missing} are in no micro-batch")
    return [value for value in result if value is not None]


def lockstep_passes(model: ModelCall, passes: int) -> int:
    """Forward passes to run for ``passes`` micro-batches of this rank's own: under ZeRO
    stage 3 (a forward is a collective) the most any rank has, max over ranks (collective:
    every rank calls it, before any of those passes); ``passes`` otherwise, without
    communicating."""
    if not parameters_partitioned(getattr(model, "module", model)):
        return passes
    (most,) = all_reduce_floats([float(passes)], "max")
    return int(most)


def filler_passes(model: ModelCall, sequence: TokenSequence, count: int, chunk_tokens: int | None = None) -> None:
    """``count`` forward passes without gradient over the two-token filler micro-batch of
    ``sequence``, values discarded: a ZeRO-3 rank's part in the collective passes of
    ranks with more micro-batches (:func:`lockstep_passes`)."""
    import torch

    with torch.no_grad():
        for _ in range(count):
            micro_batch_logprobs(model, filler_micro_batch(sequence), chunk_tokens)


def _device_of(model: ModelCall) -> torch.device:
    import torch

    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        for parameter in parameters():
            return parameter.device
    return torch.device("cpu")
