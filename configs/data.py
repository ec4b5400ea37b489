"""The ``data`` section: the prompt files of a run."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field

from asyncrl.configs.base import StrictModel

DATA_FILE_SUFFIXES: tuple[str, ...] = (".parquet", ".pq", ".jsonl", ".json", ".yaml", ".yml")
"""The extensions the loader reads (``tasks/data/loader.py``: Parquet, JSON Lines, a mixture);
a test keeps the two lists equal."""


def is_data_folder(path: str) -> bool:
    """Whether ``path`` names a folder or prefix of data files rather than one file: it ends
    with ``/``, or its last part has none of :data:`DATA_FILE_SUFFIXES`. Decided from the text
    alone (no I/O), so a config is checked before anything is read and an empty S3 prefix is
    still a folder."""
    if path.endswith("/"):
        return True
    return PurePosixPath(path.split("?", 1)[0]).suffix.lower() not in DATA_FILE_SUFFIXES


class DataConfig(StrictModel):
    train_path: str = Field(
        min_length=1, description="RL prompts: a Parquet or GSM8K-style JSONL file, or a folder/prefix of them."
    )
    """Parquet (`prompt`, `answer`) or GSM8K-style JSONL (`question`, `answer`). A path ending
    in ``/`` or without a data-file extension is a folder (local or ``s3://`` prefix) whose
    ``.parquet``/``.pq``/``.jsonl``/``.json`` files, found recursively and sorted by path (names
    starting with ``.`` or ``_`` skipped), may grow between runs: each run of the pipeline
    trains on the files no earlier run of ``pipeline.registered_model`` trained on
    (``replay_fraction``, ``require_new_files``)."""
    replay_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Folder: replay ceil(this x new files) earlier files, picked by seed."
    )
    """Counted in files, not rows: the choice then needs no reads of the earlier files and a
    file is what the runs record; give a folder's files similar sizes for a share of rows.
    The picks: :func:`asyncrl.tasks.data.train_selection.select_train_files`."""
    require_new_files: bool = Field(
        False, description="End the run as Skipped, before SFT and RL, when no train file is new."
    )
    """New: no earlier run of ``pipeline.registered_model`` trained on that URI with that
    content (a rewritten file is new). Off, a run with nothing new trains on every file."""
    eval_path: str | None = Field(None, description="Held-out prompts for evaluation; None disables evaluation.")
    sft_path: str | None = Field(None, description="Warm-start examples for the SFT stage; None trains it on `train_path`.")
    """Rows `prompt`, `answer`, optional `solution`, kept apart from the RL prompts."""
    max_prompt_tokens: int = Field(128, ge=1, description="Prompts longer than this (in tokens) are refused by the scheduler.")
    prompt_format: Literal["plain", "chat"] = Field(
        "plain", description="`plain`: question + newline; `chat`: the tokenizer's chat template (instruct models)."
    )

    @property
    def train_folder(self) -> bool:
        """``train_path`` names a folder of data files (:func:`is_data_folder`)."""
        return is_data_folder(self.train_path)
