"""Run-root access through fsspec: a local directory or an S3-compatible bucket.

All objects of a run live under one root. The primitives here are the only writes the storage
layer does, and none of them exposes a partial object: :func:`put_if_absent` (never
overwritten; a lost race raises :class:`FileExistsError`), :func:`put_atomic_replace` (small
replaceable pointers), :func:`~asyncrl.storage.compare_and_swap.replace_if` (compare-and-swap
of a pointer) and :func:`upload_file` (large files, hidden behind a marker written afterwards).
Local writes are temp-then-rename with fsyncs, so a power loss leaves the old or the new file,
never a partial one; S3 listings are never cached. Transient S3 faults are retried idempotently
(:mod:`asyncrl.storage.retry`); what is left raises :class:`StorageOperationError` naming the
operation and the object. Per-primitive mechanics: ``docs/internals/storage.md``.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from asyncrl.storage import paths, retry
from asyncrl.storage.errors import StorageOperationError
from asyncrl.storage.retry import RetryPolicy
from asyncrl.storage.local_files import copy_durably, fsync_path, hard_link, write_local_temp
from asyncrl.storage.s3_ops import (
    conditional_conflict,
    named_faults,
    precondition_failed,
    s3_delete_tree_round,
    s3_is_file,
)

_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# AWS answers 409 ConditionalRequestConflict while another conditional write to the
# same key is in flight; the write is retried and then fails (412) or succeeds.
_CONFLICT_ATTEMPTS = 5


@dataclass(frozen=True)
class RunRoot:
    """One run root: the fsspec filesystem and the root path in that filesystem's form."""

    uri: str
    """The URI the root was opened with (no credentials: those live in ``fs``)."""
    fs: fsspec.AbstractFileSystem = field(repr=False, compare=False)
    path: str
    """Root path as ``fs`` expects it: absolute local path or ``bucket/prefix``."""
    retry: RetryPolicy = field(default=RetryPolicy(), compare=False)
    """How S3 requests are retried (unused for local roots)."""

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
    ``secret``, ``client_kwargs``, ``config_kwargs``...). S3 listings are forced
    uncached so that every listing sees other writers. S3 retries follow
    ``config_kwargs.retries`` (botocore's ``mode`` and ``total_max_attempts``), else
    ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS``, else standard mode with 5 attempts;
    the policy is stated explicitly to botocore and given to s3fs as its ``retries``
    (see :mod:`asyncrl.storage.retry`). A local root
    directory is created; an S3 bucket must exist already. Other protocols are
    refused: the atomic put-if-absent of this module is only implemented for local and S3.
    """
    if not uri:
        raise ValueError("run root URI is empty")
    storage_options = dict(options or {})
    protocol = fsspec.core.split_protocol(uri)[0] or "file"
    policy = RetryPolicy()
    if protocol in _S3_PROTOCOLS:
        try:
            policy = retry.retry_policy(storage_options)
        except ValueError as exc:
            raise ValueError(f"run root {uri!r}: {exc}") from None
        storage_options = retry.with_retry_config(storage_options, policy)
        storage_options["use_listings_cache"] = False
    elif protocol not in ("file", "local"):
        raise ValueError(
            f"run root {uri!r}: protocol {protocol!r} is not supported (use a local path, file:// or s3://)"
        )
    fs, root_path = fsspec.core.url_to_fs(uri, **storage_options)
    root_path = root_path.rstrip("/")
    if not root_path:
        raise ValueError(f"run root {uri!r} names no directory or bucket")
    if protocol in _S3_PROTOCOLS:
        # s3fs keeps its call-level retries in an attribute; the instance is shared only
        # by roots with equal options, retry settings included, so they agree on it.
        fs.retries = policy.attempts
    root = RunRoot(uri=uri, fs=fs, path=root_path, retry=policy)
    if root.is_local:
        os.makedirs(root_path, exist_ok=True)
    return root


def _exists_error(root: RunRoot, relpath: str) -> FileExistsError:
    return FileExistsError(errno.EEXIST, "object already exists", root.display(relpath))


def _holds(root: RunRoot, relpath: str, data: bytes) -> bool | None:
    """Whether the object at ``relpath`` holds exactly ``data``; ``None`` if there is none."""
    try:
        return read_bytes(root, relpath) == data
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return False


def put_if_absent(root: RunRoot, relpath: str, data: bytes) -> None:
    """Publish ``data`` at ``relpath`` unless an object is there; never overwrites.

    Idempotent by content: if the object exists and holds exactly ``data``, the call
    succeeds. On S3 this is how a retried conditional PUT is resolved: when the first
    attempt stored the object but its answer was lost (dropped connection, 5xx from
    a proxy), the retry gets 412; the object is then read back, and the call counts as
    done only if the stored bytes equal ``data`` -- nothing is overwritten, and an
    object with other bytes is never taken for ours. A writer that needs to know it
    won (a claim) must put something unique to it in ``data``.
    Otherwise raises :class:`FileExistsError` (naming the object) if ``relpath``
    exists, on every backend (SeaweedFS's ``OSError`` for HTTP 412 is normalised).
    """
    if root.is_local:
        _local_put_if_absent(root, relpath, data)
        return
    target = root.full_path(relpath)
    for attempt in range(1, _CONFLICT_ATTEMPTS + 1):
        try:
            with named_faults(root, "put_if_absent", relpath):
                root.fs.pipe_file(target, data, mode="create")
            return
        except StorageOperationError:
            raise
        except OSError as exc:
            if isinstance(exc, FileExistsError) or precondition_failed(exc):
                holds = _holds(root, relpath, data)
                if holds:
                    return
                if holds is not None:
                    raise _exists_error(root, relpath) from None
                # Deleted between the 412 and the read: the key is free again.
            elif not conditional_conflict(exc) or attempt == _CONFLICT_ATTEMPTS:
                raise
        time.sleep(retry.backoff_s(attempt))
    # Only reached when the key vanished after the last 412: another writer holds it in play.
    raise _exists_error(root, relpath)


def _local_put_if_absent(root: RunRoot, relpath: str, data: bytes) -> None:
    target = root.full_path(relpath)
    tmp = write_local_temp(target, data)
    try:
        os.link(tmp, target)
    except FileExistsError:
        if _holds(root, relpath, data):
            return
        raise _exists_error(root, relpath) from None
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
    fsync_path(os.path.dirname(target))


def put_atomic_replace(root: RunRoot, relpath: str, data: bytes) -> None:
    """Publish ``data`` at ``relpath``, replacing any object there in one atomic step.

    On S3 one plain PUT: retrying it stores the same bytes again, so it is idempotent.
    (A copy held up in the network longer than the client's read timeout could still
    land after a later write; no layer can rule that out for a plain PUT.)
    """
    target = root.full_path(relpath)
    if root.is_local:
        tmp = write_local_temp(target, data)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
        fsync_path(os.path.dirname(target))
        return
    with named_faults(root, "put_atomic_replace", relpath):
        root.fs.pipe_file(target, data)


MULTIPART_MIN_BYTES = 5 * 2**20
"""Smallest file s3fs may upload in parts (S3's minimum part size): smaller files are one PUT."""


def upload_file(root: RunRoot, local_path: Path, relpath: str) -> None:
    """Copy the local file ``local_path`` to ``relpath`` (replacing it if present).

    Local roots get the whole file or nothing at ``relpath`` (fsynced temporary, rename,
    fsynced directory); on S3 a large file is a multipart upload, also visible only once
    complete. Before a file of at least :data:`MULTIPART_MIN_BYTES` is uploaded to S3,
    the incomplete multipart uploads of the same key are aborted: parts of an earlier
    attempt killed mid-upload (s3fs aborts its own upload only when it sees the error).
    Retrying either stores the same bytes again.
    """
    target = root.full_path(relpath)
    if root.is_local:
        copy_durably(str(local_path), target, ".tmp")
        return
    if os.path.getsize(local_path) >= MULTIPART_MIN_BYTES:
        abort_incomplete_uploads(root, relpath, exact=True)
    with named_faults(root, "upload", relpath):
        root.fs.put_file(str(local_path), target)


def abort_incomplete_uploads(root: RunRoot, relpath: str, exact: bool = False) -> list[str]:
    """Abort the incomplete S3 multipart uploads of keys under ``relpath`` (with ``exact``:
    of the key ``relpath`` only); return the relative paths whose uploads were aborted.

    Only keys inside the run root are touched (the listing is filtered by the root's
    prefix, never bucket-wide). An upload still in progress elsewhere fails when it
    completes: call this only where no other writer uploads under ``relpath``. Local
    roots have no such uploads: returns ``[]``.
    """
    if root.is_local:
        return []
    bucket, key, _ = root.fs.split_path(root.full_path(relpath))
    prefix = key if exact else key.rstrip("/") + "/"
    uploads: list[tuple[str, str]] = []
    marker: dict[str, str] = {}
    with named_faults(root, "list_multipart_uploads", relpath):
        while True:
            page = root.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
            uploads.extend(
                (u["Key"], u["UploadId"]) for u in page.get("Uploads", []) or []
                if not exact or u["Key"] == key
            )
            if not page.get("IsTruncated"):
                break
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
    root_key = root.fs.split_path(root.path)[1].rstrip("/")
    aborted: list[str] = []
    for upload_key, upload_id in uploads:
        with named_faults(root, "abort_multipart_upload", relpath):
            try:
                root.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload_key, UploadId=upload_id)
            except FileNotFoundError:
                continue  # NoSuchUpload: completed or aborted meanwhile
        aborted.append(upload_key[len(root_key) + 1 :] if root_key else upload_key)
    return aborted


def link_file(root: RunRoot, relpath: str, local_path: Path) -> bool:
    """Hard-link the object ``relpath`` of a local root to ``local_path``
    (:func:`~asyncrl.storage.local_files.hard_link`): no bytes copied. False (nothing created)
    on an S3 root or where the filesystem refuses; the caller then downloads."""
    if not root.is_local:
        return False
    try:
        return hard_link(root.full_path(relpath), local_path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath)) from None


def download_file(root: RunRoot, relpath: str, local_path: Path) -> None:
    """Copy the object ``relpath`` to the local file ``local_path``, whole or not at all.

    The bytes land in a hidden temporary sibling that is fsynced, renamed to
    ``local_path`` once complete, and its directory fsynced, so a fault or a kill
    mid-download leaves no partial file, and a power loss no empty one.
    """
    source = root.full_path(relpath)
    local_path.parent.mkdir(parents=True, exist_ok=True)
    if root.is_local:
        if not os.path.isfile(source):
            raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
        copy_durably(source, str(local_path), ".part")
        return
    fd, tmp = tempfile.mkstemp(dir=local_path.parent, prefix=f".{local_path.name}.", suffix=".part")
    os.close(fd)
    try:
        with named_faults(root, "download", relpath):
            if not s3_is_file(root, source):
                raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
            root.fs.get_file(source, tmp)
        fsync_path(tmp)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_path(str(local_path.parent))


def read_json_object(root: RunRoot, relpath: str) -> dict[str, Any] | None:
    """The JSON object stored at ``relpath``, None if absent; ``ValueError`` names the object
    if it is not JSON or not an object."""
    try:
        raw = read_bytes(root, relpath)
    except FileNotFoundError:
        return None
    try:
        content = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{root.display(relpath)}: not JSON ({exc})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{root.display(relpath)}: not a JSON object")
    return content


def read_bytes(root: RunRoot, relpath: str) -> bytes:
    """Whole content of the object ``relpath``; :class:`FileNotFoundError` names it if absent."""
    source = root.full_path(relpath)
    try:
        if root.is_local:
            with open(source, "rb") as handle:
                return handle.read()
        with named_faults(root, "read", relpath):
            return bytes(root.fs.cat_file(source))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath)) from None


def read_many(root: RunRoot, relpaths: Iterable[str]) -> dict[str, bytes]:
    """Contents of several objects keyed by relative path (S3: fetched concurrently).

    The first missing object raises :class:`FileNotFoundError`, the first fault
    :class:`StorageOperationError`, each naming its object.
    """
    wanted = list(relpaths)
    if root.is_local or len(wanted) <= 1:
        return {relpath: read_bytes(root, relpath) for relpath in wanted}
    by_full = {root.full_path(relpath): relpath for relpath in wanted}
    with named_faults(root, "read", posixpath.commonpath(wanted) or "."):
        contents = root.fs.cat(list(by_full), on_error="return")
    result: dict[str, bytes] = {}
    for full, relpath in by_full.items():
        content = contents.get(full, FileNotFoundError(full))
        if isinstance(content, FileNotFoundError):
            raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
        if isinstance(content, BaseException):
            with named_faults(root, "read", relpath):
                raise content
        result[relpath] = bytes(content)
    return result


def exists(root: RunRoot, relpath: str) -> bool:
    """Whether an object (or a non-empty directory/prefix) exists at ``relpath``."""
    target = root.full_path(relpath)
    if root.is_local:
        return os.path.exists(target)
    with named_faults(root, "exists", relpath):
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
            with named_faults(root, "list", reldir):
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


def list_tree(root: RunRoot, reldir: str) -> list[str]:
    """Relative paths (to ``reldir``) of every file under ``reldir``, recursively, sorted;
    hidden temporaries included (callers deleting a tree must see them). One paginated
    listing on S3. A missing directory lists empty."""
    target = root.full_path(reldir)
    if root.is_local:
        found = []
        for directory, _, files in os.walk(target):
            found.extend(os.path.relpath(os.path.join(directory, f), target).replace(os.sep, "/") for f in files)
        return sorted(found)
    try:
        with named_faults(root, "list", reldir):
            entries = root.fs.find(target, withdirs=False, detail=True)
    except FileNotFoundError:
        return []
    prefix = target.rstrip("/") + "/"
    return sorted(
        path[len(prefix):] for path, info in entries.items()
        if path.startswith(prefix) and info.get("type") != "directory" and not path.endswith("/")
    )


def delete(root: RunRoot, relpath: str, missing_ok: bool = False) -> None:
    """Delete the object ``relpath``; :class:`FileNotFoundError` names it if absent (unless ``missing_ok``).

    On S3 a DELETE of an absent key succeeds, so a retried DELETE is harmless.
    """
    target = root.full_path(relpath)
    if root.is_local:
        try:
            os.unlink(target)
        except FileNotFoundError:
            if not missing_ok:
                raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath)) from None
        return
    with named_faults(root, "delete", relpath):
        if not missing_ok and not s3_is_file(root, target):
            raise FileNotFoundError(errno.ENOENT, "no such object", root.display(relpath))
        try:
            root.fs.rm_file(target)
        except FileNotFoundError:
            if not missing_ok:
                raise


def delete_tree(root: RunRoot, reldir: str) -> None:
    """Delete everything under ``reldir``; a missing directory is not an error.

    On S3 the keys go in bulk deletes, whose answer reports per-key failures that
    s3fs does not raise; so each round lists what is left and deletes it, until a
    listing is empty, at most ``root.retry.attempts + 1`` rounds (the last one only
    confirms); :class:`OSError` then names the keys still listed.
    """
    target = root.full_path(reldir)
    if root.is_local:
        if os.path.isdir(target):
            shutil.rmtree(target)
        return
    with named_faults(root, "delete_tree", reldir):
        listed = s3_delete_tree_round(root, target)
        rounds = 1
        while listed and rounds <= root.retry.attempts:
            if rounds > 1:
                time.sleep(retry.backoff_s(rounds - 1))
            # This round's listing shows what the last bulk delete left; it deletes that again.
            listed = s3_delete_tree_round(root, target)
            rounds += 1
    if not listed:
        return
    raise OSError(
        errno.EIO,
        f"bulk deletes left {len(listed)} object(s) after {rounds} round(s): {sorted(listed)[:10]}",
        root.display(reldir),
    )


def move_no_overwrite(root: RunRoot, src: str, dst: str) -> None:
    """Move object ``src`` to ``dst`` (copy with put-if-absent, then delete ``src``).

    Raises :class:`FileExistsError` naming ``dst`` if it holds other bytes; ``src`` is
    then kept. A move interrupted between copy and delete completes when repeated
    (put-if-absent of the same bytes succeeds).
    """
    put_if_absent(root, dst, read_bytes(root, src))
    delete(root, src)
