"""Content cache keys of the pipeline's batch stages.

A stage's key is ``sha256(stage name, code version, the stage's config section, the content
digests of its inputs)``, so a re-run of the same config with the same files skips the stage
(Prefect state "Cached") while a changed setting, a changed data file or model, or changed
code redoes it and, through the digests of its outputs, every stage after it. Paths enter a
key only as the place an input is read from; what counts is the bytes there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import fsspec

PACKAGE_DIR = Path(__file__).resolve().parents[2]
"""The asyncrl package (the repository root)."""
CODE_DIRS = ("configs", "flows", "storage", "tasks")


@cache
def code_version() -> str:
    """sha256 of the package's source (the ``.py`` files of flows/, tasks/, storage/, configs/,
    by relative path and content), first 16 hex digits. Cached per process: the code of a
    running process does not change."""
    digest = hashlib.sha256()
    for top in CODE_DIRS:
        for path in sorted((PACKAGE_DIR / top).rglob("*.py")):
            digest.update(str(path.relative_to(PACKAGE_DIR)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def content_digest(location: str | Path | None, storage_options: dict[str, Any] | None = None) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative path and bytes, sorted),
    first 16 hex digits; ``"absent"`` when nothing is there (local path or fsspec URL)."""
    if location is None:
        return "absent"
    filesystem, path = fsspec.core.url_to_fs(str(location), **(storage_options or {}))
    if not filesystem.exists(path):
        return "absent"
    digest = hashlib.sha256()
    if filesystem.isdir(path):
        for name in sorted(filesystem.find(path)):
            digest.update(name[len(path) :].encode())
            with filesystem.open(name, "rb") as handle:
                _update(digest, handle)
    else:
        with filesystem.open(path, "rb") as handle:
            _update(digest, handle)
    return digest.hexdigest()[:16]


def _update(digest: Any, handle: Any) -> None:  # noqa: ANN401 - hashlib and fsspec objects
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)


def stage_key(
    stage: str, settings: Any, inputs: Iterable[str | Path | None], with_code: bool = True  # noqa: ANN401 - JSON-able
) -> str:
    """The cache key of ``stage`` (see the module docstring): ``settings`` is its config
    section as JSON-able data, ``inputs`` the files or directories it reads. Without
    ``with_code`` it names what the stage computes from, not the code that computed it."""
    payload = {
        "stage": stage,
        "code": code_version() if with_code else None,
        "settings": settings,
        "inputs": [content_digest(location) for location in inputs],
    }
    return f"{stage}-{hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]}"
