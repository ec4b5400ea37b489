"""Published policy weights: ``weights/v{version:06d}/`` plus the ``weights/LATEST`` pointer.

Publishing a version uploads every file of a local HF-format directory, then
writes the ``_COMPLETE`` manifest (put-if-absent; it lists each file and its
size), then replaces the ``LATEST`` pointer. A version counts as published only
once its manifest exists, so readers never load a half-uploaded version, and the
pointer never names an incomplete one. Versions are strictly increasing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import RunRoot

MANIFEST_FORMAT = 1
REQUIRED_FILES = ("config.json",)
WEIGHT_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class LatestPointer:
    """Content of ``weights/LATEST``."""

    version: int
    published_at: float


def _check_version(version: int) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be a non-negative int, got {version!r}")


def _local_files(local_dir: Path) -> dict[str, Path]:
    """Files under ``local_dir`` by POSIX relative name (hidden files and dirs skipped)."""
    if not local_dir.is_dir():
        raise ValueError(f"weights directory {local_dir} does not exist or is not a directory")
    files: dict[str, Path] = {}
    for path in sorted(local_dir.rglob("*")):
        relative = path.relative_to(local_dir)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        files[relative.as_posix()] = path
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise ValueError(f"weights directory {local_dir} lacks {missing}")
    if not any(name.endswith(WEIGHT_SUFFIX) for name in files):
        raise ValueError(f"weights directory {local_dir} holds no *{WEIGHT_SUFFIX} file")
    if paths.WEIGHTS_COMPLETE_MARKER in files:
        raise ValueError(f"weights directory {local_dir} holds a file named {paths.WEIGHTS_COMPLETE_MARKER}")
    return files


class WeightStore:
    """Publishes, lists, downloads and prunes weight versions of one run root."""

    def __init__(self, root: RunRoot) -> None:
        self._root = root

    def latest(self) -> int | None:
        """Version named by the ``LATEST`` pointer, or ``None`` before the first publish."""
        pointer = self.latest_pointer()
        return None if pointer is None else pointer.version

    def latest_pointer(self) -> LatestPointer | None:
        """The parsed ``LATEST`` pointer, or ``None`` if absent; ``ValueError`` names a corrupt one."""
        try:
            raw = fs.read_bytes(self._root, paths.WEIGHTS_LATEST)
        except FileNotFoundError:
            return None
        source = self._root.display(paths.WEIGHTS_LATEST)
        try:
            content = json.loads(raw)
            pointer = LatestPointer(version=content["version"], published_at=float(content["published_at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}: corrupt weights pointer ({exc}): {raw[:200]!r}") from None
        if isinstance(pointer.version, bool) or not isinstance(pointer.version, int) or pointer.version < 0:
            raise ValueError(f"{source}: version {pointer.version!r} is not a non-negative int")
        return pointer

    def list_versions(self) -> list[int]:
        """Complete (published) versions, ascending."""
        return sorted(v for v in self._version_dirs() if self._is_complete(v))

    def newest_complete(self) -> int | None:
        """The highest complete version, or ``None`` before the first publish. It is ahead of
        ``LATEST`` when a publisher died between writing a manifest and moving the pointer;
        a publisher resuming must continue after it (``publish`` refuses a complete version)."""
        return max(self.list_versions(), default=None)

    def publish(self, version: int, local_dir: Path) -> None:
        """Upload ``local_dir`` as ``version``, then its manifest, then move ``LATEST`` to it.

        ``local_dir`` must hold ``config.json`` and at least one ``*.safetensors``
        (tokenizer files and others are copied too). ``ValueError`` names the
        version if it is not greater than the pointer's and every complete
        version, or is already complete.
        Leftovers of an interrupted publish of the same version are replaced.
        """
        _check_version(version)
        files = _local_files(Path(local_dir))
        latest = self.latest()
        if latest is not None and version <= latest:
            raise ValueError(f"weight version {version} is not newer than the latest published version {latest}")
        existing = self._version_dirs()
        for other in sorted(v for v in existing if v >= version):
            if self._is_complete(other):
                word = "already published" if other == version else f"older than the complete version {other}"
                raise ValueError(f"weight version {version} is {word}")
        if version in existing:
            fs.delete_tree(self._root, paths.weights_version_dir(version))
        for relname, local_path in files.items():
            fs.upload_file(self._root, local_path, paths.weights_file(version, relname))
        published_at = time.time()
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "published_at": published_at,
            "files": {relname: local_path.stat().st_size for relname, local_path in files.items()},
        }
        try:
            fs.put_if_absent(self._root, paths.weights_complete_marker(version), json.dumps(manifest).encode())
        except FileExistsError:
            raise ValueError(f"weight version {version} was published concurrently by another writer") from None
        pointer = {"version": version, "published_at": published_at}
        fs.put_atomic_replace(self._root, paths.WEIGHTS_LATEST, json.dumps(pointer).encode())

    def manifest(self, version: int) -> dict[str, Any]:
        """The ``_COMPLETE`` manifest of a published version; :class:`UnknownWeightVersionError` otherwise."""
        _check_version(version)
        try:
            raw = fs.read_bytes(self._root, paths.weights_complete_marker(version))
        except FileNotFoundError:
            raise UnknownWeightVersionError(version, self.list_versions()) from None
        source = self._root.display(paths.weights_complete_marker(version))
        try:
            content = json.loads(raw)
            files = content["files"]
            if content["version"] != version or not isinstance(files, dict):
                raise ValueError(f"names version {content['version']!r}, files {type(files).__name__}")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}: corrupt manifest ({exc})") from None
        return content

    def download(self, version: int, dest_dir: Path) -> Path:
        """Copy published ``version`` into ``dest_dir`` (must not exist, or be empty); return it.

        Files land in a hidden sibling directory first, are checked against the
        manifest's sizes, and the directory is then renamed to ``dest_dir``, so a
        loader never sees a partial download. An unpublished version raises
        :class:`UnknownWeightVersionError` (a ``KeyError``) listing the available ones.
        """
        dest_dir = Path(dest_dir)
        files: dict[str, int] = self.manifest(version)["files"]
        if dest_dir.exists() and (not dest_dir.is_dir() or any(dest_dir.iterdir())):
            raise FileExistsError(f"download destination {dest_dir} exists and is not an empty directory")
        dest_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest_dir.name}.", dir=dest_dir.parent))
        try:
            for relname, size in files.items():
                local_path = staging / relname
                fs.download_file(self._root, paths.weights_file(version, relname), local_path)
                if local_path.stat().st_size != size:
                    raise OSError(
                        f"{self._root.display(paths.weights_file(version, relname))}: "
                        f"downloaded {local_path.stat().st_size} bytes, manifest says {size}"
                    )
            if dest_dir.exists():
                dest_dir.rmdir()
            os.rename(staging, dest_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dest_dir

    def prune(self, keep_latest: int, referenced: Collection[int] = ()) -> list[int]:
        """Delete old versions; return the deleted ones, ascending.

        Kept: the ``keep_latest`` newest complete versions, every version in
        ``referenced``, the pointer's version, and any version newer than the
        pointer (possibly a publish in progress). Everything else goes,
        including leftovers of interrupted publishes; the manifest is deleted
        first so a version stops counting as published before its files go.
        """
        if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 0:
            raise ValueError(f"keep_latest must be a non-negative int, got {keep_latest!r}")
        latest = self.latest()
        complete = self.list_versions()
        keep = set(complete[len(complete) - keep_latest :] if keep_latest else [])
        keep.update(referenced)
        if latest is not None:
            keep.add(latest)
        deleted: list[int] = []
        for version in sorted(self._version_dirs()):
            if version in keep or latest is None or version > latest:
                continue
            fs.delete(self._root, paths.weights_complete_marker(version), missing_ok=True)
            fs.delete_tree(self._root, paths.weights_version_dir(version))
            deleted.append(version)
        return deleted

    def _version_dirs(self) -> list[int]:
        names = fs.list_dir(self._root, paths.WEIGHTS_DIR)
        versions = [paths.parse_weights_version_dirname(name) for name in names]
        return [v for v in versions if v is not None]

    def _is_complete(self, version: int) -> bool:
        return fs.exists(self._root, paths.weights_complete_marker(version))
