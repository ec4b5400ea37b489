"""The RL prompt files of a run when ``data.train_path`` names a folder (or ``s3://`` prefix)
that grows between runs: list its data files, choose the run's files once, before training
(:func:`~asyncrl.tasks.data.train_selection.select_train_files`, recorded in the run root by
:mod:`asyncrl.storage.train_manifest`), and load the prompts of exactly those files.

A single file (or mixture) is read as before; it is listed only to tell whether it is new
(``data.require_new_files``). Where the earlier runs' files come from (MLflow) is the
caller's business: it hands them in. A folder is listed and read as the loader reads a file
(fsspec, the store's settings and credentials from the environment), so listing and loading
agree; ``storage_options`` is for callers that list a store of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

from asyncrl.configs.data import DataConfig, is_data_folder
from asyncrl.storage import paths
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.train_manifest import TrainFile, TrainManifest, TrainSelection, read_train_manifest, write_train_manifest
from asyncrl.tasks.data.loader import JSONL_SUFFIXES, PARQUET_SUFFIXES, dataset_files, load_prompts
from asyncrl.tasks.data.records import DatasetError, PromptRecord
from asyncrl.tasks.data.train_selection import select_train_files

FOLDER_SUFFIXES: tuple[str, ...] = (*PARQUET_SUFFIXES, *JSONL_SUFFIXES)
"""The files a folder may hold: Parquet and JSON Lines (no mixture: a mixture names its files)."""
SKIPPED_PREFIXES: tuple[str, ...] = (".", "_")
"""A file, or a folder on its way, whose name starts with one of these is not data (``_SUCCESS``,
``.DS_Store``, ``_temporary/``: the names Spark and pyarrow datasets skip too)."""


def _filesystem(location: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(location, **dict(storage_options or {}))


def file_digest(filesystem: Any, path: str) -> str:  # noqa: ANN401 - an fsspec filesystem
    """A data file's digest: sha256 of its bytes, first 16 hex digits (MLflow's dataset digest
    column holds 36; every dataset a run records is named by this one rule)."""
    digest = hashlib.sha256()
    with filesystem.open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _uri(filesystem: Any, path: str) -> str:  # noqa: ANN401 - an fsspec filesystem
    """A local file by its absolute path, any other by its full URI (``s3://bucket/key``)."""
    from fsspec.implementations.local import LocalFileSystem

    return path if isinstance(filesystem, LocalFileSystem) else filesystem.unstrip_protocol(path)


def list_train_files(train_path: str, storage_options: Mapping[str, Any] | None = None) -> list[TrainFile]:
    """The data files of ``train_path`` with their digests, in a stable order.

    A folder (:func:`~asyncrl.configs.data.is_data_folder`): every file under it, recursively,
    sorted by its path below the folder, except names starting with ``.`` or ``_`` (and what
    is below such a folder). A single file: it (a mixture: it and its sources), by the path
    as given. :class:`DatasetError` naming ``data.train_path`` for a missing or empty folder,
    a file of another format in it, or a "folder" that is a file of another format."""
    if not is_data_folder(train_path):
        listed = []
        for path in dataset_files(train_path):
            filesystem, fs_path = _filesystem(path, storage_options)
            if not filesystem.isfile(fs_path):
                raise DatasetError(f"data.train_path: {path}: file not found")
            listed.append(TrainFile(path, file_digest(filesystem, fs_path)))
        return listed
    filesystem, folder = _filesystem(train_path, storage_options)
    folder = folder.rstrip("/")
    filesystem.invalidate_cache(folder)  # a cached S3 listing would miss the files that arrived since
    expected = f"Parquet ({', '.join(PARQUET_SUFFIXES)}) or JSON Lines ({', '.join(JSONL_SUFFIXES)}) files"
    if filesystem.isfile(folder):
        raise DatasetError(
            f"data.train_path: {train_path} is a file of an unsupported format; name a folder of {expected}, "
            "or one such file"
        )
    found: list[tuple[str, str]] = []  # (path below the folder, full path)
    for path in filesystem.find(folder) if filesystem.isdir(folder) else []:
        relative = path[len(folder) :].lstrip("/")
        if not any(part.startswith(SKIPPED_PREFIXES) for part in PurePosixPath(relative).parts):
            found.append((relative, path))
    refused = [relative for relative, _ in found if PurePosixPath(relative).suffix.lower() not in FOLDER_SUFFIXES]
    if refused:
        shown = ", ".join(sorted(refused)[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise DatasetError(
            f"data.train_path: {train_path} holds files of a format the loader cannot read: {shown}; "
            f"a data folder holds only {expected} (names starting with . or _ are skipped)"
        )
    if not found:
        what = "holds no data files" if filesystem.isdir(folder) else "is not there (no such folder or prefix)"
        raise DatasetError(f"data.train_path: {train_path} {what}; expected a folder of {expected}")
    return [TrainFile(_uri(filesystem, path), file_digest(filesystem, path)) for _, path in sorted(found)]


@dataclass(frozen=True)
class TrainChoice:
    """What :func:`choose_train_files` decided."""

    selection: TrainSelection | None
    """None: a single file, read as it is, with no question of new files."""
    reused: bool
    """Read back from the run root: a restarted or resumed run keeps its files."""
    skipped: str | None = None
    """Why the run ends without training (``data.require_new_files`` and nothing new); None: it trains."""


def choose_train_files(
    data: DataConfig,
    seed: int,
    root: RunRoot,
    earlier: Callable[[], Collection[TrainFile]],
    earlier_runs: str = "an earlier run",
    record: bool = True,
) -> TrainChoice:
    """The run's train files, chosen once: a folder's choice already in the run root is kept
    (``earlier`` is not called); a single file without ``data.require_new_files`` is not looked
    at (it may not be written yet); otherwise the listing (:func:`list_train_files`) and the
    files earlier runs trained on (``earlier()``) go through
    :func:`~asyncrl.tasks.data.train_selection.select_train_files`. With
    ``data.require_new_files`` and no new file the choice says why the run is skipped
    (``earlier_runs`` names those runs in it) and nothing is recorded; else, for a folder and
    with ``record``, it is written to the run root (put-if-absent: the first start to choose
    wins)."""
    if data.train_folder:
        manifest = read_train_manifest(root)
        if manifest is not None:
            if manifest.train_path != data.train_path:
                raise DatasetError(
                    f"data.train_path: {data.train_path!r}, but {root.display(paths.TRAIN_FILES)} holds the files "
                    f"chosen from {manifest.train_path!r}; use another storage.root for another folder"
                )
            return TrainChoice(manifest.selection, reused=True)
    elif not data.require_new_files:
        return TrainChoice(None, reused=False)
    listing = list_train_files(data.train_path)
    selection = select_train_files(listing, earlier(), data.replay_fraction, seed)
    if data.require_new_files and not selection.new:
        return TrainChoice(selection, reused=False, skipped=(
            f"data.require_new_files: nothing new at {data.train_path}: each of its {len(listing)} data file(s) "
            f"was trained on, with this content, by {earlier_runs}; the run ends without training"
        ))  # fmt: skip
    if data.train_folder and record:
        manifest = write_train_manifest(root, TrainManifest(data.train_path, seed, data.replay_fraction, selection))
        selection = manifest.selection
    return TrainChoice(selection, reused=False)


def describe(selection: TrainSelection) -> str:
    """E.g. ``3 of 7 files: 2 new, 1 replayed``."""
    if not selection.new:
        return f"all {selection.listed} files (none new)"
    return f"{len(selection.files)} of {selection.listed} files: {len(selection.new)} new, {len(selection.replayed)} replayed"


def train_files(data: DataConfig, root: RunRoot) -> tuple[TrainFile, ...] | None:
    """The files a run with a folder ``data.train_path`` trains on (its manifest); None for a
    single file (read as it is). :class:`DatasetError` naming the field when the folder's files
    were not chosen yet."""
    if not data.train_folder:
        return None
    manifest = read_train_manifest(root)
    if manifest is None:
        raise DatasetError(
            f"data.train_path: {data.train_path} is a folder, and {root.display(paths.TRAIN_FILES)} does not say "
            "which of its files this run trains on: the pipeline's and the train flow's start choose them"
        )
    return manifest.selection.files


def load_train_prompts(data: DataConfig, root: RunRoot, plugins: Collection[str] = ()) -> list[PromptRecord]:
    """The run's RL prompts: the file at ``data.train_path`` as :func:`load_prompts` reads it,
    or, for a folder, the records of the files the run chose (:func:`train_files`), in their
    order, each file checked against its recorded digest first (a run trains on the files as
    they were chosen) and its prompt ids prefixed with the digest's first 8 digits (ids stay
    distinct across files and stable across runs). Errors name ``data.train_path``."""
    files = train_files(data, root)
    if files is None:
        return load_prompts(data.train_path, plugins=plugins)
    records: list[PromptRecord] = []
    for file in files:
        filesystem, path = _filesystem(file.uri, None)
        try:
            now = file_digest(filesystem, path)
        except FileNotFoundError:
            raise DatasetError(f"data.train_path: {file.uri}: chosen for this run, now gone") from None
        if now != file.digest:
            raise DatasetError(
                f"data.train_path: {file.uri} changed since this run chose it (digest {file.digest}, now {now}); "
                "a run trains on its files as they were: restore it, or start a new run (another name and storage.root)"
            )
        try:
            loaded = load_prompts(file.uri, plugins=plugins)
        except DatasetError as exc:
            raise DatasetError(f"data.train_path: {exc}") from None
        records.extend(replace(r, prompt_id=f"{file.digest[:8]}:{r.prompt_id}") for r in loaded)
    return records
