"""Which Adam the DeepSpeed engine runs: torch's AdamW on the CPU accelerator (no JIT-built op)."""

from __future__ import annotations

from typing import Any

from asyncrl.configs.trainer import OptimizerConfig
from asyncrl.tasks.trainer.engine import EngineSettings, deepspeed_config


def test_torch_adam_is_asked_for_only_when_requested() -> None:
    settings = EngineSettings(optimizer=OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1))
    fused = deepspeed_config(settings)["optimizer"]
    plain = deepspeed_config(settings, torch_adam=True)["optimizer"]
    assert fused["type"] == plain["type"] == "AdamW" and "torch_adam" not in fused["params"]
    assert plain["params"] == {**fused["params"], "torch_adam": True, "fused": True}
    assert fused["params"] == {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8}


def test_cpu_engine_uses_torch_adamw(shared_engine: Any) -> None:
    import torch

    optimizer = shared_engine.engine.ds.optimizer
    base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the base optimizer
    assert type(base) is torch.optim.AdamW
    assert base.defaults["fused"] is True  # in place: no per-step temporaries of the largest parameter
    assert base.defaults["lr"] > 0 and base.defaults["weight_decay"] == 0.0
