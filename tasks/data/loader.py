"""Reading prompt datasets: our Parquet, GSM8K-style JSON Lines, users' Parquet.

Layouts (found by column names unless the caller names the fields):
- ``prompt`` + ``answer`` (+ optional ``solution``): the synthetic task's Parquet;
- ``question`` + ``answer``: GSM8K, whose answer text ends in ``#### N``; N (commas
  between digit groups dropped) becomes the answer, the text before it the solution.
Any layout may add ``max_new_tokens`` (int >= 1 or null): that prompt's generation
budget per sample, capped by ``rollout.max_new_tokens``.
Formats by extension: ``.parquet``/``.pq`` (Parquet), ``.jsonl``/``.json``
(JSON Lines; a ``.json`` file holding one JSON array of objects is read too).
Paths may be local or any fsspec URI (``s3://...``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARQUET_SUFFIXES: tuple[str, ...] = (".parquet", ".pq")
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")
PROMPT_FIELDS: tuple[str, ...] = ("prompt", "question")
ANSWER_FIELD = "answer"
SOLUTION_FIELD = "solution"
BUDGET_FIELD = "max_new_tokens"
FINAL_ANSWER_MARKER = "####"
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class DatasetError(ValueError):
    """A prompt file that cannot be used; the message names the file, row and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer.

    ``prompt_id`` = ``"{row:06d}-{sha256(prompt)[:10]}"``: stable across reads of the same
    file, distinct within it even when prompts repeat, and changed if the text changes.
    """

    prompt_id: str
    prompt: str
    answer: str
    solution: str | None = None
    max_new_tokens: int | None = None
    """This prompt's output budget per sample (column ``max_new_tokens``); None = the run's."""


@dataclass(frozen=True)
class FieldNames:
    prompt: str
    answer: str
    solution: str | None


def supported_formats() -> str:
    return f"Parquet ({', '.join(PARQUET_SUFFIXES)}) or JSON Lines ({', '.join(JSONL_SUFFIXES)})"


def make_prompt_id(row: int, prompt: str) -> str:
    """``"{row:06d}-{sha256(prompt)[:10]}"`` (see :class:`PromptRecord`)."""
    return f"{row:06d}-{hashlib.sha256(prompt.encode('utf-8')).hexdigest()[:10]}"


def split_final_answer(text: str) -> tuple[str | None, str]:
    """GSM8K answer text -> (solution before the last ``####`` or None, final answer).

    Commas between digit groups are dropped from the final answer (``1,234`` -> ``1234``).
    Text without ``####`` is the answer itself (stripped), with no solution.
    """
    head, marker, tail = text.rpartition(FINAL_ANSWER_MARKER)
    if not marker:
        return None, text.strip()
    solution = head.strip() or None
    return solution, _THOUSANDS_COMMA.sub("", tail.strip())


def resolve_fields(
    columns: Sequence[str],
    where: str,
    prompt_field: str | None,
    answer_field: str | None,
    solution_field: str | None,
) -> FieldNames:
    """Pick the prompt/answer/solution columns: the caller's names, or the first of
    ``prompt``/``question`` and ``answer``; ``solution`` only if present."""
    available = ", ".join(columns) or "none"
    if prompt_field is None:
        prompt_field = next((name for name in PROMPT_FIELDS if name in columns), None)
        if prompt_field is None:
            raise DatasetError(
                f"{where}: no prompt field; expected one of {', '.join(PROMPT_FIELDS)} "
                f"(or pass prompt_field=...); columns: {available}"
            )
    answer_field = answer_field or ANSWER_FIELD
    for role, name in (("prompt", prompt_field), ("answer", answer_field)):
        if name not in columns:
            raise DatasetError(f"{where}: {role} field {name!r} is missing; columns: {available}")
    if solution_field is not None and solution_field not in columns:
        raise DatasetError(f"{where}: solution field {solution_field!r} is missing; columns: {available}")
    if solution_field is None and SOLUTION_FIELD in columns:
        solution_field = SOLUTION_FIELD
    return FieldNames(prompt=prompt_field, answer=answer_field, solution=solution_field)


def _text_value(row: Mapping[str, Any], field: str, where: str) -> str:
    """The field as non-empty text; integers (and integral floats) are accepted as answers."""
    if field not in row:
        raise DatasetError(f"{where}: field {field!r} is missing")
    value = row[field]
    if value is None:
        raise DatasetError(f"{where}: field {field!r} is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {field!r} must be text or a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float):
        text = str(int(value)) if value.is_integer() else repr(value)
    else:
        text = str(value)
    if not text.strip():
        raise DatasetError(f"{where}: field {field!r} is empty")
    return text


def to_record(row: Mapping[str, Any], row_index: int, fields: FieldNames, where: str) -> PromptRecord:
    """Validate one row and build its record; ``where`` names file and row in errors."""
    prompt = _text_value(row, fields.prompt, where)
    answer_text = _text_value(row, fields.answer, where)
    embedded_solution, answer = split_final_answer(answer_text)
    if not answer:
        raise DatasetError(f"{where}: field {fields.answer!r} has nothing after {FINAL_ANSWER_MARKER!r}")
    solution = embedded_solution
    if fields.solution is not None and row.get(fields.solution) not in (None, ""):
        solution = _text_value(row, fields.solution, where)
    return PromptRecord(
        prompt_id=make_prompt_id(row_index, prompt),
        prompt=prompt,
        answer=answer,
        solution=solution,
        max_new_tokens=_budget_value(row, where),
    )


def _budget_value(row: Mapping[str, Any], where: str) -> int | None:
    """The optional ``max_new_tokens`` field: an int >= 1 (an integral float is accepted), or None."""
    value = row.get(BUDGET_FIELD)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DatasetError(f"{where}: field {BUDGET_FIELD!r} must be an int >= 1 or null, got {value!r}")
    return value


def _open_binary(path: str) -> Any:
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        raise DatasetError(f"{path}: file not found (expected {supported_formats()})")
    if fs.isdir(fs_path):
        raise DatasetError(f"{path}: is a directory, not a file (expected {supported_formats()})")
    return fs.open(fs_path, "rb")


def _read_parquet(
    path: str, prompt_field: str | None, answer_field: str | None, solution_field: str | None
) -> list[PromptRecord]:
    import pyarrow.parquet as pq

    with _open_binary(path) as handle:
        try:
            parquet = pq.ParquetFile(handle)
            columns = parquet.schema_arrow.names
            fields = resolve_fields(columns, path, prompt_field, answer_field, solution_field)
            wanted = [name for name in (fields.prompt, fields.answer, fields.solution) if name is not None]
            wanted += [BUDGET_FIELD] if BUDGET_FIELD in columns else []
            table = parquet.read(columns=list(dict.fromkeys(wanted)))
        except DatasetError:
            raise
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
    return [to_record(row, index, fields, f"{path}, row {index}") for index, row in enumerate(_parquet_rows(table, path))]


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
    path: str, prompt_field: str | None, answer_field: str | None, solution_field: str | None
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
    fields: FieldNames | None = None
    for row, where, item in _json_objects(path, text):
        if fields is None:
            # The first object fixes the layout; later rows are checked against it.
            fields = resolve_fields(list(item), where, prompt_field, answer_field, solution_field)
        records.append(to_record(item, row, fields, where))
    return records


def load_prompts(
    path: str | Path,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    solution_field: str | None = None,
) -> list[PromptRecord]:
    """All records of a prompt file, in file order (see the module docstring for layouts).

    Raises :class:`DatasetError` naming the path for a missing file, an unsupported
    extension, a malformed JSON line (with its line number), a missing/null/empty field
    (with the row and field), or a file with no records. Rows are numbered from 0 in file
    order (blank JSON lines skipped); JSON Lines errors also give the 1-based line.
    """
    path_text = str(path)
    suffix = Path(path_text.split("?", 1)[0]).suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        records = _read_parquet(path_text, prompt_field, answer_field, solution_field)
    elif suffix in JSONL_SUFFIXES:
        records = _read_json_lines(path_text, prompt_field, answer_field, solution_field)
    else:
        raise DatasetError(
            f"{path_text}: unsupported file extension {suffix or '(none)'!r}; expected {supported_formats()}"
        )
    if not records:
        raise DatasetError(f"{path_text}: contains no records")
    return records
