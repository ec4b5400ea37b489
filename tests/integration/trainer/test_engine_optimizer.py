"""Which Adam the DeepSpeed engine runs: torch's AdamW on the CPU accelerator (no JIT-built op)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from asyncrl.configs.trainer import OptimizerConfig, TrainerConfig
from asyncrl.tasks.trainer.engine import EngineSettings, deepspeed_config


def test_torch_adam_is_asked_for_only_when_requested() -> None:
    settings = EngineSettings(optimizer=OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1))
    fused = deepspeed_config(settings)["optimizer"]
    plain = deepspeed_config(settings, torch_adam=True)["optimizer"]
    assert fused["type"] == plain["type"] == "AdamW" and "torch_adam" not in fused["params"]
    assert plain["params"] == {**fused["params"], "torch_adam": True, "fused": True}
    assert fused["params"] == {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8}


def test_zero3_live_elements_bound_deepspeeds_buckets_at_stage_3_only() -> None:
    optimizer = OptimizerConfig(lr=1e-4)
    zero = deepspeed_config(EngineSettings(optimizer=optimizer, zero_stage=3, zero3_live_elements=2_000_000))["zero_optimization"]
    assert zero == {"stage": 3, "stage3_max_live_parameters": 2_000_000, "stage3_max_reuse_distance": 2_000_000,
                    "sub_group_size": 2_000_000, "reduce_bucket_size": 1_000_000}  # fmt: skip
    defaults = deepspeed_config(EngineSettings(optimizer=optimizer, zero_stage=3, zero3_live_elements=None))
    assert defaults["zero_optimization"] == {"stage": 3}  # DeepSpeed's own
    assert deepspeed_config(EngineSettings(optimizer=optimizer, zero_stage=2))["zero_optimization"] == {"stage": 2}


def test_zero3_live_elements_below_a_million_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="zero3_live_elements"):
        TrainerConfig(zero3_live_elements=1000)


def test_cpu_engine_uses_torch_adamw(shared_engine: Any) -> None:
    import torch

    optimizer = shared_engine.engine.ds.optimizer
    base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the base optimizer
    assert type(base) is torch.optim.AdamW
    assert base.defaults["fused"] is True  # in place: no per-step temporaries of the largest parameter
    assert base.defaults["lr"] > 0 and base.defaults["weight_decay"] == 0.0


def test_a_one_rank_stage_0_engine_skips_the_all_reduce_and_keeps_the_plain_gradients(trainer_model_dir: Any) -> None:
    """One rank without ZeRO: no flat-bucket copy of the gradients ("reduced" over one rank),
    and the gradients are exactly those of the same model outside DeepSpeed."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.tasks.trainer.engine import build_engine

    engine = build_engine(trainer_model_dir, EngineSettings(optimizer=OptimizerConfig(lr=1e-3), zero_stage=0))
    assert engine.world_size == 1 and engine.ds.enable_backward_allreduce is False
    tokens = torch.tensor([[3, 5, 7, 9, 11, 13, 2, 4]])
    engine.ds.backward(engine.ds(tokens, labels=tokens).loss)
    reference = AutoModelForCausalLM.from_pretrained(trainer_model_dir)
    reference(tokens, labels=tokens).loss.backward()
    pairs = list(zip(engine.module.named_parameters(), reference.parameters(), strict=True))
    assert all(p.grad is not None for (_, p), _ in pairs)
    for (name, mine), theirs in pairs:
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6), name
