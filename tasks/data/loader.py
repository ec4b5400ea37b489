"""Reading prompt datasets: Parquet and JSON Lines files in several layouts, and mixtures.

Each row names the reward that scores it (its *task*) and carries that reward's data. The
layout is found by column names (first match wins) unless the caller names the fields:
math (``prompt``/``answer``, GSM8K, MATH) and code (asyncrl's ``prompt``/``tests``,
APPS/TACO, LiveCodeBench, CodeContests). Any layout may add ``task`` (``math``, ``code`` or
a plug-in under ``reward.plugins``) and a per-prompt ``max_new_tokens``. Formats by
extension: ``.parquet``/``.pq``, ``.jsonl``/``.json``, and ``.yaml``/``.yml`` for a mixture
(:mod:`asyncrl.tasks.data.mixture`); paths may be any fsspec URI. Encoded test cases that
would need unpickling are ignored, never decoded. Every layout's columns and rules:
``docs/internals/data.md``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from asyncrl.tasks.data.formats import (
    ANSWER_FIELD,
    BUDGET_FIELD,
    FINAL_ANSWER_MARKER,
    PROMPT_FIELDS,
    SOLUTION_FIELD,
    TASK_FIELD,
    Layout,
    build_record,
    detect_layout,
    named_layout,
    split_final_answer,
)
from asyncrl.tasks.data.mixture import MIXTURE_SUFFIXES, Mixture, mix, parse_mixture
from asyncrl.tasks.data.records import (
    BUILTIN_TASKS,
    CODE_TASK,
    MATH_TASK,
    DatasetError,
    PromptRecord,
    check_task,
    make_prompt_id,
)

__all__ = [
    "ANSWER_FIELD",
    "BUDGET_FIELD",
    "BUILTIN_TASKS",
    "CODE_TASK",
    "FINAL_ANSWER_MARKER",
    "MATH_TASK",
    "PROMPT_FIELDS",
    "SOLUTION_FIELD",
    "DatasetError",
    "PromptRecord",
    "dataset_files",
    "load_prompts",
    "make_prompt_id",
    "split_final_answer",
    "supported_formats",
]

PARQUET_SUFFIXES: tuple[str, ...] = (".parquet", ".pq")
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")


def supported_formats() -> str:
    return (
        f"Parquet ({', '.join(PARQUET_SUFFIXES)}), JSON Lines ({', '.join(JSONL_SUFFIXES)}) "
        f"or a mixture ({', '.join(MIXTURE_SUFFIXES)})"
    )


def _open_binary(path: str) -> Any:
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        raise DatasetError(f"{path}: file not found (expected {supported_formats()})")
    if fs.isdir(fs_path):
        raise DatasetError(f"{path}: is a directory, not a file (expected {supported_formats()})")
    return fs.open(fs_path, "rb")


def _layout(columns: list[str], where: str, names: tuple[str | None, str | None, str | None]) -> Layout:
    if any(name is not None for name in names):
        return named_layout(columns, where, *names)
    return detect_layout(columns, where)


def _read_parquet(
    path: str, names: tuple[str | None, str | None, str | None], plugins: Collection[str], task: str | None
) -> list[PromptRecord]:
    import pyarrow.parquet as pq

    with _open_binary(path) as handle:
        try:
            parquet = pq.ParquetFile(handle)
            columns = parquet.schema_arrow.names
            layout = _layout(columns, path, names)
            if TASK_FIELD in columns or task not in (None, *BUILTIN_TASKS):
                wanted = None  # plug-in rows keep all their fields
            else:
                wanted = [name for name in dict.fromkeys(layout.columns) if name in columns]
            table = parquet.read(columns=wanted)
        except DatasetError:
            raise
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
    rows = _parquet_rows(table, path)
    return [build_record(row, index, layout, f"{path}, row {index}", plugins, task) for index, row in enumerate(rows)]


def _parquet_rows(table: Any, path: str) -> list[dict[str, Any]]:  # noqa: ANN401 - a pyarrow Table
    """The table's rows as dicts; a string column holding bytes that are not UTF-8 (Parquet
    does not check them) raises :class:`DatasetError` naming the file, row and field."""
    import pyarrow as pa

    try:
        return list(table.to_pylist())
    except UnicodeDecodeError:
        pass
    for name in table.column_names:
        column = table.column(name)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            raw = column.cast(pa.large_binary()).to_pylist()  # the bytes as stored, unchecked
            for index, value in enumerate(raw):
                if value is None:
                    continue
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetError(
                        f"{path}, row {index}: field {name!r} is not UTF-8 text (byte {exc.start} of the value)"
                    ) from None
    raise DatasetError(f"{path}: holds text that is not UTF-8")


def _json_objects(path: str, text: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(row index, location text, object) for each non-blank line (or array item)."""
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc
        for index, item in enumerate(items):
            where = f"{path}, row {index}"
            if not isinstance(item, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(item).__name__}")
            yield index, where, item
        return
    row = 0
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(item, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(item).__name__}")
        yield row, f"{where} (row {row})", item
        row += 1


def _read_json_lines(
    path: str, names: tuple[str | None, str | None, str | None], plugins: Collection[str], task: str | None
) -> list[PromptRecord]:
    with _open_binary(path) as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DatasetError(
            f"{path}, line {line}: not UTF-8 text (byte {exc.start} of the file, column {column}); "
            "save the file as UTF-8"
        ) from None
    records: list[PromptRecord] = []
    layout: Layout | None = None
    for row, where, item in _json_objects(path, text):
        if layout is None:
            # The first object fixes the layout; later rows are checked against it.
            layout = _layout(list(item), where, names)
        records.append(build_record(item, row, layout, where, plugins, task))
    return records


def _suffix(path: str) -> str:
    return Path(path.split("?", 1)[0]).suffix.lower()


def _read_mixture(path: str) -> Mixture:
    with _open_binary(path) as handle:
        raw = handle.read()
    return parse_mixture(raw, path)


def load_prompts(
    path: str | Path,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    solution_field: str | None = None,
    plugins: Collection[str] = (),
    task: str | None = None,
) -> list[PromptRecord]:
    """All records of a prompt file, in file order, or one epoch of a mixture file
    (module docstring for layouts and formats; :mod:`asyncrl.tasks.data.mixture`).

    ``plugins``: the plug-in rewards configured under ``reward.plugins``: the tasks a row may
    name besides ``math`` and ``code``. ``task``: every row's task (a mixture source's
    ``task``); a row's own ``task`` must agree. ``prompt_field``/``answer_field``/
    ``solution_field`` name the columns of a math file (not of a mixture).

    Raises :class:`DatasetError` naming the path for a missing file, an unsupported
    extension, a malformed JSON line (with its line number), a missing/null/empty/malformed
    field or an unknown task (with the row and field), or a file with no records. Rows are
    numbered from 0 in file order (blank JSON lines skipped); JSON Lines errors also give
    the 1-based line.
    """
    path_text = str(path)
    names = (prompt_field, answer_field, solution_field)
    if task is not None:
        check_task(task, plugins, path_text, "task")
    suffix = _suffix(path_text)
    if suffix in MIXTURE_SUFFIXES:
        if any(name is not None for name in names) or task is not None:
            raise DatasetError(f"{path_text}: a mixture takes no field names or task; set them per source")
        return _load_mixture(path_text, plugins)
    if suffix in PARQUET_SUFFIXES:
        records = _read_parquet(path_text, names, plugins, task)
    elif suffix in JSONL_SUFFIXES:
        records = _read_json_lines(path_text, names, plugins, task)
    else:
        raise DatasetError(
            f"{path_text}: unsupported file extension {suffix or '(none)'!r}; expected {supported_formats()}"
        )
    if not records:
        raise DatasetError(f"{path_text}: contains no records")
    return records


def _load_mixture(path: str, plugins: Collection[str]) -> list[PromptRecord]:
    mixture = _read_mixture(path)
    loaded = []
    for index, source in enumerate(mixture.sources):
        if source.task is not None:
            check_task(source.task, plugins, f"{path}: sources[{index}]", "task")
        if _suffix(source.path) in MIXTURE_SUFFIXES:
            raise DatasetError(f"{path}: sources[{index}].path: {source.path!r} is a mixture; sources must be data files")
        loaded.append(load_prompts(source.path, plugins=plugins, task=source.task))
    return mix(mixture, loaded)


def dataset_files(path: str | Path) -> list[str]:
    """The files a dataset path reads: a mixture file and its sources (resolved), or just
    the file; for content-addressed caching and lineage."""
    path_text = str(path)
    if _suffix(path_text) not in MIXTURE_SUFFIXES:
        return [path_text]
    return [path_text, *(source.path for source in _read_mixture(path_text).sources)]
