"""Merge a LoRA adapter (PEFT's saved format) into its base model's safetensors, without PEFT.

A LoRA weight version holds, per adapted linear module ``m``, ``A_m`` (r x d_in) and ``B_m``
(d_out x r) under the names ``base_model.model.<m>.lora_A.weight`` / ``...lora_B.weight``,
and ``adapter_config.json`` gives ``r`` and ``lora_alpha``. The merged weight of ``m`` is

    W'_m = W_m + (lora_alpha / r) * B_m @ A_m

computed in float32 and stored in ``W_m``'s dtype; every other tensor is copied. The result
is a plain HF model directory (``AutoModelForCausalLM.from_pretrained``, vLLM), what MLflow
registers as the merged variant of an adapter. Variants this module does not compute (rsLoRA,
DoRA, per-module rank or alpha patterns, fan-in/fan-out weights) are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


class AdapterMergeError(ValueError):
    """The adapter cannot be merged into the base model; the message says what is wrong."""


def is_adapter_dir(path: Path) -> bool:
    """Whether ``path`` holds a saved LoRA adapter (its config and weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


def adapter_scaling(config: dict[str, Any], source: str = ADAPTER_CONFIG) -> float:
    """``lora_alpha / r`` of a PEFT LoRA config; ``AdapterMergeError`` naming the field for
    what the plain formula does not cover."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterMergeError(f"{source}: peft_type {config.get('peft_type')!r} is not LORA")
    for field in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(field):
            raise AdapterMergeError(f"{source}: {field} is set; only plain LoRA adapters are merged")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise AdapterMergeError(f"{source}: {field} is not empty; only one rank and alpha for every module are merged")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterMergeError(f"{source}: r must be an int >= 1 and lora_alpha > 0, got r={rank!r}, lora_alpha={alpha!r}")
    return float(alpha) / rank


def adapter_deltas(adapter_dir: Path) -> dict[str, Any]:
    """``{base tensor name: (lora_alpha / r) * B @ A}`` (float32) of every adapted module."""
    import torch
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    if not is_adapter_dir(adapter_dir):
        raise AdapterMergeError(f"{adapter_dir}: not a LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} expected)")
    scaling = adapter_scaling(json.loads((adapter_dir / ADAPTER_CONFIG).read_text()), str(adapter_dir / ADAPTER_CONFIG))
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    deltas: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        if name.endswith(LORA_B):
            continue
        if not (name.startswith(ADAPTER_PREFIX) and name.endswith(LORA_A)):
            raise AdapterMergeError(f"{adapter_dir / ADAPTER_WEIGHTS}: unexpected tensor {name!r} (LoRA A/B weights only)")
        module = name[len(ADAPTER_PREFIX) : -len(LORA_A)]
        b_name = ADAPTER_PREFIX + module + LORA_B
        if b_name not in tensors:
            raise AdapterMergeError(f"{adapter_dir / ADAPTER_WEIGHTS}: {name!r} has no {b_name!r}")
        deltas[module + ".weight"] = scaling * (tensors[b_name].float() @ tensors[name].float())
    unpaired = [n for n in tensors if n.endswith(LORA_B) and n.replace(LORA_B, LORA_A) not in tensors]
    if unpaired:
        raise AdapterMergeError(f"{adapter_dir / ADAPTER_WEIGHTS}: {unpaired[0]!r} has no lora_A")
    return deltas


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """Write ``base_dir`` with ``adapter_dir`` merged (module docstring) to ``out_dir``: each
    safetensors file of the base is rewritten with its adapted tensors merged, every other
    file (config, tokenizer, shard index) copied. ``AdapterMergeError`` names a delta whose
    tensor the base lacks or whose shape differs; ``out_dir`` must not exist yet."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    deltas = adapter_deltas(adapter_dir)
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise AdapterMergeError(f"{base_dir}: no *.safetensors files to merge into")
    out_dir.mkdir(parents=True, exist_ok=False)
    for item in sorted(base_dir.iterdir()):
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out_dir / item.name)
    pending = dict(deltas)
    for file in files:
        merged = {}
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata()
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                delta = pending.pop(name, None)
                if delta is not None:
                    if tuple(delta.shape) != tuple(tensor.shape):
                        raise AdapterMergeError(
                            f"{adapter_dir}: the delta of {name!r} is {tuple(delta.shape)}, the base tensor {tuple(tensor.shape)}"
                        )
                    tensor = (tensor.float() + delta).to(tensor.dtype)
                merged[name] = tensor.contiguous()
        save_file(merged, str(out_dir / file.name), metadata=metadata or {"format": "pt"})
    if pending:
        shutil.rmtree(out_dir)
        raise AdapterMergeError(f"{adapter_dir}: adapts {sorted(pending)[0]!r}, which {base_dir} does not have")
    return out_dir
