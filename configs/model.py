"""The ``model`` section: which model a run starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.configs.base import StrictModel


class ModelConfig(StrictModel):
    path: str = Field(min_length=1, description="HF-format model directory (local path or fsspec URI) the run starts from.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype for rollout and training (float32 on CPU)."
    )
