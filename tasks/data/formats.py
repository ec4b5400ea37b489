"""Row layouts: which columns hold the prompt, the task and the task's data, and how one
row becomes a :class:`PromptRecord` (the list of layouts is in :mod:`asyncrl.tasks.data.loader`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.data.code_formats import (
    CODECONTESTS_TESTS,
    TESTS_FIELD,
    CodeReader,
    read_apps,
    read_asyncrl_code,
    read_codecontests,
    read_livecodebench,
)
from asyncrl.tasks.data.records import CODE_TASK, MATH_TASK, DatasetError, PromptRecord, check_task, make_prompt_id

PROMPT_FIELDS: tuple[str, ...] = ("prompt", "question")
ANSWER_FIELD = "answer"
SOLUTION_FIELD = "solution"
BUDGET_FIELD = "max_new_tokens"
TASK_FIELD = "task"
STARTER_FIELD = "starter_code"
CONVERSATION_FIELD = "conversation"
"""A warm-start demonstration: JSON ``{"messages": [...], "tools": [...]}`` in OpenAI's chat
format, trained on its assistant turns (:func:`conversation_value`)."""
CONVERSATION_ROLES = ("system", "user", "assistant", "tool")
FINAL_ANSWER_MARKER = "####"
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


@dataclass(frozen=True)
class Layout:
    """How the rows of one file are read. ``answer``: the column of a math row's answer
    (GSM8K ``####`` text accepted); without one, the last ``\\boxed{}`` of ``solution`` is
    the answer (MATH). ``code`` reads a code row's tests and reference program."""

    name: str
    prompt: str
    task: str
    answer: str | None
    solution: str | None
    code: CodeReader
    columns: tuple[str, ...]
    starter_code: bool = False
    """Append the row's ``starter_code`` (if any) to the prompt (APPS/TACO, LiveCodeBench)."""


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


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested
    braces included; ``\\boxed 5`` gives ``5``. None if there is none or its braces do not close."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    if rest.startswith("{"):
        depth = 0
        for index, char in enumerate(rest):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                return rest[1:index].strip()
        return None
    if rest[:1].isspace():
        token = rest.lstrip().split(None, 1)
        return token[0].split("$", 1)[0] if token else None
    return None


def _columns_text(columns: Sequence[str]) -> str:
    return ", ".join(columns) or "none"


def detect_layout(columns: Sequence[str], where: str) -> Layout:
    """The layout of a file with these columns (first match, module docstring of the loader)."""
    cols = set(columns)
    answer = ANSWER_FIELD if ANSWER_FIELD in cols else None
    common = (BUDGET_FIELD, TASK_FIELD, ANSWER_FIELD)
    if {"question_content", "public_test_cases"} <= cols:
        reads = ("question_content", "public_test_cases", "private_test_cases", "metadata", STARTER_FIELD, *common)
        return Layout("LiveCodeBench", "question_content", CODE_TASK, answer, None, read_livecodebench, reads, True)
    if "description" in cols and cols & set(CODECONTESTS_TESTS):
        reads = ("description", *CODECONTESTS_TESTS, "time_limit", "solutions", *common)
        return Layout("CodeContests", "description", CODE_TASK, answer, None, read_codecontests, reads)
    if {"question", "input_output"} <= cols:
        reads = ("question", "input_output", "solutions", "time_limit", STARTER_FIELD, *common)
        return Layout("APPS/TACO", "question", CODE_TASK, answer, None, read_apps, reads, True)
    prompt = next((name for name in (*PROMPT_FIELDS, "problem") if name in cols), None)
    if prompt is None:
        raise DatasetError(
            f"{where}: no prompt field; expected one of prompt, question (GSM8K, APPS/TACO), problem (MATH), "
            f"question_content (LiveCodeBench), description (CodeContests) (or pass prompt_field=...); "
            f"columns: {_columns_text(columns)}"
        )
    solution = SOLUTION_FIELD if SOLUTION_FIELD in cols else None
    reads = (prompt, ANSWER_FIELD, SOLUTION_FIELD, TESTS_FIELD, BUDGET_FIELD, TASK_FIELD, CONVERSATION_FIELD)
    if TESTS_FIELD in cols:
        return Layout("code", prompt, CODE_TASK, answer, solution, read_asyncrl_code, reads)
    if answer is None and solution is None and TASK_FIELD not in cols:
        raise DatasetError(
            f"{where}: answer field 'answer' is missing (a math row needs 'answer' or a MATH 'solution' with "
            f"\\boxed{{}}, a code row 'tests'; or name each row's task in a 'task' column); "
            f"columns: {_columns_text(columns)}"
        )
    name = "GSM8K" if prompt == "question" else "MATH" if answer is None else "math"
    return Layout(name, prompt, MATH_TASK, answer, solution, read_asyncrl_code, reads)


def named_layout(
    columns: Sequence[str], where: str, prompt_field: str | None, answer_field: str | None, solution_field: str | None
) -> Layout:
    """A math layout with the caller's column names (the first of ``prompt``/``question`` and
    ``answer`` by default; ``solution`` only if present)."""
    available = _columns_text(columns)
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
    reads = (prompt_field, answer_field, solution_field or SOLUTION_FIELD, TESTS_FIELD, BUDGET_FIELD, TASK_FIELD)
    return Layout("named", prompt_field, MATH_TASK, answer_field, solution_field, read_asyncrl_code, reads)


def text_value(row: Mapping[str, Any], field: str, where: str) -> str:
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


def budget_value(row: Mapping[str, Any], where: str) -> int | None:
    """The optional ``max_new_tokens`` field: an int >= 1 (an integral float is accepted), or None."""
    value = row.get(BUDGET_FIELD)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DatasetError(f"{where}: field {BUDGET_FIELD!r} must be an int >= 1 or null, got {value!r}")
    return value


def _optional_text(row: Mapping[str, Any], field: str | None, where: str) -> str | None:
    if field is None or row.get(field) in (None, ""):
        return None
    return text_value(row, field, where)


def _math(row: Mapping[str, Any], layout: Layout, where: str) -> tuple[str, str | None]:
    if layout.answer is not None or layout.solution is None:
        field = layout.answer or ANSWER_FIELD  # a math row of a code layout needs an answer
        embedded, answer = split_final_answer(text_value(row, field, where))
        if not answer:
            raise DatasetError(f"{where}: field {field!r} has nothing after {FINAL_ANSWER_MARKER!r}")
        return answer, _optional_text(row, layout.solution, where) or embedded
    solution = text_value(row, layout.solution, where)
    answer = last_boxed(solution)
    if not answer:
        raise DatasetError(
            f"{where}: field {layout.solution!r} has no complete, non-empty \\boxed{{...}} answer "
            f"and the file has no {ANSWER_FIELD!r} column"
        )
    return answer, solution


def _task(row: Mapping[str, Any], layout: Layout, where: str, plugins: Collection[str], task: str | None) -> str:
    value = row.get(TASK_FIELD)
    if value is None or value == "":
        return task or layout.task
    value = check_task(value, plugins, where, TASK_FIELD)
    if task is not None and value != task:
        raise DatasetError(f"{where}: field {TASK_FIELD!r} is {value!r}, but this file is loaded as task {task!r}")
    return value


def _plugin_fields(row: Mapping[str, Any], layout: Layout, where: str) -> dict[str, Any]:
    """Every non-null field but the prompt, task, answer, solution and budget, JSON-able."""
    taken = {layout.prompt, TASK_FIELD, layout.answer or ANSWER_FIELD, layout.solution or SOLUTION_FIELD, BUDGET_FIELD,
             CONVERSATION_FIELD}
    fields = {str(k): v for k, v in row.items() if k not in taken and v is not None}
    for key, value in fields.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"{where}: field {key!r} is not JSON-able, so a plug-in cannot get it ({exc})") from None
    return fields


def conversation_value(row: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """The row's ``conversation`` (None when absent or empty): JSON text of an object with
    ``messages``, a list of OpenAI chat messages (each with a known ``role``) holding at
    least one assistant message, and optional ``tools``, a list; else a
    :class:`DatasetError` naming the row and what is wrong."""
    raw = row.get(CONVERSATION_FIELD)
    if raw is None or raw == "":
        return None
    field = f"field {CONVERSATION_FIELD!r}"
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: {field} is not JSON: {exc}") from None
    if not isinstance(value, dict) or not isinstance(value.get("messages"), list) or not value["messages"]:
        raise DatasetError(f"{where}: {field} must be an object with a non-empty list 'messages'")
    for k, message in enumerate(value["messages"]):
        if not isinstance(message, dict) or message.get("role") not in CONVERSATION_ROLES:
            raise DatasetError(
                f"{where}: {field}: messages[{k}] must be an object whose role is one of {', '.join(CONVERSATION_ROLES)}"
            )
    if not any(m["role"] == "assistant" for m in value["messages"]):
        raise DatasetError(f"{where}: {field} has no assistant message to train on")
    if not isinstance(value.get("tools", []), list):
        raise DatasetError(f"{where}: {field}: 'tools' must be a list")
    return {"messages": value["messages"], "tools": value.get("tools", [])}


def _prompt(row: Mapping[str, Any], layout: Layout, where: str) -> str:
    prompt = text_value(row, layout.prompt, where)
    starter = row.get(STARTER_FIELD) if layout.starter_code else None
    if isinstance(starter, str) and starter.strip():
        prompt = f"{prompt.rstrip()}\n\nStart from this code:\n```python\n{starter.strip(chr(10))}\n```"
    return prompt


def build_record(
    row: Mapping[str, Any],
    index: int,
    layout: Layout,
    where: str,
    plugins: Collection[str] = (),
    task: str | None = None,
) -> PromptRecord:
    """Validate one row and build its record; ``where`` names file and row in errors;
    ``task``, if given, is every row's task (a row's own ``task`` must agree)."""
    prompt = _prompt(row, layout, where)
    row_task = _task(row, layout, where, plugins, task)
    budget = budget_value(row, where)
    base = {
        "prompt_id": make_prompt_id(index, prompt),
        "prompt": prompt,
        "max_new_tokens": budget,
        "task": row_task,
        "conversation": conversation_value(row, where),
    }
    if row_task == MATH_TASK:
        answer, solution = _math(row, layout, where)
        return PromptRecord(**base, answer=answer, solution=solution)
    if row_task == CODE_TASK:
        tests, solution = layout.code(row, where)
        return PromptRecord(**base, answer="", solution=solution, tests=tests)
    answer = _optional_text(row, layout.answer or ANSWER_FIELD, where) or ""
    solution = _optional_text(row, layout.solution or SOLUTION_FIELD, where)
    return PromptRecord(**base, answer=answer, solution=solution, fields=_plugin_fields(row, layout, where))
