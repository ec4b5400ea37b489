"""Text <-> token ids: the :class:`TextCodec` protocol the scheduler and the evaluator use,
and :class:`HFCodec`, the model's own tokenizer behind it (:func:`load_codec`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from asyncrl.tasks.model.checks import require_model_dir


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class HFCodec:
    """Prompt text <-> token ids with the model's own tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_codec(model_dir: str, key: str = "model.path") -> tuple[HFCodec, tuple[int, ...]]:
    """The tokenizer and the stop token ids (eos of the tokenizer and generation config).

    A local ``model_dir`` that is missing (or holds no ``config.json``) raises
    :class:`~asyncrl.tasks.model.checks.ModelPathError` naming ``key`` and the path."""
    from transformers import AutoTokenizer, GenerationConfig

    require_model_dir(model_dir, key)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    stop.update([eos] if isinstance(eos, int) else list(eos or []))
    return HFCodec(tokenizer), tuple(sorted(stop))
