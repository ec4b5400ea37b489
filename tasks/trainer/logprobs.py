"""Per-token log-probabilities of a causal LM over a micro-batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from asyncrl.tasks.trainer.batch import MicroBatch, TokenSequence, build_micro_batches

if TYPE_CHECKING:
    import torch

ModelCall = Callable[..., object]


def micro_batch_logprobs(model: ModelCall, batch: MicroBatch) -> torch.Tensor:
    """log pi(target_j | tokens <= j of the same sequence) at every position j, shape (R*S,).

        logp_j = log_softmax(logits_j)[targets_j] = -cross_entropy(logits_j, targets_j)

    computed in float32 from the raw logits (no temperature: the rollout reports log-probs
    of the raw model distribution). Positions outside ``loss_mask`` hold meaningless
    values. ``model`` is an HF causal LM or a DeepSpeed engine wrapping one; gradients
    flow if autograd is enabled.
    """
    import torch
    import torch.nn.functional as F

    device = _device_of(model)
    batch = batch.to(device)
    output = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=batch.attention_mask,
        use_cache=False,  # with a cache, transformers ignores the packed position_ids
    )
    logits = output.logits  # (R, S, V)
    vocab = logits.shape[-1]
    return -F.cross_entropy(
        logits.reshape(-1, vocab).to(torch.float32), batch.targets, reduction="none"
    )  # (R*S,)


def sequence_logprobs(
    model: ModelCall, sequences: Sequence[TokenSequence], groups: Sequence[Sequence[int]]
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
            per_sample = batch.split(micro_batch_logprobs(model, batch).cpu())
            for index, values in zip(batch.sample_ids, per_sample):
                result[index] = values
    missing = [i for i, value in enumerate(result) if value is None]
    if missing:
        raise ValueError(f"sequences {missing} are in no micro-batch")
    return [value for value in result if value is not None]


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
