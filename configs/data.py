"""The ``data`` section: the prompt files of a run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.configs.base import StrictModel


class DataConfig(StrictModel):
    train_path: str = Field(min_length=1, description="RL prompt file: Parquet or GSM8K-style JSONL.")
    """Parquet (`prompt`, `answer`) or GSM8K-style JSONL (`question`, `answer`)."""
    eval_path: str | None = Field(None, description="Held-out prompts for evaluation; None disables evaluation.")
    sft_path: str | None = Field(None, description="Warm-start examples for the SFT stage; None trains it on `train_path`.")
    """Rows `prompt`, `answer`, optional `solution`, kept apart from the RL prompts."""
    max_prompt_tokens: int = Field(128, ge=1, description="Prompts longer than this (in tokens) are refused by the scheduler.")
    prompt_format: Literal["plain", "chat"] = Field(
        "plain", description="`plain`: question + newline; `chat`: the tokenizer's chat template (instruct models)."
    )
