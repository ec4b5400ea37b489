"""Merging a saved LoRA adapter into its base without PEFT equals PEFT's own merge, and what
cannot be merged by the plain formula is refused by name, leaving nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.tasks.model.lora_adapter import ADAPTER_CONFIG, AdapterMergeError, is_adapter_dir, merge_adapter
from asyncrl.tasks.model.tiny import write_tiny_model

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _adapter(base_dir: Path, out: Path, *, rank: int = 4, alpha: float = 8.0, seed: int = 0) -> Path:
    """A PEFT adapter of the base with random A and B (B = 0 would merge to the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("merge") / "base")


def test_the_merge_equals_peft_s_merge_and_the_logits_of_the_adapted_model(base_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = _adapter(base_dir, tmp_path / "adapter")
    assert is_adapter_dir(adapter) and not is_adapter_dir(base_dir)
    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(base_dir, adapter, tmp_path / "merged"))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        adapted_logits = peft_model(tokens).logits
        merged_logits = merged(tokens).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir)(tokens).logits
    assert float((merged_logits - adapted_logits).abs().max()) < 1e-4
    assert float((merged_logits - base_logits).abs().max()) > 1e-2  # the adapter changed something
    reference = peft_model.merge_and_unload().state_dict()
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name
    assert {p.name for p in base_dir.iterdir()} == {p.name for p in (tmp_path / "merged").iterdir()}


def test_variants_the_formula_does_not_cover_are_refused_by_field(base_dir: Path, tmp_path: Path) -> None:
    adapter = _adapter(base_dir, tmp_path / "adapter")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    for field, value in (("use_rslora", True), ("use_dora", True), ("rank_pattern", {"q_proj": 8})):
        (adapter / ADAPTER_CONFIG).write_text(json.dumps({**config, field: value}))
        with pytest.raises(AdapterMergeError, match=f"{ADAPTER_CONFIG}: {field}"):
            merge_adapter(base_dir, adapter, tmp_path / f"merged-{field}")
        assert not (tmp_path / f"merged-{field}").exists()


def test_an_adapter_of_another_shape_is_refused_and_leaves_nothing(base_dir: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other", spec=None, seed=1)
    adapter = _adapter(other, tmp_path / "adapter")
    tensors_dir = tmp_path / "not-an-adapter"
    tensors_dir.mkdir()
    with pytest.raises(AdapterMergeError, match="not a LoRA adapter"):
        merge_adapter(base_dir, tensors_dir, tmp_path / "out")
    # same shapes here (the same tiny spec): a module the base lacks is named instead
    from safetensors.torch import load_file, save_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    renamed = {name.replace("layers.0.", "layers.99."): t for name, t in weights.items()}
    save_file(renamed, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(AdapterMergeError, match=r"adapts 'model\.layers\.99\."):
        merge_adapter(base_dir, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()
