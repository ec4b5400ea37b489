"""Compare-and-swap of a small object (:func:`replace_if`): the decision and the write are one
atomic step against every other writer, by an ``flock`` on a local root and by a
conditional PUT (``If-Match`` / ``If-None-Match``) on S3. Used to move pointers such as
``weights/latest`` only forward.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable

from asyncrl.storage import fs, retry
from asyncrl.storage.errors import StorageOperationError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.s3_ops import conditional_conflict, named_faults, precondition_failed


_REPLACE_IF_ATTEMPTS = 20


def replace_if(root: RunRoot, relpath: str, data: bytes, accept: Callable[[bytes | None], bool]) -> bool:
    """Store ``data`` at ``relpath`` if ``accept(current)`` is true for the bytes it
    would replace (``None``: no object); a compare-and-swap. Returns whether the object
    holds ``data`` afterwards.

    The decision and the write are one atomic step against every other caller:

    * local: read, ``accept`` and the temporary + ``os.replace`` run under an exclusive
      ``flock`` of ``.{name}.lock`` in the same directory (released by the kernel when the
      holder dies, so a killed writer never blocks the next one);
    * S3: read the object and its ETag, then ``PutObject`` with ``If-Match: <etag>``
      (``If-None-Match: *`` if there was none). 412 or 409 means another writer got in
      first: read again and decide again, at most ``_REPLACE_IF_ATTEMPTS`` times (each
      failure is someone else's success, so only a livelock of writers exhausts them;
      :class:`OSError` names the object then). A retried PUT whose first attempt landed
      gets 412, reads ``data`` back, and ``accept`` then decides as for any other content.
    """
    target = root.full_path(relpath)
    if root.is_local:
        directory, name = os.path.split(target)
        os.makedirs(directory, exist_ok=True)
        lock_fd = os.open(os.path.join(directory, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            current = _read_or_none(root, relpath)
            if not accept(current):
                return current == data
            fs.put_atomic_replace(root, relpath, data)
            return True
        finally:
            os.close(lock_fd)  # releases the flock
    bucket, key, _ = root.fs.split_path(target)
    for attempt in range(1, _REPLACE_IF_ATTEMPTS + 1):
        with named_faults(root, "replace_if", relpath):
            try:
                etag: str | None = root.fs.info(target).get("ETag")
                if not etag:
                    raise OSError(errno.ENOTSUP, "the store gives no ETag to condition a replace on", root.display(relpath))
            except FileNotFoundError:
                etag = None
        current = None if etag is None else _read_or_none(root, relpath)
        if current is None:
            etag = None
        if not accept(current):
            return current == data
        match = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        try:
            with named_faults(root, "replace_if", relpath):
                root.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **match)
            root.fs.invalidate_cache(target)
            return True
        except StorageOperationError:
            raise
        except OSError as exc:
            lost = isinstance(exc, FileExistsError) or precondition_failed(exc) or conditional_conflict(exc)
            if not lost:
                raise
        time.sleep(retry.backoff_s(min(attempt, 3)))
    raise OSError(
        errno.EAGAIN, f"conditional replace lost to other writers {_REPLACE_IF_ATTEMPTS} times", root.display(relpath)
    )


def _read_or_none(root: RunRoot, relpath: str) -> bytes | None:
    try:
        return fs.read_bytes(root, relpath)
    except FileNotFoundError:
        return None
