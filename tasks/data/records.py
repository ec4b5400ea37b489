"""The record a prompt file's row becomes, and the error a bad file raises.

:mod:`asyncrl.tasks.data.loader` re-exports everything here; import it from there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncrl.tasks.reward.types import CodeTests

MATH_TASK = "math"
CODE_TASK = "code"
BUILTIN_TASKS: tuple[str, ...] = (MATH_TASK, CODE_TASK)


class DatasetError(ValueError):
    """A prompt file that cannot be used; the message names the file, row and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with the data of the reward that scores it.

    ``prompt_id`` = ``"{row:06d}-{sha256(prompt)[:10]}"``: stable across reads of the same
    file, distinct within it even when prompts repeat, and changed if the text changes.
    ``task`` names the reward: ``math`` (``answer`` is the reference answer), ``code``
    (``tests`` are the unit tests; ``answer`` is empty) or a plug-in configured under
    ``reward.plugins`` (it gets ``answer`` as its reference and ``fields`` as keyword
    arguments).
    """

    prompt_id: str
    prompt: str
    answer: str
    solution: str | None = None
    max_new_tokens: int | None = None
    """This prompt's output budget per sample (column ``max_new_tokens``); None = the run's."""
    task: str = MATH_TASK
    tests: CodeTests | None = None
    """The unit tests of a ``code`` row (None for every other task)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The row's own JSON-able fields, passed to a plug-in reward (empty for math and code)."""
    conversation: Mapping[str, Any] | None = None
    """A warm-start demonstration (column ``conversation``): ``{"messages": [...], "tools":
    [...]}`` in OpenAI's chat format; the warm start trains on its assistant turns."""


def make_prompt_id(row: int, prompt: str) -> str:
    """``"{row:06d}-{sha256(prompt)[:10]}"`` (see :class:`PromptRecord`)."""
    return f"{row:06d}-{hashlib.sha256(prompt.encode('utf-8')).hexdigest()[:10]}"


def check_task(task: Any, plugins: Collection[str], where: str, field_name: str = "task") -> str:  # noqa: ANN401
    """``task`` if it names ``math``, ``code`` or a configured plug-in; else a
    :class:`DatasetError` naming ``where``, the field and the known tasks."""
    known = [*BUILTIN_TASKS, *(name for name in plugins if name not in BUILTIN_TASKS)]
    if not isinstance(task, str):
        raise DatasetError(f"{where}: field {field_name!r} must be text, got {type(task).__name__} {task!r}")
    if task not in known:
        plugin_note = "" if len(known) > len(BUILTIN_TASKS) else " (no plug-ins configured)"
        raise DatasetError(
            f"{where}: field {field_name!r}: unknown task {task!r}; known tasks: {', '.join(known)}{plugin_note}; "
            "a plug-in task must be configured under reward.plugins"
        )
    return task


def sample_budget(record: PromptRecord, max_new_tokens: int) -> int:
    """Output-token budget of each sample of ``record``: min(record.max_new_tokens, max_new_tokens),
    or ``max_new_tokens`` when the prompt sets none."""
    return max_new_tokens if record.max_new_tokens is None else min(record.max_new_tokens, max_new_tokens)
