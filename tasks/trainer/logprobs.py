"""Per-token log-probabilities of a causal LM over a micro-batch, with the logits computed
in chunks of positions so that a packed micro-batch's (tokens x vocabulary) logits are never
held whole (at a 151,936-token vocabulary they are 0.6 MB per token in float32).

The chunks live inside one call of the output head
(:class:`~asyncrl.tasks.trainer.chunked_head.ChunkedHeadLogprobs`, with its own backward),
made during the model's own forward through the DeepSpeed engine: the head's ``forward``
returns the log-probs instead of the logits for that call
(:func:`~asyncrl.tasks.trainer.chunked_head.head_returns_logprobs`). So the modules run
once each, in the model's order, under every ZeRO stage. That matters under stage 3, where a forward pass is a collective: every
module all-gathers its parameters as it runs (and again in backward), so every rank must run
the same modules in the same order; a head called once per chunk, a count that depends on
the rank's tokens, would pair one rank's gather of the head with another's gather of a
different parameter (seen: gloo's "Received data size doesn't match expected size"). Passes
over a rank's own micro-batches are padded to the same count on every rank
(:func:`lockstep_passes`, :func:`filler_passes`).
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


def micro_batch_logprobs(model: ModelCall, batch: MicroBatch, chunk_tokens: int | None = None) -> torch.Tensor:
    """log pi(target_j | tokens <= j of the same sequence) at every position j, shape (R*S,).

        logp_j = log_softmax(z_j)[targets_j] = z_j[targets_j] - logsumexp(z_j),  z_j = W h_j

    computed in float32 from the raw logits (no temperature: the rollout reports log-probs
    of the raw model distribution). Positions outside ``loss_mask`` hold meaningless
    values. ``model`` is an HF causal LM or a DeepSpeed engine wrapping one; gradients
    flow if autograd is enabled. With ``chunk_tokens`` (and a model whose logits are its
    head's alone: :func:`~asyncrl.tasks.trainer.chunked_head.chunkable_head`) z is computed
    ``chunk_tokens`` positions at a time inside the head's one call
    (:func:`~asyncrl.tasks.trainer.chunked_head.head_returns_logprobs`); otherwise whole.
    """
    from asyncrl.tasks.trainer.chunked_head import chunkable_head, head_returns_logprobs

    device = _device_of(model)
    batch = batch.to(device)
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": batch.attention_mask,
        "use_cache": False,  # with a cache, transformers ignores the packed position_ids
    }
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    if chunk_tokens is not None and (head := chunkable_head(module)) is not None:
        with head_returns_logprobs(head, batch.targets, chunk_tokens):
            return model(**inputs).logits.reshape(-1)  # the head's output: (R, S) log-probs
    logits = model(**inputs).logits  # (R, S, V)
    return _logprobs_of_logits(logits.reshape(-1, logits.shape[-1]), batch.targets)  # (R*S,)


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
