"""A tiny randomly initialised Qwen2 causal LM, written as an HF model directory.

No model hub is reachable in tests and the demo, so they start from this directory;
it goes through the same loading code (transformers, vLLM) as a user's Qwen checkpoint.
Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32),
and the byte-level tokenizer of :mod:`asyncrl.tasks.model.tokenizer`.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.tasks.model.tokenizer import (
    EOS_TOKEN,
    IM_END_TOKEN,
    MIN_VOCAB_SIZE,
    PAD_TOKEN,
    build_tokenizer,
    special_token_ids,
)

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2Config


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; head_dim = hidden_size / num_heads.

    Parameters (tied embeddings) = V*H + L*(H*H + 2*H*Hkv + H*H + (H + 2*Hkv)
    + 3*H*I + 2*H) + H, with V vocab, H hidden, Hkv = num_kv_heads * head_dim,
    I intermediate, L layers: about 3.0 M for the defaults.
    """

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    vocab_size: int = 320
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TinyModelSpec.{name} must be >= 1, got {value}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyModelSpec: hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyModelSpec: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"TinyModelSpec.vocab_size must be >= {MIN_VOCAB_SIZE}, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        """The formula in the class docstring."""
        h, v, i, layers = self.hidden_size, self.vocab_size, self.intermediate_size, self.num_layers
        h_kv = self.num_kv_heads * self.head_dim
        attention = h * h + 2 * h * h_kv + h * h + (h + 2 * h_kv)  # q, k, v, o weights; q, k, v biases
        per_layer = attention + 3 * h * i + 2 * h  # gate/up/down; two RMSNorms
        return v * h + layers * per_layer + h


def tiny_qwen2_config(spec: TinyModelSpec) -> Qwen2Config:
    """The transformers config of ``spec`` (float32, tied embeddings, no sliding window)."""
    from transformers import Qwen2Config

    ids = special_token_ids()
    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=ids[EOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    for parent in out_dir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{out_dir}: is under {parent}, a file, not a directory; choose another directory")
            break
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: directory is not empty; pass overwrite=True (--overwrite) to replace it")


def _save_model_files(target: Path, spec: TinyModelSpec, seed: int, dtype: torch.dtype | None = None) -> None:
    """The model (float32, or created and saved in ``dtype``), generation config and tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    config = tiny_qwen2_config(spec)
    # A private RNG scope: the weights depend on `seed` only, and the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if dtype is None:
            model = Qwen2ForCausalLM(config).float()
        else:
            config.dtype = str(dtype).removeprefix("torch.")
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = Qwen2ForCausalLM(config)
            finally:
                torch.set_default_dtype(previous)
    model.save_pretrained(target, safe_serialization=True)
    ids = special_token_ids()
    GenerationConfig(
        bos_token_id=ids[EOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    ).save_pretrained(target)
    build_tokenizer(spec.vocab_size, spec.max_position_embeddings).save_pretrained(target)


def write_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    spec: TinyModelSpec | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a tiny Qwen2 model directory at ``out_dir`` and return its path.

    Deterministic in (seed, spec). Refuses a non-empty ``out_dir`` unless ``overwrite``.
    The files are written to a sibling temporary directory and renamed into place, so
    ``out_dir`` never holds a partial model.
    """
    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the model directory is not
        _save_model_files(staging, spec, seed)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # name the target, not a temp file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir)) from exc
        raise
    return out_dir


QWEN25_05B_SPEC = TinyModelSpec(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
)
"""The shape of Qwen2.5-0.5B (tied embeddings): 494,032,768 parameters by
:meth:`TinyModelSpec.num_parameters`."""


def write_qwen2_model(
    out_dir: Path,
    spec: TinyModelSpec,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """Write a randomly initialised Qwen2 model of shape ``spec`` in ``dtype`` (a torch
    dtype name, e.g. ``bfloat16``) at ``out_dir``, with the byte-level tokenizer of
    :func:`write_tiny_model`; return its path.

    The weights are initialised in ``dtype`` directly (no float32 copy of a large model).
    Deterministic in (seed, spec, dtype). Refuses a non-empty ``out_dir`` unless
    ``overwrite``; written to a sibling temporary directory and renamed into place.
    """
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"write_qwen2_model: dtype must name a torch floating-point dtype, got {dtype!r}")
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        staging.chmod(0o755)
        _save_model_files(staging, spec, seed, torch_dtype)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
