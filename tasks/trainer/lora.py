"""Low-rank adapters (``trainer.lora``) on the trainer's model: wrap, publish, merge.

Each target linear layer W (d_out x d_in) of the HF causal LM computes

    y = W x + s * B A x,    s = alpha / r,   A: r x d_in,   B: d_out x r,

with W frozen. PEFT starts A random (Kaiming-uniform) and B at zero, so a fresh adapter
leaves every output of the base model unchanged. Only A and B require grad, so the
engine's optimizer (built from ``p.requires_grad`` parameters) holds nothing else.
PEFT replaces each target ``nn.Linear`` in place by a LoRA layer that keeps it as
``base_layer``: the HF model's own methods (``get_decoder``, ``get_output_embeddings``,
gradient checkpointing) run through the adapters unchanged.

A weight version of a LoRA run is the adapter alone (:func:`save_adapter`), in the PEFT
format vLLM's LoRA loader reads: ``adapter_model.safetensors`` (tensors named like
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) and
``adapter_config.json`` (r, lora_alpha, target_modules, base_model_name_or_path). The
full model with the adapter folded in, W' = W + s * B A, is
:func:`~asyncrl.tasks.model.lora_adapter.merge_adapter` of a published version (no PEFT
needed there: MLflow registration merges it).
LoRA runs at ZeRO stages 0-2 only (``TrainerConfig`` refuses stage 3), where every rank
holds whole weights: nothing here is collective.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.configs.trainer import LoraConfig
from asyncrl.tasks.model.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

ADAPTER_NAME = "default"
"""PEFT's adapter name; it is dropped from the saved tensor names."""
BASE_CONFIG_FILE = "config.json"
"""The base model's config, copied into every adapter version: the weight store requires
a ``config.json`` in every version (``asyncrl.storage.weights.REQUIRED_FILES``), and it
names the architecture the adapter applies to. vLLM's LoRA loader ignores it."""


def _linear_leaf_names(model: torch.nn.Module) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def apply_lora(
    model: torch.nn.Module,
    config: LoraConfig,
    *,
    base_model_reference: str | None = None,
    initial_adapter: Path | None = None,
) -> PeftModel:
    """``model`` (an HF causal LM, modified in place) wrapped with fresh LoRA adapters on
    ``config.target_modules``: base parameters frozen, A and B trainable, in the base
    weights' dtype and device.

    ``base_model_reference`` is what published adapters name as their base
    (``base_model_name_or_path``; None: the directory the model was loaded from).
    ``initial_adapter``: a directory of a published adapter whose A and B replace the
    fresh ones (:func:`load_adapter_weights`). ``ValueError`` names
    ``trainer.lora.target_modules`` when one of them matches no linear layer."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    linear = _linear_leaf_names(model)
    unknown = [name for name in config.target_modules if name not in linear]
    if unknown:
        raise ValueError(
            f"trainer.lora.target_modules: {unknown} name no linear layer of the model (its linear layers: {sorted(linear)})"
        )
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # autocast off: A and B take the base weights' dtype, as every parameter of a full
    # fine-tuning run does (DeepSpeed keeps the float32 master copy under bf16/fp16).
    wrapped = get_peft_model(model, peft_config, adapter_name=ADAPTER_NAME, autocast_adapter_dtype=False)
    if base_model_reference is not None:  # get_peft_model sets it to the loaded directory
        wrapped.peft_config[ADAPTER_NAME].base_model_name_or_path = base_model_reference
    if initial_adapter is not None:
        load_adapter_weights(wrapped, Path(initial_adapter), config)
    return wrapped


def peft_model_of(module: torch.nn.Module) -> PeftModel:
    """``module`` as a PEFT model; ``TypeError`` if it carries no adapter."""
    from peft import PeftModel

    if not isinstance(module, PeftModel):
        raise TypeError(f"expected a PEFT LoRA model, got {type(module).__name__} (is trainer.lora set?)")
    return module


def adapter_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """A and B of every adapted layer under the names PEFT saves and vLLM loads
    (``base_model.model.<HF module path>.lora_A.weight``), as contiguous CPU copies."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)
    return {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state.items()}


def load_adapter_weights(model: PeftModel, adapter_dir: Path, config: LoraConfig) -> None:
    """Set A and B of ``model`` from the adapter saved in ``adapter_dir`` (a published version).

    ``ValueError`` naming ``trainer.lora`` and the directory when the saved adapter has another
    rank, alpha or target modules than ``config``, or other tensors than ``model``'s adapters."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    ours = {"r": config.rank, "lora_alpha": config.alpha, "target_modules": sorted(config.target_modules)}
    theirs = {
        "r": saved.get("r"),
        "lora_alpha": saved.get("lora_alpha"),
        "target_modules": sorted(saved.get("target_modules") or []),
    }
    if ours != theirs:
        raise ValueError(f"trainer.lora: {ours} differs from the adapter in {adapter_dir}: {theirs}")
    state = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    expected = set(adapter_state_dict(model))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)


def save_adapter(
    module: torch.nn.Module, base_model_dir: Path, rank: int, out_dir: Path, extra_files: dict[str, str] | None = None
) -> Path:
    """Write the adapter of ``module`` (the engine's PEFT-wrapped model) as a PEFT adapter
    directory: a LoRA run's weight version.

    ``adapter_model.safetensors`` (A and B, :func:`adapter_state_dict`),
    ``adapter_config.json`` (r, lora_alpha, target_modules sorted, so that the file and the
    version's digest are the same in every process, base_model_name_or_path,
    ``inference_mode`` true), the base model's ``config.json`` (see BASE_CONFIG_FILE) and
    ``extra_files`` (name -> text). No base weights and no tokenizer: a server serves the
    adapter on the base model it loaded, with that model's tokenizer. Loadable by
    ``peft.PeftModel.from_pretrained(base, out_dir)`` and by vLLM's LoRA loader. Rank 0
    writes; the others return at once. ``base_model_dir`` holds the base model's config."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if rank != 0:
        return out_dir
    model = peft_model_of(module)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(model), str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config[ADAPTER_NAME])
    config.inference_mode = True
    if isinstance(config.target_modules, (set, frozenset)):  # PEFT keeps a set: its order varies by process
        config.target_modules = sorted(config.target_modules)
    config.save_pretrained(str(out_dir))
    shutil.copyfile(Path(base_model_dir) / BASE_CONFIG_FILE, out_dir / BASE_CONFIG_FILE)
    for name, text in (extra_files or {}).items():
        (out_dir / name).write_text(text)
    return out_dir
