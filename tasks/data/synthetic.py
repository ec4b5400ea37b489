"""Synthetic multi-step arithmetic: the demo's stand-in for GSM8K.

A problem is an integer expression over ``+ - *`` with standard precedence, e.g.
``What is 3+4*2-5?``. The number of operators (the steps of the reference
solution) follows a truncated power law, so the chain of thought needed varies
with a long tail, like a reasoning model's generation lengths. The reference
solution takes one step per operator (products first, then sums left to right), written
as one ``a op b=c`` line each or, for reasoning-length outputs, in words (``worked``), and
ends with ``#### <answer>``, the GSM8K final-answer line.
"""

from __future__ import annotations

import errno
import json
import os
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar, get_args

from asyncrl.configs.synthetic_specs import SOLUTION_STYLES, TALLY_LABELS, ArithmeticSpec, SolutionStyle

if TYPE_CHECKING:
    import pyarrow as pa

Operator = Literal["+", "-", "*"]
OPERATORS: tuple[str, ...] = get_args(Operator)
_Drawn = TypeVar("_Drawn")
FINAL_ANSWER_MARKER = "####"
PROMPT_TEMPLATE = "What is {expression}?"
SPLIT_FILES: dict[str, str] = {"train": "train.parquet", "heldout": "heldout.parquet"}


@dataclass(frozen=True)
class Problem:
    """``numbers[0] operators[0] numbers[1] ... operators[k-1] numbers[k]``; ``lettered``:
    the prompt names each term by a letter (``a+7 b-2``: the ``tally`` style's problems)."""

    numbers: tuple[int, ...]
    operators: tuple[Operator, ...]
    lettered: bool = False

    def __post_init__(self) -> None:
        if len(self.numbers) != len(self.operators) + 1:
            raise ValueError(
                f"Problem: need len(numbers) == len(operators) + 1, got {len(self.numbers)} numbers "
                f"and {len(self.operators)} operators"
            )
        if not self.operators:
            raise ValueError("Problem: needs at least one operator")
        bad = [op for op in self.operators if op not in OPERATORS]
        if bad:
            raise ValueError(f"Problem: unknown operator {bad[0]!r}; allowed: {', '.join(OPERATORS)}")
        if any(n < 0 for n in self.numbers):
            raise ValueError(f"Problem: numbers must be non-negative, got {self.numbers}")
        if self.lettered and ("*" in self.operators or len(self.numbers) > len(TALLY_LABELS)):
            raise ValueError(f"Problem: a lettered sum has only + and - and at most {len(TALLY_LABELS)} terms")

    @property
    def num_steps(self) -> int:
        return len(self.operators)

    @property
    def expression(self) -> str:
        parts = [str(self.numbers[0])]
        for op, number in zip(self.operators, self.numbers[1:], strict=True):
            parts.append(f"{op}{number}")
        return "".join(parts)

    @property
    def lettered_terms(self) -> list[tuple[str, str, int]]:
        """(letter, sign, number) of each term, the first one ``+``: ``a+7 b-2`` names them so."""
        return list(zip(TALLY_LABELS, ("+", *self.operators), self.numbers, strict=False))

    @property
    def prompt(self) -> str:
        if self.lettered:
            terms = (f"{label}{sign}{n}" for label, sign, n in self.lettered_terms)
            return PROMPT_TEMPLATE.format(expression=" ".join(terms))
        return PROMPT_TEMPLATE.format(expression=self.expression)

    @property
    def value(self) -> int:
        return _solve(self)[1]

    @property
    def answer(self) -> str:
        """The exact integer result as a string, e.g. ``"-13"``."""
        return str(self.value)

    @property
    def solution(self) -> str:
        return reference_solution(self)


def _apply(op: Operator, left: int, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    return left * right


Step = tuple[int, Operator, int, int]
"""One step of a solution: (left, operator, right, result)."""

OPERATOR_WORDS: dict[str, str] = {"+": "add", "-": "subtract", "*": "multiply it by"}


def _solve(problem: Problem) -> tuple[list[Step], int]:
    """The steps and the value under standard precedence.

    Products are reduced first, each ``*`` one step ``a*b=c`` (left to right within
    a product term); then the terms are combined left to right, each ``+``/``-`` one
    step. So there are exactly ``num_steps`` steps.
    """
    steps: list[Step] = []
    terms: list[int] = [problem.numbers[0]]
    signs: list[Operator] = []
    for op, number in zip(problem.operators, problem.numbers[1:], strict=True):
        if op == "*":
            product = terms[-1] * number
            steps.append((terms[-1], "*", number, product))
            terms[-1] = product
        else:
            signs.append(op)
            terms.append(number)
    total = terms[0]
    for sign, term in zip(signs, terms[1:], strict=True):
        new_total = _apply(sign, total, term)
        steps.append((total, sign, term, new_total))
        total = new_total
    return steps, total


def format_final_answer(answer: str | int) -> str:
    """The last line of a solution: ``#### <answer>`` (GSM8K's format)."""
    return f"{FINAL_ANSWER_MARKER} {answer}"


INVERSE_OPERATORS: dict[str, str] = {"+": "-", "-": "+"}


def worked_step(index: int, step: Step) -> str:
    """Step ``index`` (1-based) written out as a reasoning model writes its work: what is
    taken, the operation, a check of its result by the inverse operation (for ``+`` and
    ``-``), the result. About 85 bytes, each byte one token of the tiny tokenizer::

        Step 1: take 3 and add 4.
        3 + 4 = 7.
        Check: 7 - 4 = 3, as it should be.
        The result is 7.
    """
    left, op, right, result = step
    lines = [f"Step {index}: take {left} and {OPERATOR_WORDS[op]} {right}.", f"{left} {op} {right} = {result}."]
    if op in INVERSE_OPERATORS:
        lines.append(f"Check: {result} {INVERSE_OPERATORS[op]} {right} = {left}, as it should be.")
    lines.append(f"The result is {result}.")
    return "\n".join(lines)


def tally_lines(problem: Problem) -> list[str]:
    """One line a term of a lettered sum, the running total kept: ``a+7: 0 + 7 = 7``,
    ``b-2: 7 - 2 = 5``, ... Each line starts with its term as the prompt writes it
    (:attr:`Problem.prompt`), so the letter, the next letter after the line above's, leads to
    the term (the token after the letter in the prompt), then adds it to the line above's total:
    about 17 tokens a step."""
    total, lines = 0, []
    for label, sign, number in problem.lettered_terms:
        new_total = _apply(sign, total, number)
        lines.append(f"{label}{sign}{number}: {total} {sign} {number} = {new_total}")
        total = new_total
    return lines


def reference_solution(problem: Problem, style: SolutionStyle = "lines") -> str:
    """The correct solution in ``style``, ending ``#### <answer>``.

    ``lines``: one ``a op b=c`` line per operator; ``3+4*2-5`` gives
    ``4*2=8 / 3+8=11 / 11-5=6 / #### 6`` (newline-separated).
    ``worked``: each step as :func:`worked_step`, then ``The answer is 6.`` and ``#### 6``.
    ``tally`` (a lettered sum, no ``*``): :func:`tally_lines`, then ``#### <answer>``.
    """
    steps, value = _solve(problem)
    if style == "lines":
        lines = [f"{left}{op}{right}={result}" for left, op, right, result in steps]
    elif style == "worked":
        lines = [worked_step(i, step) for i, step in enumerate(steps, start=1)] + [f"The answer is {value}."]
    elif style == "tally":
        lines = tally_lines(problem)
    else:
        raise ValueError(f"reference_solution: style must be one of {', '.join(SOLUTION_STYLES)}, got {style!r}")
    return "\n".join([*lines, format_final_answer(value)])


def mixed_solutions(
    problems: Sequence[Problem], answer_only_share: float, seed: int, style: SolutionStyle = "lines"
) -> list[str]:
    """Solutions of a warm-start set: round(answer_only_share * n) of the n problems, chosen
    uniformly with ``seed``, get only the final-answer line ``#### <answer>``; the others
    get the worked :func:`reference_solution` in ``style``. Every solution's final answer is correct."""
    if not 0.0 <= answer_only_share <= 1.0:
        raise ValueError(f"mixed_solutions: answer_only_share must be in [0, 1], got {answer_only_share}")
    # A seed of its own: random.Random(seed).sample(range(n), k) draws the same numbers as a
    # Random(seed).shuffle of n items (both are Fisher-Yates), so with a plain int seed the
    # SFT batch order (seeded with the run seed) would serve all answer-only examples first.
    rng = random.Random(f"answer-only:{seed}")
    chosen = set(rng.sample(range(len(problems)), round(answer_only_share * len(problems))))
    return [
        format_final_answer(p.answer) if i in chosen else reference_solution(p, style) for i, p in enumerate(problems)
    ]


def step_weights(spec: ArithmeticSpec) -> tuple[list[int], list[float]]:
    """Steps k = min_steps..max_steps and weights w_k = k ** -step_exponent (unnormalised)."""
    steps = list(range(spec.min_steps, spec.max_steps + 1))
    return steps, [k**-spec.step_exponent for k in steps]


def sample_problem(rng: random.Random, spec: ArithmeticSpec) -> Problem:
    """One problem drawn from ``spec`` with ``rng`` (see :class:`ArithmeticSpec`)."""
    steps, weights = step_weights(spec)
    k = rng.choices(steps, weights=weights)[0]
    numbers = [rng.randint(1, spec.max_addend)]
    operators: list[Operator] = []
    total = numbers[0]
    for _ in range(k):
        if rng.random() < spec.mul_prob:
            operators.append("*")
            numbers.append(rng.randint(2, spec.max_factor))
            continue
        if spec.max_total is None:  # the sign, then the number: the draws of every earlier dataset
            operators.append(rng.choice(("+", "-")))
            numbers.append(rng.randint(1, spec.max_addend))
        else:  # the number, then a sign that keeps the running total in [0, max_total]
            numbers.append(rng.randint(1, spec.max_addend))
            allowed = [op for op in ("+", "-") if 0 <= _apply(op, total, numbers[-1]) <= spec.max_total]
            operators.append(rng.choice(allowed))
        total = _apply(operators[-1], total, numbers[-1])
    return Problem(numbers=tuple(numbers), operators=tuple(operators), lettered=spec.solution_style == "tally")


def draw_distinct(n: int, draw: Callable[[], _Drawn], prompt_of: Callable[[_Drawn], str], spec: object) -> list[_Drawn]:
    """``n`` results of ``draw()`` with distinct prompts, in draw order: at most 20 * n + 1000
    draws, else ``ValueError`` saying the ``spec``'s problem space is too small."""
    seen: set[str] = set()
    drawn: list[_Drawn] = []
    max_draws = 20 * n + 1000
    for _ in range(max_draws):
        if len(drawn) == n:
            break
        item = draw()
        if prompt_of(item) not in seen:
            seen.add(prompt_of(item))
            drawn.append(item)
    if len(drawn) < n:
        raise ValueError(
            f"found only {len(drawn)} distinct problems of the {n} asked in {max_draws} draws; "
            f"widen the {type(spec).__name__} ({spec})"
        )
    return drawn


def make_arithmetic_dataset(n: int, seed: int, spec: ArithmeticSpec | None = None) -> list[Problem]:
    """``n`` problems with distinct prompts, deterministic in (n, seed, spec) (:func:`draw_distinct`)."""
    if n < 0:
        raise ValueError(f"make_arithmetic_dataset: n must be >= 0, got {n}")
    spec = spec or ArithmeticSpec()
    rng = random.Random(seed)
    return draw_distinct(n, lambda: sample_problem(rng, spec), lambda problem: problem.prompt, spec)


def split_train_heldout(problems: Sequence[Problem], n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Shuffle with ``seed`` and cut: (train, held-out) with ``len(held-out) == n_heldout``.

    Prompts must be distinct, so no held-out prompt appears in train.
    """
    if not 0 <= n_heldout <= len(problems):
        raise ValueError(f"split_train_heldout: n_heldout must be in [0, {len(problems)}], got {n_heldout}")
    seen: set[str] = set()
    for index, problem in enumerate(problems):
        if problem.prompt in seen:
            raise ValueError(f"split_train_heldout: problem {index} repeats the prompt {problem.prompt!r}")
        seen.add(problem.prompt)
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    heldout = [problems[i] for i in order[:n_heldout]]
    train = [problems[i] for i in order[n_heldout:]]
    return train, heldout


def write_problems(
    path: Path,
    problems: Sequence[Problem],
    metadata: dict[str, str] | None = None,
    solutions: Sequence[str] | None = None,
    style: SolutionStyle = "lines",
) -> Path:
    """Write Parquet columns ``prompt``, ``answer`` (exact integer string), ``solution``
    (``solutions`` if given, else each problem's reference solution in ``style``) and
    ``num_steps``; atomic (temporary file, then rename)."""
    import pyarrow as pa

    if solutions is None:
        solutions = [reference_solution(p, style) for p in problems]
    elif len(solutions) != len(problems):
        raise ValueError(f"write_problems: {len(solutions)} solutions for {len(problems)} problems")

    table = pa.table(
        {
            "prompt": pa.array([p.prompt for p in problems], pa.string()),
            "answer": pa.array([p.answer for p in problems], pa.string()),
            "solution": pa.array(list(solutions), pa.string()),
            "num_steps": pa.array([p.num_steps for p in problems], pa.int32()),
        }
    )
    return write_table_atomic(path, table, metadata)


def write_table_atomic(path: Path, table: pa.Table, metadata: dict[str, str] | None = None) -> Path:
    """Write ``table`` (with ``metadata`` as its schema metadata, if given) as Parquet at
    ``path``: a temporary file in the same directory, then a rename, so a reader sees the
    old file or the whole new one; a full disk raises ``OSError(ENOSPC)`` naming ``path``."""
    import pyarrow.parquet as pq

    if metadata:
        table = table.replace_schema_metadata(metadata)
    path = Path(path)
    check_output_dir(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _no_space(exc, path) or exc
    os.close(fd)
    try:
        pq.write_table(table, tmp_name)
        os.replace(tmp_name, path)
    except BaseException as exc:
        Path(tmp_name).unlink(missing_ok=True)
        full = _no_space(exc, path)
        if full is not None:
            raise full from exc
        raise
    return path


def check_output_dir(out_dir: Path) -> None:
    """Raise ``NotADirectoryError`` naming ``out_dir`` and the file in the way when
    ``out_dir`` or one of its parents is a file (nothing can be written under it)."""
    out_dir = Path(out_dir)
    for candidate in (out_dir, *out_dir.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is a file" if candidate == out_dir else f"is under {candidate}, a file"
                raise NotADirectoryError(f"{out_dir}: {where}, not a directory; choose another output directory")
            return


def _no_space(exc: BaseException, path: Path) -> OSError | None:
    """A full disk (ENOSPC, as pyarrow or the OS reports it) as ``OSError`` naming ``path``."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def _generator_metadata(seed: int, spec: ArithmeticSpec, **extra: int) -> dict[str, str]:
    return {"asyncrl.synthetic": json.dumps({"seed": seed, "spec": asdict(spec), **extra}, sort_keys=True)}


def write_synthetic_dataset(path: Path, n: int, seed: int, spec: ArithmeticSpec | None = None) -> Path:
    """Write ``make_arithmetic_dataset(n, seed, spec)`` to Parquet at ``path``."""
    spec = spec or ArithmeticSpec()
    problems = make_arithmetic_dataset(n, seed, spec)
    return write_problems(path, problems, _generator_metadata(seed, spec, n=n), style=spec.solution_style)


def write_synthetic_splits(
    out_dir: Path, *, n_train: int, n_heldout: int, seed: int, spec: ArithmeticSpec | None = None
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``heldout.parquet`` under ``out_dir`` (no shared prompt).

    Both come from one draw of ``n_train + n_heldout`` distinct problems, split by
    :func:`split_train_heldout`. Returns {"train": path, "heldout": path}.
    """
    if n_train < 0 or n_heldout < 0:
        raise ValueError(f"write_synthetic_splits: n_train and n_heldout must be >= 0, got {n_train}, {n_heldout}")
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    spec = spec or ArithmeticSpec()
    problems = make_arithmetic_dataset(n_train + n_heldout, seed, spec)
    train, heldout = split_train_heldout(problems, n_heldout, seed)
    metadata = _generator_metadata(seed, spec, n_train=n_train, n_heldout=n_heldout)
    return {
        "train": write_problems(out_dir / SPLIT_FILES["train"], train, metadata, style=spec.solution_style),
        "heldout": write_problems(out_dir / SPLIT_FILES["heldout"], heldout, metadata, style=spec.solution_style),
    }
