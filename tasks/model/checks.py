"""Checks of a model directory before anything loads it: a missing local directory is named
with the config key that points at it, not reported by Hugging Face as an invalid Hub id."""

from __future__ import annotations

from pathlib import Path

INIT_HINT = "run init-model or fix the path"


class ModelPathError(FileNotFoundError):
    """A model directory that is not there (or is not an HF model); the message names the key."""


def require_model_dir(path: str, key: str = "model.path", hint: str = INIT_HINT) -> None:
    """Raise :class:`ModelPathError` ``"<key>: <path> does not exist (<hint>)"`` unless
    ``path`` is a local directory holding ``config.json``. A remote URI (``s3://...``) is
    left to what reads it."""
    if "://" in path and not path.startswith("file://"):
        return
    local = Path(path.removeprefix("file://")).expanduser()
    if not local.exists():
        raise ModelPathError(f"{key}: {path} does not exist ({hint})")
    if not local.is_dir():
        raise ModelPathError(f"{key}: {path} is not a directory ({hint})")
    if not (local / "config.json").is_file():
        raise ModelPathError(f"{key}: {path} has no config.json, so it is not a Hugging Face model directory ({hint})")
