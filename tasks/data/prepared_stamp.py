"""Which settings a synthetic data file was written for: a stamp beside it
(``.<name>.asyncrl-data.json``: the generator's settings and the file's sha256), so that the
data stage rewrites a file written for other settings and never mistakes a user's file, or
one edited since, for its own.

A file's state against the settings S of this run:
- ``absent``: nothing at the path;
- ``current``: stamped with S, and its bytes are those stamped;
- ``stale``: stamped with other settings, bytes unchanged since, or stamped as being written
  by a stage that did not finish (ours: rewrite it);
- ``foreign``: no stamp, or bytes changed since stamped (not ours to replace).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncrl.storage.local_files import file_sha256

STAMP_SUFFIX = ".asyncrl-data.json"
State = Literal["absent", "current", "stale", "foreign"]


@dataclass(frozen=True)
class FileState:
    """A data file's :data:`State`, and in words what differs (``stale`` or ``foreign``)."""

    state: State
    detail: str = ""


def stamp_path(path: Path) -> Path:
    """Where ``path``'s stamp lives: a hidden file beside it."""
    return path.parent / f".{path.name}{STAMP_SUFFIX}"


PENDING = "pending"
"""The sha256 of a stamp written before its file: a stage killed while writing leaves files
that are still recognised as the generator's."""


def write_stamp(path: Path, settings: dict[str, Any], *, pending: bool = False) -> None:
    """Stamp ``path`` with ``settings`` and its sha256 once written, or as :data:`PENDING`
    before it is written; atomically."""
    sha256 = PENDING if pending else file_sha256(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"settings": settings, "sha256": sha256}, sort_keys=True, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(body)
    os.replace(tmp, stamp_path(path))


def file_state(path: Path, settings: dict[str, Any]) -> FileState:
    """``path``'s state against ``settings`` (module docstring)."""
    if not path.exists():
        return FileState("absent")
    try:
        stamp = json.loads(stamp_path(path).read_text(encoding="utf-8"))
        stamped, sha256 = stamp["settings"], stamp["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return FileState("foreign", "it carries no stamp of the synthetic generator")
    if sha256 == PENDING:
        return FileState("stale", "left unfinished by an earlier data stage")
    if file_sha256(path) != sha256:
        return FileState("foreign", "it was changed after the synthetic generator wrote it")
    if stamped == settings:
        return FileState("current")
    return FileState("stale", "written for " + settings_change(stamped, settings))


def settings_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The settings that differ, as ``key: old -> new`` (nested keys dotted)."""
    changes: list[str] = []

    def walk(old: Any, new: Any, prefix: str) -> None:  # noqa: ANN401
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(set(old) | set(new)):
                walk(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        elif old != new:
            changes.append(f"{prefix}: {old!r} -> {new!r}")

    walk(before, after, "")
    return ", ".join(changes) or "other settings"
