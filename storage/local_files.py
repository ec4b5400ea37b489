"""Durable writes on a local run root: hidden temporary siblings written and fsynced before
a rename, fsyncs of files and directories, and hard links of published objects (no bytes
copied). What :mod:`asyncrl.storage.fs` builds its local primitives on, so that a power
loss leaves the old or the new file, never a partial one.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def _local_temp(final: str) -> tuple[int, str]:
    directory, name = os.path.split(final)
    os.makedirs(directory, exist_ok=True)
    return tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")


def write_local_temp(final: str, data: bytes) -> str:
    fd, tmp = _local_temp(final)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def fsync_path(path: str) -> None:
    """fsync a local file (its data) or directory (the renames and links done in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_durably(source: str, final: str, temp_suffix: str) -> None:
    """Copy ``source`` to ``final`` through a hidden temporary sibling: copy, fsync it,
    rename it over ``final``, fsync the directory. No partial ``final`` is ever visible."""
    directory, name = os.path.split(final)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=temp_suffix)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o644)
        fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(directory)


_LINK_REFUSED = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES})


def hard_link(source: str, local_path: Path) -> bool:
    """Hard-link the local file ``source`` to ``local_path`` (its directory fsynced): no bytes
    copied. False (nothing created) where the filesystem refuses (another filesystem, none
    with hard links); FileNotFoundError when ``source`` is missing.

    Safe for files never written again in place (published weight files: a publish or a
    prune replaces or unlinks names, never bytes)."""
    local_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, local_path)
    except OSError as exc:
        if exc.errno in _LINK_REFUSED:
            return False
        raise
    fsync_path(str(local_path.parent))
    return True


_HASH_CHUNK = 8 * 2**20


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a local file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
