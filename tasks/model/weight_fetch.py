"""The one way a process of a run gets a local directory of its weights (:func:`model_weights`).

A published version is fetched from the run's :class:`~asyncrl.storage.weights.WeightStore`
into a local cache, verified against its manifest (:func:`fetch_weight_version`); the run's
base weights are ``model.path``. The cache holds ``<cache_dir>/<root key>/v{version:06d}/``;
a process holds a shared ``flock`` lease on ``.v{version:06d}.lock`` beside it while it
fetches or loads that version, and :func:`prune_weight_cache` never deletes a leased version.
A remote ``model.path`` is copied once into ``<cache_dir>/models/<key>/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

from asyncrl.storage import fs, local_files, paths
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weights import WeightIntegrityError, WeightStore
from asyncrl.tasks.model.checks import ModelPathError, require_model_dir


def cached_version_dir(cache_dir: Path, root_uri: str, version: int) -> Path:
    """``cache_dir/<sha256(root_uri)[:16]>/v{version:06d}``: one cache may serve several runs."""
    root_key = hashlib.sha256(root_uri.encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / root_key / paths.weights_version_dirname(version)


_CACHE_ENTRY = re.compile(r"^\.?(v\d{6,})(?:$|\.)")


def _lease_path(cache_dir: Path, root_uri: str, version: int) -> Path:
    target = cached_version_dir(cache_dir, root_uri, version)
    return target.parent / f".{target.name}.lock"


def _acquire_lease(lock_path: Path, exclusive: bool, blocking: bool) -> int | None:
    """An fd holding a ``flock`` on ``lock_path`` (exclusive or shared); None if not
    ``blocking`` and someone else holds it. Retries when the file was unlinked by a pruner
    between open and lock (the lock must be on the file the path names)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


class VersionLease:
    """The shared lease of one cached version, held from :meth:`take` until :meth:`release`:
    for a process that reads the directory after the call that fetched it returned (a server
    started on it, until its weights are loaded)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def take(cls, cache_dir: Path, root_uri: str, version: int) -> VersionLease:
        fd = _acquire_lease(_lease_path(cache_dir, root_uri, version), exclusive=False, blocking=True)
        return cls(fd)  # type: ignore[arg-type] - blocking acquisition always returns an fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextmanager
def version_lease(cache_dir: Path, root_uri: str, version: int) -> Iterator[None]:
    """Hold the shared lease of a cached version (see the module docstring) for the block:
    :func:`prune_weight_cache` leaves the version alone meanwhile."""
    lease = VersionLease.take(cache_dir, root_uri, version)
    try:
        yield
    finally:
        lease.release()


def prune_weight_cache(cache_dir: Path, root_uri: str, loaded: int) -> list[int]:
    """Delete the cached versions of ``root_uri`` older than ``loaded`` (and their staging
    leftovers and lease files) that no one holds a lease on; return them, ascending."""
    base = cached_version_dir(cache_dir, root_uri, loaded).parent
    versions: set[int] = set()
    for entry in os.listdir(base) if base.is_dir() else []:
        match = _CACHE_ENTRY.match(entry)
        if match is not None:
            versions.add(int(match.group(1)[1:]))
    deleted = []
    for version in sorted(v for v in versions if v < loaded):
        lock_path = _lease_path(cache_dir, root_uri, version)
        fd = _acquire_lease(lock_path, exclusive=True, blocking=False)
        if fd is None:
            continue  # a worker is fetching or loading it
        try:
            name = paths.weights_version_dirname(version)
            for entry in os.listdir(base):
                if entry == name or (entry.startswith(f".{name}.") and entry != lock_path.name):
                    shutil.rmtree(base / entry, ignore_errors=True)
            lock_path.unlink(missing_ok=True)  # still held: a waiter re-opens the path (see _acquire_lease)
        finally:
            os.close(fd)
        deleted.append(version)
    return deleted


def fetch_weight_version(
    root_uri: str, storage_options: dict[str, Any], version: int, cache_dir: Path
) -> tuple[Path, bool]:
    """Local directory of published ``version`` and whether it was already cached.

    By reference (a rollout server's worker opens the store with its own credentials, and
    only when the version is not cached). :meth:`WeightStore.download` renames a fully
    downloaded and verified (sizes and SHA-256) directory into place, so an existing
    directory is complete. The version's shared lease is held while fetching. An
    unpublished version raises :class:`UnknownWeightVersionError` naming it and the
    available ones; a corrupt download :class:`~asyncrl.storage.weights.WeightIntegrityError`.

    A local store on the cache's filesystem is not copied: the cache gets hard links to the
    store's files, verified where they lie (``WeightStore.download(link=True)``). Measured
    with ``asyncrl bench weight-sync``: this drops the copy and its fsync, the slowest part
    of a local fetch.
    """
    return _fetch_cached(root_uri, lambda: WeightStore(open_root(root_uri, dict(storage_options))), version, cache_dir)


def _fetch_cached(
    root_uri: str, open_store: Callable[[], WeightStore], version: int, cache_dir: Path
) -> tuple[Path, bool]:
    target = cached_version_dir(cache_dir, root_uri, version)
    with version_lease(cache_dir, root_uri, version):
        if target.is_dir() and any(target.iterdir()):
            return target, True
        try:
            open_store().download(version, target, link=True)
        except WeightIntegrityError:
            raise
        except (FileExistsError, OSError):
            if target.is_dir() and any(target.iterdir()):  # another process won the race
                return target, True
            raise
    return target, False


def fetch_version(root: RunRoot, version: int, cache_dir: Path) -> Path:
    """Local directory of published ``version`` of the open run root ``root``, fetched into
    ``cache_dir`` once and verified (as :func:`fetch_weight_version`, through the caller's
    own handle on the store)."""
    return _fetch_cached(root.uri, lambda: WeightStore(root), version, cache_dir)[0]


def model_weights(root: RunRoot, model_path: str, version: int | None, cache_dir: Path, *, fetch: bool = True) -> Path:
    """Local directory of the weights of the run at ``root`` at ``version``.

    The rule, the same for every process (servers, evaluator, trainer, stages):

    * a version the store has published: fetched into ``cache_dir`` once, verified
      (:func:`fetch_weight_version`; hard links for a local store);
    * ``None`` (nothing published yet), or version 0 while the store holds none:
      ``model_path`` (``model.path``, the base weights). A local directory is used in place
      and must hold ``config.json`` (:class:`~asyncrl.tasks.model.checks.ModelPathError`
      naming ``model.path``); a remote URI is copied once into ``cache_dir/models/``, into a
      staging directory renamed when complete, so a killed copy is never taken for one;
    * any other version: :class:`~asyncrl.storage.errors.UnknownWeightVersionError`.

    With ``fetch`` False nothing is downloaded or copied: the directory is where another
    process of the machine (the trainer's node leader) puts it.
    """
    if version is not None and (version != 0 or fs.exists(root, paths.weights_complete_marker(0))):
        if not fetch:
            return cached_version_dir(cache_dir, root.uri, version)
        return fetch_version(root, version, cache_dir)
    require_model_dir(model_path)  # a local one; a remote one is checked once copied
    if "://" not in model_path or model_path.startswith("file://"):
        return Path(model_path.removeprefix("file://")).expanduser()
    target = Path(cache_dir).expanduser() / "models" / hashlib.sha256(model_path.encode()).hexdigest()[:16]
    if fetch and not target.is_dir():
        _copy_model(model_path, target)
    return target


def _copy_model(model_uri: str, target: Path) -> None:
    """Copy the remote HF directory ``model_uri`` to ``target`` under an exclusive lock (one
    copy per machine): into a staging sibling, renamed once complete; a killed copy's
    staging leftovers are removed by the next."""
    lock_path = target.parent / f".{target.name}.lock"
    fd = _acquire_lease(lock_path, exclusive=True, blocking=True)
    try:
        if target.is_dir():
            return  # copied while we waited
        for leftover in target.parent.glob(f".{target.name}.*"):
            if leftover != lock_path:
                shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            source_fs, source = fsspec.core.url_to_fs(model_uri)
            source_fs.get(source.rstrip("/") + "/", str(staging), recursive=True)
            if not (staging / "config.json").is_file():
                raise ModelPathError(f"model.path: {model_uri} has no config.json, so it is not a Hugging Face model directory")
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        local_files.fsync_path(str(target.parent))
    finally:
        os.close(fd)  # type: ignore[arg-type] - blocking acquisition always returns an fd
