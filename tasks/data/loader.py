"""Reading prompt datasets: Parquet and JSON Lines files in several layouts, and mixtures.

Each row names the reward that scores it (its *task*) and carries that reward's data. The
layout is found by column names (first match wins) unless the caller names the fields:
math (``prompt``/``answer``, GSM8K, MATH) and code (asyncrl's ``prompt``/``tests``,
APPS/TACO, LiveCodeBench, CodeContests). Any layout may add ``task`` (``math``, ``code`` or
a plug-in under ``reward.plugins``) and a per-prompt ``max_new_tokens``. Formats by
extension: ``.parquet``/``.pq``, ``.jsonl``/``.json``, and ``.yaml``/``.yml`` for a mixture
(:mod:`asyncrl.tasks.data.mixture`); paths may be any fsspec URI. LiveCodeBench's pickled
private tests are decoded by an unpickler that refuses every global. Each load logs one INFO
line saying what it read (:class:`LoadReport`). Every layout's columns and rules:
``docs/internals/data.md``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from asyncrl.tasks.data.code_formats import TEST_ORIGINS
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
    "LoadReport",
    "PromptRecord",
    "dataset_files",
    "load_prompts",
    "load_prompts_with_report",
    "make_prompt_id",
    "split_final_answer",
    "supported_formats",
]

PARQUET_SUFFIXES: tuple[str, ...] = (".parquet", ".pq")
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")
CASE_KINDS: tuple[str, ...] = ("stdio", "call", "assert")
LOG = logging.getLogger("asyncrl.data")


def _counts(counts: Mapping[str, int], order: Sequence[str] = (), keep_zero: bool = False) -> str:
    keys = [*order, *sorted(k for k in counts if k not in order)]
    return ", ".join(f"{k} {counts.get(k, 0)}" for k in keys if keep_zero or counts.get(k, 0))


@dataclass(frozen=True)
class LoadReport:
    """What one load read, so a run says what it trains on (e.g. that LiveCodeBench's
    private tests were used): one line by :meth:`summary`."""

    path: str
    files: tuple[tuple[str, str], ...]
    """(path, layout name) of each data file read (a mixture's sources)."""
    rows: Mapping[str, int] = field(default_factory=dict)
    """Rows read per task (``math``, ``code``, a plug-in), summed over the files."""
    tests: Mapping[str, int] = field(default_factory=dict)
    """Code tests per case kind: ``stdio``, ``call``, ``assert``."""
    test_origins: Mapping[str, int] = field(default_factory=dict)
    """Code tests per origin (:data:`~asyncrl.tasks.data.code_formats.TEST_ORIGINS`)."""
    records: int = 0
    """Records returned: the rows, or a mixture's weighted epoch."""

    def summary(self) -> str:
        """E.g. ``lcb.jsonl (LiveCodeBench): 2 rows: code 2; code tests 5: stdio 3, call 2,
        assert 0; public 2, private 3``."""
        if len(self.files) == 1 and self.files[0][0] == self.path:
            source = f"{self.path} ({self.files[0][1]})"
        else:
            listed = ", ".join(f"{path} ({layout})" for path, layout in self.files)
            source = f"{self.path}: mixture of {len(self.files)} files [{listed}], {self.records} records per epoch"
        text = f"{source}: {sum(self.rows.values())} rows: {_counts(self.rows, BUILTIN_TASKS)}"
        if self.rows.get(CODE_TASK):
            text += f"; code tests {sum(self.tests.values())}: {_counts(self.tests, CASE_KINDS, keep_zero=True)}"
            text += f"; {_counts(self.test_origins, TEST_ORIGINS)}"
        return text


def _file_report(path: str, layout: str, records: Sequence[PromptRecord], origins: Mapping[str, int]) -> LoadReport:
    rows = Counter(record.task for record in records)
    tests = dict.fromkeys(CASE_KINDS, 0)
    for record in records:
        if record.tests is not None:
            tests["stdio"] += len(record.tests.stdio)
            tests["call"] += len(record.tests.calls)
            tests["assert"] += len(record.tests.asserts)
    return LoadReport(path, ((path, layout),), dict(rows), tests, dict(origins), len(records))


def _mixture_report(path: str, sources: Sequence[LoadReport], records: int) -> LoadReport:
    def total(name: str) -> dict[str, int]:
        summed: Counter[str] = Counter()
        for report in sources:
            summed.update(getattr(report, name))
        return dict(summed)

    files = tuple(entry for report in sources for entry in report.files)
    return LoadReport(path, files, total("rows"), total("tests"), total("test_origins"), records)


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


def _counting(layout: Layout, origins: Counter[str]) -> Layout:
    """``layout`` whose code reader adds each row's tests per origin to ``origins``."""
    return replace(layout, code=partial(layout.code, origins=origins))


def _read_parquet(
    path: str, names: tuple[str | None, str | None, str | None], plugins: Collection[str], task: str | None
) -> tuple[list[PromptRecord], LoadReport]:
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
    origins: Counter[str] = Counter()
    counted = _counting(layout, origins)
    records = [build_record(row, index, counted, f"{path}, row {index}", plugins, task) for index, row in enumerate(rows)]
    return records, _file_report(path, layout.name, records, origins)


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
) -> tuple[list[PromptRecord], LoadReport]:
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
    origins: Counter[str] = Counter()
    for row, where, item in _json_objects(path, text):
        if layout is None:
            # The first object fixes the layout; later rows are checked against it.
            layout = _counting(_layout(list(item), where, names), origins)
        records.append(build_record(item, row, layout, where, plugins, task))
    return records, _file_report(path, layout.name if layout else "empty", records, origins)


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
    (module docstring for layouts and formats; :mod:`asyncrl.tasks.data.mixture`); logs
    what it read (:meth:`LoadReport.summary`) as one INFO line on ``asyncrl.data``.

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
    records, report = load_prompts_with_report(
        path, prompt_field=prompt_field, answer_field=answer_field, solution_field=solution_field, plugins=plugins, task=task
    )
    LOG.info("dataset %s", report.summary())
    return records


def load_prompts_with_report(
    path: str | Path,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    solution_field: str | None = None,
    plugins: Collection[str] = (),
    task: str | None = None,
) -> tuple[list[PromptRecord], LoadReport]:
    """:func:`load_prompts`'s records and what the load read, without logging it."""
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
        records, report = _read_parquet(path_text, names, plugins, task)
    elif suffix in JSONL_SUFFIXES:
        records, report = _read_json_lines(path_text, names, plugins, task)
    else:
        raise DatasetError(
            f"{path_text}: unsupported file extension {suffix or '(none)'!r}; expected {supported_formats()}"
        )
    if not records:
        raise DatasetError(f"{path_text}: contains no records")
    return records, report


def _load_mixture(path: str, plugins: Collection[str]) -> tuple[list[PromptRecord], LoadReport]:
    mixture = _read_mixture(path)
    loaded = []
    reports = []
    for index, source in enumerate(mixture.sources):
        if source.task is not None:
            check_task(source.task, plugins, f"{path}: sources[{index}]", "task")
        if _suffix(source.path) in MIXTURE_SUFFIXES:
            raise DatasetError(f"{path}: sources[{index}].path: {source.path!r} is a mixture; sources must be data files")
        records, report = load_prompts_with_report(source.path, plugins=plugins, task=source.task)
        loaded.append(records)
        reports.append(report)
    epoch = mix(mixture, loaded)
    return epoch, _mixture_report(path, reports, len(epoch))


def dataset_files(path: str | Path) -> list[str]:
    """The files a dataset path reads: a mixture file and its sources (resolved), or just
    the file; for content-addressed caching and lineage."""
    path_text = str(path)
    if _suffix(path_text) not in MIXTURE_SUFFIXES:
        return [path_text]
    return [path_text, *(source.path for source in _read_mixture(path_text).sources)]
