"""PEFT LoRA adapters of the tiny model for the inference tests: written as a trainer would
publish them (``adapter_config.json`` + ``adapter_model.safetensors``), and the HF PEFT
model of one, the reference a LoRA server's log-probs are checked against.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base_dir: Path, out_dir: Path, *, seed: int, rank: int, alpha: float, b_std: float) -> Path:
    """A LoRA adapter of the model at ``base_dir`` in ``out_dir``: PEFT's initialisation of A
    (seeded) and B ~ N(0, b_std^2) (``b_std`` 0: PEFT's B = 0, the base model, as a run's
    version 0). The base's ``config.json`` is copied beside it when the weight store asks
    for one (``storage.weights.REQUIRED_FILES``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncrl.storage.weights import REQUIRED_FILES

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGET_MODULES))
    model = get_peft_model(base, config)
    if b_std > 0:
        generator = torch.Generator().manual_seed(10_000 + seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    model.save_pretrained(out_dir)
    for name in REQUIRED_FILES:
        if not (out_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path | None) -> Any:
    """The float32 HF model of ``base_dir`` with the adapter at ``adapter_dir`` (None: the base)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()
