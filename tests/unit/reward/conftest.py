"""Fixtures shared by the reward unit tests."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest


@pytest.fixture
def removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, dict[str, str]]:
    """cgroupfs's rmdir for directories under tmp_path: a cgroup with only its interface files
    goes (a plain directory would not: ENOTEMPTY), one with a child cgroup is EBUSY. Returns
    what each removed cgroup's files held when it went, by directory path."""
    real_rmdir = os.rmdir
    log: dict[str, dict[str, str]] = {}

    def rmdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        directory = Path(path)
        if tmp_path not in directory.parents:
            return real_rmdir(path, *args, **kwargs)  # type: ignore[arg-type]
        if any(p.is_dir() for p in directory.iterdir()):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(directory))
        log[str(directory)] = {f.name: f.read_text() for f in directory.iterdir()}
        for f in directory.iterdir():
            f.unlink()
        real_rmdir(directory)

    monkeypatch.setattr(os, "rmdir", rmdir)
    return log
