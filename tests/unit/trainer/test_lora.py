"""LoRA adapters on the HF model (no DeepSpeed): only A and B train, a fresh adapter leaves
log-probs exactly as they were, the chunked and whole-logits paths agree through the PEFT
wrapper (with activation checkpointing too), the merged weights equal the adapted model,
and ``trainer.lora`` with ZeRO stage 3 is refused naming both fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from asyncrl.configs.trainer import LoraConfig, OptimizerConfig, TrainerConfig
from asyncrl.tasks.model.tiny import TinyModelSpec, tiny_qwen2_config
from asyncrl.tasks.trainer.batch import TokenSequence, build_micro_batches
from asyncrl.tasks.trainer.engine import EngineSettings, build_engine, enable_activation_checkpointing
from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs
from asyncrl.tasks.trainer.lora import apply_lora

LORA = LoraConfig(rank=4, alpha=8.0)


def _model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(TinyModelSpec(num_layers=2))).to(dtype)


def _batch():  # noqa: ANN202
    sequences = [TokenSequence([5, 6, 7], [8, 9, 10, 11, 12]), TokenSequence([12, 13], [14, 15, 16])]
    (batch,) = build_micro_batches(sequences, [[0, 1]], "packed")
    return batch


def _randomise_b(model: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)


def test_zero_stage_3_with_lora_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError, match=r"trainer\.lora: not supported with trainer\.zero_stage 3"):
        TrainerConfig(lora=LORA, zero_stage=3)
    assert TrainerConfig(lora=LORA, zero_stage=2).lora == LORA
    assert TrainerConfig(zero_stage=3).lora is None
    # The engine refuses it too, before DeepSpeed is touched.
    with pytest.raises(ValueError, match=r"trainer\.lora: not supported with trainer\.zero_stage 3"):
        build_engine(Path("/nonexistent"), EngineSettings(optimizer=OptimizerConfig(), zero_stage=3, lora=LORA))


def test_only_adapter_parameters_require_grad() -> None:
    model = apply_lora(_model(), LORA)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert trainable and frozen
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    # One A and one B per target linear layer of every decoder layer.
    assert len(trainable) == 2 * len(LORA.target_modules) * 2
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    assert all(shape[0] == LORA.rank for name, shape in shapes.items() if ".lora_A." in name)
    assert all(shape[1] == LORA.rank for name, shape in shapes.items() if ".lora_B." in name)


def test_an_unknown_target_module_is_named() -> None:
    with pytest.raises(ValueError, match=r"trainer\.lora\.target_modules: \['qkv_proj'\]"):
        apply_lora(_model(), LoraConfig(target_modules=("q_proj", "qkv_proj")))


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_fresh_adapter_gives_exactly_the_base_logprobs(chunk: int | None) -> None:
    model = _model(torch.float32).eval()
    batch = _batch()
    with torch.no_grad():
        base = micro_batch_logprobs(model, batch, chunk)
        adapted = micro_batch_logprobs(apply_lora(model, LORA).eval(), batch, chunk)
    assert torch.equal(base, adapted)


def test_chunked_and_whole_logprobs_agree_through_the_adapter_in_float64() -> None:
    model = apply_lora(_model(), LORA)
    _randomise_b(model)
    batch = _batch()
    model.eval()
    with torch.no_grad():
        chunked = micro_batch_logprobs(model, batch, 4)
        whole = micro_batch_logprobs(model, batch, None)
        base = micro_batch_logprobs(model.get_base_model(), batch, None)
        with model.disable_adapter():
            disabled = micro_batch_logprobs(model, batch, None)
    assert chunked.dtype == torch.float64
    assert float((chunked - whole).abs().max()) < 1e-6
    # The chunked path runs the adapters (it calls the decoder and head of the wrapped model).
    assert float((chunked - disabled).abs().max()) > 1e-3
    assert float((base - whole).abs().max()) < 1e-12  # the base model object carries the adapters in place


def _adapter_grads(model: torch.nn.Module, chunk: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = _batch()
    model.zero_grad()
    logp = micro_batch_logprobs(model, batch, chunk)
    (logp * batch.loss_mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("chunk", [None, 4])
def test_activation_checkpointing_gives_the_same_adapter_gradients(chunk: int | None) -> None:
    plain_model = apply_lora(_model(), LORA)
    _randomise_b(plain_model)
    plain_model.train()
    plain, plain_grads = _adapter_grads(plain_model, chunk)

    base = _model()
    enable_activation_checkpointing(base)  # as build_engine does: before the adapters
    checkpointed_model = apply_lora(base, LORA)
    _randomise_b(checkpointed_model)
    checkpointed_model.train()
    checkpointed, grads = _adapter_grads(checkpointed_model, chunk)

    assert checkpointed_model.get_base_model().is_gradient_checkpointing
    assert float((checkpointed - plain).abs().max()) < 1e-10
    assert set(grads) == set(plain_grads)
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    assert max(float((grads[n] - plain_grads[n]).abs().max()) for n in grads) < 1e-10
    assert all(p.grad is None for p in checkpointed_model.parameters() if not p.requires_grad)
