"""Run-root access through fsspec: a local directory or an S3-compatible bucket.

All objects of a run live under one root. The primitives here are the only
writes the storage layer does, and none of them exposes a partial object:

* :func:`put_if_absent` publishes an object that must never be overwritten
  (shards, ledger entries, markers). Local: write a hidden temporary file in the
  same directory, ``os.link`` it to the final name (which fails if the name
  exists), unlink the temporary. S3: one ``PutObject`` with ``If-None-Match: *``.
  Either way a lost race raises :class:`FileExistsError`.
* :func:`put_atomic_replace` publishes a small pointer object that may be
  replaced (local: temporary + ``os.replace``; S3: one ``PutObject``).
* :func:`upload_file` copies a local file in (local: temporary + ``os.replace``;
  S3: ``put_file``, multipart for large files). Callers hide such files behind a
  marker written afterwards.

Temporary files start with ``.`` and :func:`list_dir` never returns such names.
S3 listings are never cached (``use_listings_cache=False``), so objects written
by other processes are always seen.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from asyncrl.storage import paths

_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# AWS answers 409 ConditionalRequestConflict while another conditional write to the
# same key is in flight; the write is retried and then fails (412) or succeeds.
_CONFLICT_RETRIES = 5
_CONFLICT_BACKOFF_S = 0.05


@dataclass(frozen=True)
class RunRoot:
    """One run root: the fsspec filesystem and the root path in that filesystem's form."""

    uri: str
    """The URI the root was opened with (no credentials: those live in ``fs``)."""
    fs: fsspec.AbstractFileSystem = field(repr=False, compare=False)
    path: str
    """Root path as ``fs`` expects it: absolute local path or ``bucket/prefix``."""

    @property
    def is_local(self) -> bool:
        """Whether the root is a local directory (written with ``os`` calls)."""
        return isinstance(self.fs, LocalFileSystem)

    def full_path(self, relpath: str) -> str:
        """Path of ``relpath`` in ``fs``'s form (checked by :func:`paths.join`)."""
        return f"{self.path}/{paths.join(relpath)}"

    def display(self, relpath: str) -> str:
        """``relpath`` as a URI for messages: ``{uri}/{relpath}``."""
        return f"{self.uri.rstrip('/')}/{relpath}"


def open_root(uri: str, options: dict[str, Any] | None = None) -> RunRoot:
    """Open the run root ``uri`` (plain path, ``file://``, or ``s3://bucket/prefix``).

    ``options`` are fsspec storage options (for S3: ``endpoint_url``, ``key``,
    ``secret``, ``client_kwargs``...). S3 listings are forced uncached so that
    every listing sees other writers. A local root directory is created; an S3
    bucket must exist already. Other protocols are refused: the atomic
    put-if-absent of this module is only implemented for local and S3.
    """
    if not uri:
        raise ValueError("run root URI is empty")
    storage_options = dict(options or {})
    protocol = fsspec.core.split_protocol(uri)[0] or "file"
    if protocol in _S3_PROTOCOLS:
        storage_options["use_listings_cache"] = False
    elif protocol not in ("file", "local"):
        raise ValueError(
            f"run root {uri!r}: protocol {protocol!r} is not supported (use a local path, file:// or s3://)"
        )
    fs, root_path = fsspec.core.url_to_fs(uri, **storage_options)
    root_path = root_path.rstrip("/")
    if not root_path:
        raise ValueError(f"run root {uri!r} names no directory or bucket")
    root = RunRoot(uri=uri, fs=fs, path=root_path)
    if root.is_local:
        os.makedirs(root_path, exist_ok=True)
    return root


def _s3_error_codes(exc: BaseException) -> set[str]:
    """Error codes and HTTP statuses of the botocore errors in ``exc``'s cause chain."""
    codes: set[str] = set()
    current: BaseException | None = exc
    while current is not None:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            codes.add(str(response.get("Error", {}).get("Code", "")))
            codes.add(str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")))
        current = current.__cause__ or current.__context__
    return codes


def _precondition_failed(exc: BaseException) -> bool:
    """Whether an S3 error is a failed ``If-None-Match`` (HTTP 412, code PreconditionFailed)."""
    return bool({"PreconditionFailed", "412"} & _s3_error_codes(exc))


def _conditional_conflict(exc: BaseException) -> bool:
    """Whether an S3 error is a 409 ``ConditionalRequestConflict`` (a concurrent conditional write)."""
    return "ConditionalRequestConflict" in _s3_error_codes(exc)


def _local_temp(final: str) -> tuple[int, str]:
    directory, name = os.path.split(final)
    os.makedirs(directory, exist_ok=True)
    return tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")


def _write_local_temp(final: str, data: bytes) -> str:
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


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_if_absent(root: RunRoot, relpath: str, data: bytes) -> None:
    """Publish ``data`` at ``relpath`` unless an object is there; never overwrites.

    Raises :class:`FileExistsError` (naming the object) if ``relpath`` exists,
    on every backend (SeaweedFS's ``OSError`` for HTTP 412 is normalised).
    """
    target = root.full_path(relpath)
    if root.is_local:
        tmp = _write_local_temp(target, data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "object already exists", root.display(relpath)) from None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise OSError(
                    exc.errno,
                    "the filesystem of this run root does not support hard links, which put-if-absent needs",
                    root.display(relpath),
                ) from exc
            raise
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(target))
        return
    for attempt in range(_CONFLICT_RETRIES):
        try:
            root.fs.pipe_file(target, data, mode="create")
            return
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "object already exists", root.display(relpath)) from None
        except OSError as exc:
            if _precondition_failed(exc):
                raise FileExistsError(errno.EEXIST, "object already exists", root.display(relpath)) from exc
            if not _conditional_conflict(exc) or attempt == _CONFLICT_RETRIES - 1:
                raise
        time.sleep(_CONFLICT_BACKOFF_S * (attempt + 1))


def put_atomic_replace(root: RunRoot, relpath: str, data: bytes) -> None:
    """Publish ``data`` at ``relpath``, replacing any object there in one atomic step."""
    target = root.full_path(relpath)
    if root.is_local:
        tmp = _write_local_temp(target, data)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(target))
        return
    root.fs.pipe_file(target, data)


def upload_file(root: RunRoot, local_path: Path, relpath: str) -> None:
    """Copy the local file ``local_path`` to ``relpath`` (replacing it if present).

    Local roots get the whole file or nothing at ``relpath``; on S3 a large file
    is a multipart upload, also visible only once complete.
    """
    target = root.full_path(relpath)
    if root.is_local:
        fd, tmp = _local_temp(target)
        os.close(fd)
        try:
            shutil.copyfile(local_path, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    root.fs.put_file(str(local_path), target)


def download_file(root: RunRoot, relpath: str, local_path: Path) -> None:
    """Copy the object ``relpath`` to the local file ``local_path``."""
    source = root.full_path(relpath)
    local_path.parent.mkdir(parents=True, exist_ok=True)
    if root.is_local:
        if not os.path.isfile(source):
            raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
        shutil.copyfile(source, local_path)
        return
    if not root.fs.isfile(source):
        raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
    root.fs.get_file(source, str(local_path))


def read_bytes(root: RunRoot, relpath: str) -> bytes:
    """Whole content of the object ``relpath``; :class:`FileNotFoundError` names it if absent."""
    source = root.full_path(relpath)
    try:
        if root.is_local:
            with open(source, "rb") as handle:
                return handle.read()
        return bytes(root.fs.cat_file(source))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath)) from None


def read_many(root: RunRoot, relpaths: Iterable[str]) -> dict[str, bytes]:
    """Contents of several objects keyed by relative path (S3: fetched concurrently)."""
    wanted = list(relpaths)
    if root.is_local or len(wanted) <= 1:
        return {relpath: read_bytes(root, relpath) for relpath in wanted}
    by_full = {root.full_path(relpath): relpath for relpath in wanted}
    try:
        contents = root.fs.cat(list(by_full), on_error="raise")
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, "no such object", str(exc)) from None
    missing = set(by_full) - set(contents)
    if missing:
        raise FileNotFoundError(errno.ENOENT, "objects not returned", sorted(missing))
    return {by_full[full]: bytes(contents[full]) for full in by_full}


def exists(root: RunRoot, relpath: str) -> bool:
    """Whether an object (or a non-empty directory/prefix) exists at ``relpath``."""
    target = root.full_path(relpath)
    if root.is_local:
        return os.path.exists(target)
    return bool(root.fs.exists(target))


def list_dir(root: RunRoot, reldir: str) -> list[str]:
    """Sorted names (not paths) of the entries directly under ``reldir``.

    Files and sub-directories (S3: common prefixes) are both listed; names that
    start with ``.`` (temporary files) are not. A missing directory lists empty.
    """
    target = root.full_path(reldir)
    if root.is_local:
        try:
            names = os.listdir(target)
        except FileNotFoundError:
            return []
    else:
        try:
            entries = root.fs.ls(target, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = []
        for entry in entries:
            entry = entry.rstrip("/")
            if entry == target:
                continue  # a directory marker object for the prefix itself
            names.append(entry.rsplit("/", 1)[-1])
    return sorted(name for name in set(names) if name and not name.startswith("."))


def delete(root: RunRoot, relpath: str, missing_ok: bool = False) -> None:
    """Delete the object ``relpath``; :class:`FileNotFoundError` names it if absent (unless ``missing_ok``)."""
    target = root.full_path(relpath)
    if root.is_local:
        try:
            os.unlink(target)
        except FileNotFoundError:
            if not missing_ok:
                raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath)) from None
        return
    if not missing_ok and not root.fs.isfile(target):
        raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
    try:
        root.fs.rm_file(target)
    except FileNotFoundError:
        if not missing_ok:
            raise


def delete_tree(root: RunRoot, reldir: str) -> None:
    """Delete everything under ``reldir``; a missing directory is not an error."""
    target = root.full_path(reldir)
    if root.is_local:
        if os.path.isdir(target):
            shutil.rmtree(target)
        return
    try:
        found = root.fs.find(target, withdirs=True, detail=True)
    except FileNotFoundError:
        return
    files = [path for path, info in found.items() if info.get("type") != "directory"]
    if files:
        root.fs.rm(files)
    # Filer-backed stores (SeaweedFS) keep emptied directories as "dir/" entries
    # that listings still show; plain S3 ignores deleting such absent keys.
    directories = [path for path, info in found.items() if info.get("type") == "directory"]
    for directory in sorted(set(directories) | {target}, key=len, reverse=True):
        root.fs.rm_file(directory.rstrip("/") + "/")


def move_no_overwrite(root: RunRoot, src: str, dst: str) -> None:
    """Move object ``src`` to ``dst`` (copy with put-if-absent, then delete ``src``).

    Raises :class:`FileExistsError` naming ``dst`` if it exists; ``src`` is then kept.
    """
    put_if_absent(root, dst, read_bytes(root, src))
    delete(root, src)
