"""The unit tests of a code row, read from each code layout's columns.

Each reader takes one row (a dict: a JSON Lines object or a Parquet row, whose nested
structs and lists arrive as dicts and lists) and returns ``(CodeTests, solution or None)``;
given ``origins``, it also adds the row's test count per origin (:data:`TEST_ORIGINS`) to it.
A column may hold JSON text or the same value nested; both are accepted. Every refusal is a
:class:`DatasetError` naming the file and row (``where``) and the field.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import pickle
import re
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.reward.code_reward import call_case_problem, code_tests_from_json
from asyncrl.tasks.reward.types import CallCase, CodeTests, StdioCase

TESTS_FIELD = "tests"
CODECONTESTS_TESTS: tuple[str, ...] = ("public_tests", "private_tests", "generated_tests")
PUBLIC, PRIVATE, GENERATED, UNSPLIT = "public", "private", "generated", "unsplit"
TEST_ORIGINS: tuple[str, ...] = (PUBLIC, PRIVATE, GENERATED, UNSPLIT)
"""Where a row's tests came from: LiveCodeBench's and CodeContests' public/private/generated
columns, or ``unsplit`` for a layout with one test set (asyncrl ``tests``, APPS/TACO
``input_output``)."""
_CODECONTESTS_ORIGIN = dict(zip(CODECONTESTS_TESTS, (PUBLIC, PRIVATE, GENERATED)))
CODECONTESTS_PYTHON3: tuple[Any, ...] = (3, "3", "PYTHON3", "python3")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|secs|second|seconds|ms|milliseconds)?\s*$", re.IGNORECASE)


class CodeReader(Protocol):
    def __call__(
        self, row: Mapping[str, Any], where: str, origins: Counter[str] | None = None
    ) -> tuple[CodeTests, str | None]: ...


def _fail(where: str, name: str, detail: str) -> DatasetError:
    return DatasetError(f"{where}: field {name!r}: {detail}")


def _kind(value: Any) -> str:  # noqa: ANN401
    return "null" if value is None else type(value).__name__


def json_field(row: Mapping[str, Any], name: str, where: str, *, required: bool = True) -> Any:  # noqa: ANN401
    """The field's value, JSON text parsed; None when absent/null/blank and not required."""
    value = row.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        if not required:
            return None
        if name not in row:
            raise DatasetError(f"{where}: field {name!r} is missing")
        raise DatasetError(f"{where}: field {name!r} is {'null' if value is None else 'empty'}")
    if isinstance(value, (bytes, bytearray)):
        raise _fail(where, name, "expected JSON text or a nested value, got bytes")
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise _fail(where, name, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def _json_text(value: Any, where: str, name: str, what: str) -> str:  # noqa: ANN401
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _fail(where, name, f"{what} is not JSON-able ({exc})") from None


def _parse_json_text(text: Any, where: str, name: str, what: str) -> Any:  # noqa: ANN401
    if not isinstance(text, str):
        raise _fail(where, name, f"{what} must be JSON text, got {_kind(text)}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(where, name, f"{what} is not valid JSON ({exc.msg}): {text!r:.80}") from None


def _positive_seconds(value: Any, where: str, name: str, what: str = "") -> float:  # noqa: ANN401
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(where, name, f"{what}must be a positive number of seconds, got {value!r}")
    return float(value)


def _checked(case: CallCase, where: str, name: str, what: str) -> CallCase:
    """``case`` if the code reward can run it (``call_case_problem``), else a refusal."""
    problem = call_case_problem(case)
    if problem:
        raise _fail(where, name, f"{what}: {problem}")
    return case


# ----- asyncrl's own layout: `prompt` + `tests` -----


def parse_tests(data: Any, where: str, name: str = TESTS_FIELD) -> CodeTests:  # noqa: ANN401
    """The tests-file format of ``code_reward`` (``stdio``, ``asserts``, ``calls``,
    ``time_limit_s``), checked by its own ``code_tests_from_json``; null entries (Parquet's
    absent struct fields) count as absent."""
    if isinstance(data, dict):
        data = {key: value for key, value in data.items() if value is not None}
    try:
        return code_tests_from_json(data, f"{where}: field {name!r}")
    except ValueError as exc:
        raise DatasetError(str(exc)) from None


def read_asyncrl_code(
    row: Mapping[str, Any], where: str, origins: Counter[str] | None = None
) -> tuple[CodeTests, str | None]:
    """``tests`` (tests-file format) + optional ``solution`` (a reference program)."""
    tests = parse_tests(json_field(row, TESTS_FIELD, where), where)
    if origins is not None:
        origins[UNSPLIT] += tests.count
    solution = row.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise _fail(where, "solution", f"must be text, got {_kind(solution)}")
    return tests, solution or None


# ----- APPS / TACO: `question` + `input_output` -----


def _lines(value: Any, where: str, name: str, what: str) -> str:  # noqa: ANN401
    """Text, or a list of lines (TACO) joined with newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise _fail(where, name, f"{what} must be text or a list of text lines, got {_kind(value)} {value!r:.60}")


def parse_time_limit(value: Any, where: str, name: str) -> float | None:  # noqa: ANN401
    """A number of seconds or text like ``"2 seconds"``/``"1.5 s"``/``"500 ms"``; None, blank
    or ``"None"`` is no limit."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise _fail(where, name, f"must be a number of seconds or text like '2 seconds', got {value!r}")
        seconds = float(match.group(1)) / (1000.0 if (match.group(2) or "").lower() in ("ms", "milliseconds") else 1.0)
        return _positive_seconds(seconds, where, name)
    return _positive_seconds(value, where, name)


def read_apps(row: Mapping[str, Any], where: str, origins: Counter[str] | None = None) -> tuple[CodeTests, str | None]:
    """``input_output`` ``{"inputs", "outputs", "fn_name"?}``, optional ``solutions`` (a
    JSON list of programs; the first is the solution) and ``time_limit``."""
    name = "input_output"
    data = json_field(row, name, where)
    if not isinstance(data, dict):
        raise _fail(where, name, f"expected an object with 'inputs' and 'outputs', got {_kind(data)}")
    inputs, outputs = data.get("inputs"), data.get("outputs")
    for key, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list):
            raise _fail(where, name, f"{key!r} must be a list, got {_kind(value)}")
    if not inputs:
        raise _fail(where, name, "no tests: 'inputs' is empty")
    if len(inputs) != len(outputs):
        raise _fail(where, name, f"{len(inputs)} inputs but {len(outputs)} outputs")
    function = data.get("fn_name")
    stdio: list[StdioCase] = []
    calls: list[CallCase] = []
    if function is None:
        for i, (given, wanted) in enumerate(zip(inputs, outputs)):
            stdio.append(
                StdioCase(input=_lines(given, where, name, f"inputs[{i}]"), output=_lines(wanted, where, name, f"outputs[{i}]"))
            )
    else:
        if not isinstance(function, str) or not function.isidentifier():
            raise _fail(where, name, f"'fn_name' must be a function name (a Python identifier), got {function!r}")
        for i, (given, wanted) in enumerate(zip(inputs, outputs)):
            if not isinstance(given, list):
                raise _fail(where, name, f"inputs[{i}] must be the argument list of {function}(), got {_kind(given)}")
            case = CallCase(
                function=function,
                arguments=_json_text(given, where, name, f"inputs[{i}]"),
                expected=_json_text(wanted, where, name, f"outputs[{i}]"),
            )
            calls.append(_checked(case, where, name, f"case {i}"))
    limit = parse_time_limit(row.get("time_limit"), where, "time_limit")
    if origins is not None:
        origins[UNSPLIT] += len(stdio) + len(calls)
    return CodeTests(stdio=tuple(stdio), calls=tuple(calls), time_limit_s=limit), _first_solution(row, where)


def _first_solution(row: Mapping[str, Any], where: str) -> str | None:
    programs = json_field(row, "solutions", where, required=False)
    if programs is None:
        return None
    if not isinstance(programs, list) or not all(isinstance(p, str) for p in programs):
        raise _fail(where, "solutions", f"must be a JSON list of programs, got {_kind(programs)}")
    return next((p for p in programs if p.strip()), None)


# ----- LiveCodeBench: `question_content` + `public_test_cases` + `metadata` -----


def _lcb_cases(cases: Any, where: str, name: str, function: Callable[[], str]) -> list[StdioCase | CallCase]:  # noqa: ANN401
    if not isinstance(cases, list):
        raise _fail(where, name, f"expected a list of test cases, got {_kind(cases)}")
    built: list[StdioCase | CallCase] = []
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise _fail(where, name, f"[{i}] must be an object with 'input', 'output' and 'testtype', got {_kind(case)}")
        given, wanted, kind = case.get("input"), case.get("output"), case.get("testtype")
        for key, value in (("input", given), ("output", wanted)):
            if not isinstance(value, str):
                raise _fail(where, name, f"[{i}].{key} must be text, got {_kind(value)}")
        if kind == "stdin":
            built.append(StdioCase(input=given, output=wanted))
        elif kind == "functional":
            arguments = [
                _parse_json_text(line, where, name, f"[{i}].input line {n}")
                for n, line in enumerate(given.splitlines(), start=1)
                if line.strip()
            ]
            expected = _parse_json_text(wanted, where, name, f"[{i}].output")
            case = CallCase(function=function(), arguments=json.dumps(arguments), expected=json.dumps(expected))
            built.append(_checked(case, where, name, f"[{i}]"))
        else:
            raise _fail(where, name, f"[{i}].testtype must be 'stdin' or 'functional', got {kind!r}")
    return built


class _RefusedGlobal(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _PlainUnpickler(pickle.Unpickler):
    """Builds only pickle's own values (str, bytes, numbers, bool, None, list, tuple, dict,
    set): every global (a class or function, the only way a pickle runs code) is refused."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401
        raise _RefusedGlobal(f"{module}.{name}")


def decode_lcb_private(text: str, where: str, name: str = "private_test_cases") -> Any:  # noqa: ANN401
    """LiveCodeBench's released private cases: ``base64(zlib(pickle(JSON text)))``, read
    with :class:`_PlainUnpickler`, so a pickle naming any global is refused, never run."""
    try:
        packed = zlib.decompress(base64.b64decode(text))
    except (binascii.Error, zlib.error, ValueError) as exc:
        raise _fail(where, name, f"neither a JSON list nor base64(zlib(pickle)) text ({exc}): {text!r:.60}") from None
    try:
        value = _PlainUnpickler(io.BytesIO(packed)).load()
    except _RefusedGlobal as exc:
        raise _fail(where, name, f"the pickle names a global ({exc.name}); refusing to load it") from None
    except Exception as exc:  # a corrupt pickle raises many types; no code of the file ran
        raise _fail(where, name, f"not a readable pickle ({type(exc).__name__}: {exc})") from None
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(where, name, "the unpickled bytes are not UTF-8 text") from None
    return _parse_json_text(value, where, name, "the unpickled value") if isinstance(value, str) else value


def read_livecodebench(
    row: Mapping[str, Any], where: str, origins: Counter[str] | None = None
) -> tuple[CodeTests, str | None]:
    """``public_test_cases`` and optional ``private_test_cases``: a list of ``{"input",
    "output", "testtype": "stdin" | "functional"}``, as JSON text, nested, or (private, as
    released) :func:`decode_lcb_private` text. A functional case's input holds one JSON
    value per line (the arguments) and its output the JSON return value; ``metadata`` (JSON)
    names the function as ``func_name``."""

    def function() -> str:
        metadata = json_field(row, "metadata", where, required=False)
        name = metadata.get("func_name") if isinstance(metadata, dict) else None
        if not isinstance(name, str) or not name.isidentifier():
            raise _fail(
                where, "metadata", f"a functional test case needs 'func_name' (a Python identifier), got metadata {metadata!r:.80}"
            )
        return name

    public = _lcb_cases(json_field(row, "public_test_cases", where), where, "public_test_cases", function)
    private_field = "private_test_cases"
    private = row.get(private_field)
    if isinstance(private, str) and private.strip() and not private.lstrip().startswith("["):
        private = decode_lcb_private(private.strip(), where, private_field)
    else:
        private = json_field(row, private_field, where, required=False)
    private_cases = [] if private is None else _lcb_cases(private, where, private_field, function)
    cases = public + private_cases
    if not cases:
        raise _fail(where, "public_test_cases", "no tests: the list is empty")
    if origins is not None:
        origins[PUBLIC] += len(public)
        origins[PRIVATE] += len(private_cases)
    stdio = tuple(c for c in cases if isinstance(c, StdioCase))
    calls = tuple(c for c in cases if isinstance(c, CallCase))
    return CodeTests(stdio=stdio, calls=calls), None


# ----- CodeContests: `description` + public/private/generated tests -----


def _seconds_and_nanos(value: Any, where: str) -> float | None:  # noqa: ANN401
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = json_field({"time_limit": value}, "time_limit", where)
    if isinstance(value, dict):
        seconds, nanos = value.get("seconds") or 0, value.get("nanos") or 0
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in (seconds, nanos)):
            raise _fail(where, "time_limit", f"'seconds' and 'nanos' must be numbers >= 0, got {value!r}")
        total = seconds + nanos / 1e9
        return float(total) if total > 0 else None
    return parse_time_limit(value, where, "time_limit")


def read_codecontests(
    row: Mapping[str, Any], where: str, origins: Counter[str] | None = None
) -> tuple[CodeTests, str | None]:
    """``public_tests``/``private_tests``/``generated_tests`` ``{"input": [...], "output":
    [...]}`` (stdio cases, in that order), ``time_limit`` ``{"seconds", "nanos"}`` and
    ``solutions`` ``{"language": [...], "solution": [...]}`` (the first Python 3 one, language 3)."""
    stdio: list[StdioCase] = []
    for name in CODECONTESTS_TESTS:
        tests = json_field(row, name, where, required=False)
        if tests is None:
            continue
        if not isinstance(tests, dict):
            raise _fail(where, name, f"expected an object with 'input' and 'output' lists, got {_kind(tests)}")
        inputs, outputs = tests.get("input") or [], tests.get("output") or []
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise _fail(where, name, "'input' and 'output' must be lists")
        if len(inputs) != len(outputs):
            raise _fail(where, name, f"{len(inputs)} inputs but {len(outputs)} outputs")
        for i, (given, wanted) in enumerate(zip(inputs, outputs)):
            stdio.append(StdioCase(input=_lines(given, where, name, f"input[{i}]"), output=_lines(wanted, where, name, f"output[{i}]")))
        if origins is not None:
            origins[_CODECONTESTS_ORIGIN[name]] += len(inputs)
    if not stdio:
        raise DatasetError(f"{where}: no tests: fields {', '.join(map(repr, CODECONTESTS_TESTS))} are all absent or empty")
    limit = _seconds_and_nanos(row.get("time_limit"), where)
    return CodeTests(stdio=tuple(stdio), time_limit_s=limit), _python3_solution(row, where)


def _python3_solution(row: Mapping[str, Any], where: str) -> str | None:
    solutions = json_field(row, "solutions", where, required=False)
    if solutions is None:
        return None
    if not isinstance(solutions, dict):
        raise _fail(where, "solutions", f"expected an object with 'language' and 'solution' lists, got {_kind(solutions)}")
    languages, programs = solutions.get("language") or [], solutions.get("solution") or []
    if not isinstance(languages, list) or not isinstance(programs, list) or len(languages) != len(programs):
        raise _fail(where, "solutions", "'language' and 'solution' must be lists of the same length")
    return next(
        (p for lang, p in zip(languages, programs) if lang in CODECONTESTS_PYTHON3 and isinstance(p, str) and p.strip()),
        None,
    )
