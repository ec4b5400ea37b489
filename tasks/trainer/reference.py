"""The reference policy of the KL penalty (``trainer.kl_coef``): the run's first weights, frozen.

Full fine-tuning holds a frozen copy of them (the lowest published version, else
``model.path``) beside the engine, on the same device and in the same dtype. A LoRA run needs
no copy: its first version is the base with zero adapters, so the reference is the engine's
own model with its adapters switched off for the pass. Its log-probs are taken once per step,
without gradient, for the tokens each rank trains, as log pi_prox is
(:func:`~asyncrl.tasks.trainer.step.compute_proximal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.tasks.algo.packing import get_packer
from asyncrl.tasks.trainer.logprobs import ModelCall, sequence_logprobs
from asyncrl.tasks.trainer.step_data import TrainItem

if TYPE_CHECKING:
    import torch

    from asyncrl.tasks.trainer.engine import TrainEngine


@dataclass(frozen=True)
class ReferencePolicy:
    """A model call giving pi_ref's log-probs; ``adapters_off``: the engine's PEFT model with
    its adapters disabled during the call (a LoRA run)."""

    model: ModelCall
    adapters_off: bool = False


def load_reference(engine: TrainEngine, reference_dir: Path | None) -> ReferencePolicy:
    """The run's reference policy: the engine itself with adapters off for a LoRA run
    (``reference_dir`` unused), else the weights in ``reference_dir`` loaded frozen in eval
    mode on the engine's device and dtype."""
    if engine.lora is not None:
        return ReferencePolicy(engine.ds, adapters_off=True)
    if reference_dir is None:
        raise ValueError("trainer.kl_coef: full fine-tuning needs the reference weights' directory")
    from transformers import AutoModelForCausalLM

    first = next(engine.module.parameters())
    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=first.dtype).to(first.device)
    model.eval()
    model.requires_grad_(False)
    return ReferencePolicy(model)


def reference_logprobs(
    reference: ReferencePolicy,
    engine: TrainEngine,
    items: Sequence[TrainItem],
    indices: Sequence[int],
    packer: str,
    micro_batch_tokens: int,
) -> dict[int, torch.Tensor]:
    """log pi_ref of every trained token of ``items[i] for i in indices`` (no gradient),
    keyed by item index; packed as the update packs them."""
    sequences = [items[i].sequence for i in indices]
    if not sequences:
        return {}
    groups = get_packer(packer)([len(s) for s in sequences], micro_batch_tokens)
    was_training = engine.module.training
    engine.module.eval()
    switch = engine.module.disable_adapter() if reference.adapters_off else nullcontext()
    try:
        with switch:
            values = sequence_logprobs(reference.model, sequences, groups, engine.logit_chunk_tokens)
    finally:
        engine.module.train(was_training)
    return dict(zip(indices, values))
