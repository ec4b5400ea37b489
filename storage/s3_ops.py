"""The S3-specific pieces of :mod:`asyncrl.storage.fs`: which errors mean a conditional write
lost (412) or collided (409), how a fault the retries left is raised naming the operation
and the object, an object check that lets faults through, and one round of a bulk delete.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from asyncrl.storage import retry
from asyncrl.storage.errors import StorageOperationError
from asyncrl.storage.retry import RetryPolicy

if TYPE_CHECKING:
    import fsspec


class S3Root(Protocol):
    """What these helpers use of a run root (:class:`~asyncrl.storage.fs.RunRoot`, which uses
    them): its filesystem, its retry policy and its names for messages."""

    @property
    def fs(self) -> fsspec.AbstractFileSystem: ...

    @property
    def retry(self) -> RetryPolicy: ...

    def display(self, relpath: str) -> str: ...


def precondition_failed(exc: BaseException) -> bool:
    """Whether an S3 error is a failed ``If-None-Match`` (HTTP 412, code PreconditionFailed)."""
    return bool({"PreconditionFailed", "412"} & retry.s3_error_codes(exc))


def conditional_conflict(exc: BaseException) -> bool:
    """Whether an S3 error is a 409 ``ConditionalRequestConflict`` (a concurrent conditional write)."""
    return "ConditionalRequestConflict" in retry.s3_error_codes(exc)


@contextmanager
def named_faults(root: S3Root, operation: str, relpath: str) -> Iterator[None]:
    """Raise a transient fault the retries left as :class:`StorageOperationError` naming
    ``operation`` and ``relpath``; every other error passes unchanged."""
    try:
        yield
    except StorageOperationError:
        raise
    except Exception as exc:
        if retry.is_transient(exc):
            raise StorageOperationError(operation, root.display(relpath), root.retry.attempts, exc) from exc
        raise


def s3_is_file(root: S3Root, target: str) -> bool:
    """Whether ``target`` is an object. Unlike ``fs.isfile``, which answers False on any
    error, a fault propagates, so a busy store is never mistaken for a missing object."""
    try:
        return root.fs.info(target)["type"] == "file"
    except FileNotFoundError:
        return False


def s3_delete_tree_round(root: S3Root, target: str) -> list[str]:
    """List ``target`` and delete what is there; return the files the listing showed (none: done)."""
    try:
        found = root.fs.find(target, withdirs=True, detail=True)
    except FileNotFoundError:
        return []
    files = [path for path, info in found.items() if info.get("type") != "directory"]
    if files:
        root.fs.rm(files)
    # Filer-backed stores (SeaweedFS) keep emptied directories as "dir/" entries
    # that listings still show; plain S3 ignores deleting such absent keys.
    directories = [path for path, info in found.items() if info.get("type") == "directory"]
    for directory in sorted(set(directories) | {target}, key=len, reverse=True):
        root.fs.rm_file(directory.rstrip("/") + "/")
    return files
