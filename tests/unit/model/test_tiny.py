"""The tiny Qwen2 model directory: loads with transformers, deterministic, guarded writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from asyncrl.tasks.model.tiny import TinyModelSpec, write_tiny_model


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_directory_layout_and_config(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    assert not any(name.startswith(".") for name in names)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] % 64 == 0
    assert not [p for p in tiny_model_dir.parent.iterdir() if p.name.endswith(".tmp")]


def test_weights_are_float32(tiny_model_dir: Path) -> None:
    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"F32"}


def test_loads_with_transformers_and_runs_forward(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    batch = tokenizer(["What is 3+4*2?", "What is 12-5?"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits  # (B, T, V)
    assert logits.shape == (2, batch["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_parameter_count(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    count = sum(p.numel() for p in model.parameters())
    assert count == TinyModelSpec().num_parameters()
    assert 1_000_000 <= count <= 10_000_000


def test_tokenizer_round_trips_one_token_per_byte(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "What is 12+34*5-6?\n0123456789 +-*/=()#### -42 Ünïcode €"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte values are the ids; no BOS is added
    assert tokenizer.decode(ids) == text
    for symbol in "0123456789+-*/=#\n ":
        assert tokenizer(symbol)["input_ids"] == [ord(symbol)]


def test_tokenizer_special_tokens_and_size(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == config.eos_token_id == 256
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id == config.pad_token_id == 257
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [258, 259]
    assert tokenizer.decode([51, 256, 52], skip_special_tokens=True) == "34"
    # Every id the model can sample decodes to a string.
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(config.vocab_size))


def test_tokenizer_json_agrees_with_auto_tokenizer(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "e\u0301 caf\u00e9 3*4 <|im_end|>"  # a decomposed accent (NFC-normalised by both)
    assert raw.encode(text).ids == auto(text)["input_ids"]
    assert raw.encode(text).ids[-1] == 259


def test_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_generation_config_stops_on_both_end_tokens(tiny_model_dir: Path) -> None:
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert generation.eos_token_id == [256, 259]
    assert generation.pad_token_id == 257


def test_deterministic_by_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    same = write_tiny_model(tmp_path / "same", seed=0)
    other = write_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert digest(same / name) == digest(tiny_model_dir / name), name
    assert digest(other / "model.safetensors") != digest(tiny_model_dir / "model.safetensors")
    assert digest(other / "tokenizer.json") == digest(tiny_model_dir / "tokenizer.json")


def test_does_not_touch_the_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    write_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_refuses_to_overwrite_a_non_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=rf"{target}: directory is not empty; pass overwrite=True"):
        write_tiny_model(target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]  # no staging directory left behind


def test_overwrite_replaces_and_empty_directory_is_accepted(tmp_path: Path, tiny_model_dir: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    write_tiny_model(target, overwrite=True)
    assert not (target / "keep.txt").exists()
    assert digest(target / "model.safetensors") == digest(tiny_model_dir / "model.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (write_tiny_model(empty) / "config.json").exists()


def test_refuses_a_file_path(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        write_tiny_model(target)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 250}, r"hidden_size \(250\) must be a multiple of num_heads \(4\)"),
        ({"num_kv_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        ({"vocab_size": 100}, "vocab_size must be >= 260"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
    ],
)
def test_spec_rejects_bad_shapes(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyModelSpec(**kwargs)


def test_custom_spec_is_honoured(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(
        hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256, vocab_size=384
    )
    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "m", spec=spec))
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters()
    assert model.model.layers[0].self_attn.head_dim == 64 and model.config.vocab_size == 384
