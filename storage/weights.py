"""Published policy weights: ``weights/v{version:06d}/`` plus the ``weights/LATEST`` pointer.

Publishing uploads every file of a local HF-format directory, then writes the ``_COMPLETE``
manifest (put-if-absent; each file's size and SHA-256), then moves ``LATEST`` forward. A
version counts as published only once its manifest exists, so readers never load a
half-uploaded version, and versions are strictly increasing. ``LATEST`` only moves forward (a
compare-and-swap, :func:`~asyncrl.storage.compare_and_swap.replace_if`); downloads are verified
against the manifest (:class:`WeightIntegrityError`); pruning keeps each version's lineage file
in ``weights-lineage/`` and never touches pinned versions, so ``weights/`` holds only the
versions kept. Which to keep is the caller's policy (:mod:`asyncrl.tasks.trainer.retention`).
Details: ``docs/internals/storage.md``.
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

from asyncrl.storage import compare_and_swap, fs, local_files, paths
from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.local_files import file_sha256
from asyncrl.storage.weight_lineage import LINEAGE_FILE, read_lineage

MANIFEST_FORMAT = 2
"""2: ``files`` maps each name to ``{"size": bytes, "sha256": hex}``; 1: to its size."""
REQUIRED_FILES = ("config.json",)
WEIGHT_SUFFIX = ".safetensors"
"""Files of a pruned version that stay in the store (see the module docstring)."""


class WeightIntegrityError(OSError):
    """A downloaded weight file differs from its manifest; the message names the file and
    the expected and actual size or SHA-256."""


@dataclass(frozen=True)
class ManifestFile:
    """One file of a manifest: its size and SHA-256 (None in a format 1 manifest)."""

    size: int
    sha256: str | None


def manifest_files(manifest: dict[str, Any]) -> dict[str, ManifestFile]:
    """The files of a format 1 or 2 manifest; ``ValueError`` names a malformed entry."""
    files: dict[str, ManifestFile] = {}
    for name, entry in manifest["files"].items():
        if isinstance(entry, int) and not isinstance(entry, bool):
            files[name] = ManifestFile(size=entry, sha256=None)
        elif isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str):
            files[name] = ManifestFile(size=entry["size"], sha256=entry["sha256"])
        else:
            raise ValueError(f"manifest entry for {name!r} is neither a size nor {{size, sha256}}: {entry!r}")
    return files


def _pointer_version(raw: bytes | None) -> int | None:
    """Version named by the raw ``LATEST`` bytes; None if absent or unreadable."""
    if raw is None:
        return None
    try:
        version = json.loads(raw)["version"]
    except (ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


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

    @property
    def root(self) -> RunRoot:
        """The run root this store reads and writes."""
        return self._root

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
        """Complete (published) versions, ascending: one recursive listing of ``weights/``
        (pruned versions' lineage files cost a listed key each, no request)."""
        return sorted(v for v, files in self._tree().items() if paths.WEIGHTS_COMPLETE_MARKER in files)

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
        The pointer is moved with a compare-and-swap (:meth:`advance_latest`): if a
        concurrent publisher already moved it past ``version``, it stays there.
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
        entries: dict[str, dict[str, Any]] = {}
        for relname, local_path in files.items():
            entries[relname] = {"size": local_path.stat().st_size, "sha256": file_sha256(local_path)}
            fs.upload_file(self._root, local_path, paths.weights_file(version, relname))
        published_at = time.time()
        manifest = {"format": MANIFEST_FORMAT, "version": version, "published_at": published_at, "files": entries}
        try:
            fs.put_if_absent(self._root, paths.weights_complete_marker(version), json.dumps(manifest).encode())
        except FileExistsError:
            raise ValueError(f"weight version {version} was published concurrently by another writer") from None
        self.advance_latest(version, published_at)

    def advance_latest(self, version: int, published_at: float) -> bool:
        """Point ``LATEST`` at ``version`` unless it names ``version`` or a newer one already;
        return whether it names ``version`` now. A compare-and-swap
        (:func:`~asyncrl.storage.compare_and_swap.replace_if`): an absent or unreadable pointer is replaced; a newer one is never moved back."""
        _check_version(version)
        data = json.dumps({"version": version, "published_at": published_at}).encode()

        def older(current: bytes | None) -> bool:
            named = _pointer_version(current)
            return named is None or named < version

        compare_and_swap.replace_if(self._root, paths.WEIGHTS_LATEST, data, older)
        return self.latest() == version

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
            manifest_files(content)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}: corrupt manifest ({exc})") from None
        return content

    def download(self, version: int, dest_dir: Path, link: bool = False) -> Path:
        """Copy published ``version`` into ``dest_dir`` (must not exist, or be empty); return it.

        With ``link``, a local store's files are hard-linked instead of copied where the
        filesystem allows (:func:`~asyncrl.storage.fs.link_file`: no bytes written; a
        rollout server's cache on the store's disk), and verified where they lie; otherwise, and for S3, copied.
        Files land in a hidden sibling directory first (each fsynced, see
        :func:`fs.download_file`), are checked against the manifest's sizes and SHA-256
        digests, and the directory is then renamed to ``dest_dir`` (its parent fsynced),
        so a loader never sees a partial or corrupt download. A mismatch raises
        :class:`WeightIntegrityError` naming the object and both values; the staging
        directory is removed. An unpublished version raises
        :class:`UnknownWeightVersionError` (a ``KeyError``) listing the available ones.
        """
        dest_dir = Path(dest_dir)
        files = manifest_files(self.manifest(version))
        if dest_dir.exists() and (not dest_dir.is_dir() or any(dest_dir.iterdir())):
            raise FileExistsError(f"download destination {dest_dir} exists and is not an empty directory")
        dest_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest_dir.name}.", dir=dest_dir.parent))
        try:
            for relname, expected in files.items():
                local_path = staging / relname
                source = self._root.display(paths.weights_file(version, relname))
                if not (link and fs.link_file(self._root, paths.weights_file(version, relname), local_path)):
                    fs.download_file(self._root, paths.weights_file(version, relname), local_path)
                size = local_path.stat().st_size
                if size != expected.size:
                    raise WeightIntegrityError(f"{source}: downloaded {size} bytes, manifest says {expected.size}")
                if expected.sha256 is not None:
                    actual = file_sha256(local_path)
                    if actual != expected.sha256:
                        raise WeightIntegrityError(
                            f"{source}: downloaded SHA-256 {actual}, manifest says {expected.sha256}"
                        )
            if dest_dir.exists():
                dest_dir.rmdir()
            os.rename(staging, dest_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        local_files.fsync_path(str(dest_dir.parent))
        return dest_dir

    def pin(self, version: int) -> None:
        """Keep complete ``version`` from pruning for good: write its pin object
        (put-if-absent, idempotent). :class:`UnknownWeightVersionError` if the version is
        not complete before or after the pin is written (a prune deleted it meanwhile; a
        prune that sees the pin after deleting the manifest puts the manifest back)."""
        self.manifest(version)
        fs.put_if_absent(self._root, paths.weights_pin(version), json.dumps({"version": version}).encode())
        if not self._is_complete(version):
            raise UnknownWeightVersionError(version, self.list_versions())

    def pinned_versions(self) -> set[int]:
        """Versions with a pin object (:meth:`pin`)."""
        names = fs.list_dir(self._root, paths.WEIGHTS_PINS_DIR)
        return {v for v in (paths.parse_weights_version_dirname(name) for name in names) if v is not None}

    def pruned_versions(self) -> list[int]:
        """Versions :meth:`prune` deleted, whose lineage file it kept in ``weights-lineage/``,
        ascending: their update counts are still readable (one listing; an audit's call)."""
        names = fs.list_dir(self._root, paths.PRUNED_LINEAGE_DIR)
        return sorted(v for v in (paths.parse_pruned_lineage_name(name) for name in names) if v is not None)

    def prune(self, keep_latest: int, referenced: Collection[int] = ()) -> list[int]:
        """Delete old versions; return the deleted ones, ascending.

        Kept: the ``keep_latest`` newest complete versions, every version in
        ``referenced``, every pinned version, the pointer's version, and any version
        newer than the pointer (possibly a publish in progress). Everything else goes,
        including leftovers of interrupted publishes: the lineage file is copied to
        ``weights-lineage/`` and the manifest to ``weights-manifests/`` (put-if-absent, so
        every version's digests stay: :meth:`weight_digests`), the manifest is deleted so a version stops
        counting as published before its files go, then the version's directory. If a pin
        for the version appears meanwhile, its manifest is put back and the version kept.
        A killed prune is finished by the next one (a version without manifest below the
        pointer is deleted again).
        """
        if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 0:
            raise ValueError(f"keep_latest must be a non-negative int, got {keep_latest!r}")
        latest = self.latest()
        if latest is None:
            return []
        tree = self._tree()
        complete = sorted(v for v, files in tree.items() if paths.WEIGHTS_COMPLETE_MARKER in files)
        keep = set(complete[len(complete) - keep_latest :] if keep_latest else [])
        keep.update(referenced)
        keep.update(self.pinned_versions())
        keep.add(latest)
        deleted: list[int] = []
        for version, files in sorted(tree.items()):
            if version in keep or version > latest or not files:
                continue
            if LINEAGE_FILE in files:
                self._keep_lineage(version)
            if paths.WEIGHTS_COMPLETE_MARKER in files:
                marker = paths.weights_complete_marker(version)
                try:
                    manifest: bytes | None = fs.read_bytes(self._root, marker)
                except FileNotFoundError:
                    manifest = None  # another prune got here first
                if manifest is not None:
                    _put_once(self._root, paths.pruned_manifest(version), manifest)
                fs.delete(self._root, marker, missing_ok=True)
                if manifest is not None and version in self.pinned_versions():
                    fs.put_if_absent(self._root, marker, manifest)
                    continue
            fs.delete_tree(self._root, paths.weights_version_dir(version))
            deleted.append(version)
        return deleted

    def _tree(self) -> dict[int, list[str]]:
        """Files of every version directory by version (one recursive listing of ``weights/``)."""
        tree: dict[int, list[str]] = {}
        for relpath in fs.list_tree(self._root, paths.WEIGHTS_DIR):
            head, _, rest = relpath.partition("/")
            version = paths.parse_weights_version_dirname(head)
            if version is not None and rest:
                tree.setdefault(version, []).append(rest)
        return tree

    def _keep_lineage(self, version: int) -> None:
        """Copy ``version``'s lineage file to ``weights-lineage/`` (kept if already there)."""
        try:
            data = fs.read_bytes(self._root, paths.weights_file(version, LINEAGE_FILE))
        except FileNotFoundError:
            return
        _put_once(self._root, paths.pruned_lineage(version), data)

    def weight_digests(self, version: int) -> dict[str, str]:
        """SHA-256 of each weight file of ``version`` (the lineage file, which holds the step's
        timings, left out), from its manifest, or from the copy a prune kept. Raises
        :class:`UnknownWeightVersionError` for a version never published (or a format-1
        manifest without digests: ``ValueError`` naming it)."""
        try:
            raw = fs.read_bytes(self._root, paths.weights_complete_marker(version))
        except FileNotFoundError:
            try:
                raw = fs.read_bytes(self._root, paths.pruned_manifest(version))
            except FileNotFoundError:
                raise UnknownWeightVersionError(version, self.list_versions()) from None
        files = manifest_files(json.loads(raw))
        missing = [name for name, entry in files.items() if entry.sha256 is None]
        if missing:
            raise ValueError(f"{self._root.display(paths.weights_complete_marker(version))}: no SHA-256 for {missing} (manifest format 1)")
        return {name: str(entry.sha256) for name, entry in sorted(files.items()) if name != LINEAGE_FILE}

    def _version_dirs(self) -> list[int]:
        names = fs.list_dir(self._root, paths.WEIGHTS_DIR)
        versions = [paths.parse_weights_version_dirname(name) for name in names]
        return [v for v in versions if v is not None]

    def _is_complete(self, version: int) -> bool:
        return fs.exists(self._root, paths.weights_complete_marker(version))


def final_step_published(root: RunRoot, max_steps: int) -> bool:
    """Whether the newest published weights are those of step ``max_steps`` (or later)."""
    latest = WeightStore(root).latest()
    lineage = None if latest is None else read_lineage(root, latest)
    step = None if lineage is None else lineage.get("step")
    return isinstance(step, int) and step >= max_steps


def _put_once(root: RunRoot, relpath: str, data: bytes) -> None:
    """Write ``data`` at ``relpath`` unless something is there already."""
    try:
        fs.put_if_absent(root, relpath, data)
    except FileExistsError:
        pass
