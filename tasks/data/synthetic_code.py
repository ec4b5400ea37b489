"""Synthetic list-processing programs: the code demo's stand-in for a coding benchmark.

A problem asks for a short Python program that reads one line of integers, applies a chain
of list operations and prints a result (``Read ints; keep evens, add 3, sort; print the
max.``); it is checked by ``n_tests`` stdin/stdout tests in the code reward's format. Each
phrase maps to one program line, so the task is a translation a tiny byte-level model can
learn. The number of steps k in [min_steps, max_steps] follows a truncated power law,
P(k) = k ** -step_exponent / Z with Z = sum_j j ** -step_exponent, so program lengths have
a long tail like real coding answers; a program has k + 2 lines, bounded by
:func:`max_program_bytes`, and a prompt by :func:`max_prompt_bytes`. An example and the
length bounds: ``docs/internals/data.md``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

from asyncrl.configs.synthetic_specs import PROGRAM_STYLES, CodeSpec, ProgramStyle
from asyncrl.tasks.data.synthetic import draw_distinct, write_table_atomic
from asyncrl.tasks.data.records import CODE_TASK
from asyncrl.tasks.reward.types import CodeTests, StdioCase

READ_EXPRESSION = "list(map(int,input().split()))"
READ_LINE = f"a={READ_EXPRESSION}"
PROMPT_PREFIX = "Read ints; "

FinalName = Literal["sum", "max", "min", "count", "list"]
FINAL_NAMES: tuple[str, ...] = get_args(FinalName)


@dataclass(frozen=True)
class _Op:
    phrase: str
    """The statement's words; ``{k}`` is the constant."""
    line: str
    """The program's line; ``{k}`` is the constant."""
    uses_constant: bool
    apply: Callable[[list[int], int], list[int]]
    nested: str
    """The same step as an expression around the list expression ``{e}`` (the nested style)."""


STEPS: dict[str, _Op] = {
    "sort": _Op("sort", "a.sort()", False, lambda a, k: sorted(a), "sorted({e})"),
    "reverse": _Op("reverse", "a.reverse()", False, lambda a, k: a[::-1], "{e}[::-1]"),
    "evens": _Op("keep evens", "a=[x for x in a if x%2==0]", False, lambda a, k: [x for x in a if x % 2 == 0],
                 "[x for x in {e} if x%2==0]"),
    "odds": _Op("keep odds", "a=[x for x in a if x%2]", False, lambda a, k: [x for x in a if x % 2], "[x for x in {e} if x%2]"),
    "add": _Op("add {k}", "a=[x+{k} for x in a]", True, lambda a, k: [x + k for x in a], "[x+{k} for x in {e}]"),
    "sub": _Op("subtract {k}", "a=[x-{k} for x in a]", True, lambda a, k: [x - k for x in a], "[x-{k} for x in {e}]"),
    "mul": _Op("times {k}", "a=[x*{k} for x in a]", True, lambda a, k: [x * k for x in a], "[x*{k} for x in {e}]"),
    "above": _Op("keep >{k}", "a=[x for x in a if x>{k}]", True, lambda a, k: [x for x in a if x > k], "[x for x in {e} if x>{k}]"),
    "below": _Op("keep <{k}", "a=[x for x in a if x<{k}]", True, lambda a, k: [x for x in a if x < k], "[x for x in {e} if x<{k}]"),
    "double": _Op("double", "a=[x*2 for x in a]", False, lambda a, k: [x * 2 for x in a], "[x*2 for x in {e}]"),
    "square": _Op("square", "a=[x*x for x in a]", False, lambda a, k: [x * x for x in a], "[x*x for x in {e}]"),
    "increment": _Op("increment", "a=[x+1 for x in a]", False, lambda a, k: [x + 1 for x in a], "[x+1 for x in {e}]"),
    "decrement": _Op("decrement", "a=[x-1 for x in a]", False, lambda a, k: [x - 1 for x in a], "[x-1 for x in {e}]"),
    "halve": _Op("halve", "a=[x//2 for x in a]", False, lambda a, k: [x // 2 for x in a], "[x//2 for x in {e}]"),
    "negate": _Op("negate", "a=[-x for x in a]", False, lambda a, k: [-x for x in a], "[-x for x in {e}]"),
    "last_digit": _Op("last digits", "a=[x%10 for x in a]", False, lambda a, k: [x % 10 for x in a],
                      "[x%10 for x in {e}]"),
}
"""List -> list operations: statement phrase, program line, reference semantics. Those of
:data:`~asyncrl.configs.synthetic_specs.DEFAULT_OPERATIONS` come first; the rest take no constant (a task whose statements hold
no digit to copy into the program)."""

@dataclass(frozen=True)
class _Final:
    phrase: str
    line: str
    """The print line of the line-by-line program (reads ``a``)."""
    nested: str
    """The print around the list expression ``{e}`` (the nested style)."""
    output: Callable[[list[int]], str]


FINALS: dict[str, _Final] = {
    "sum": _Final("print the sum", "print(sum(a))", "print(sum({e}))", lambda a: str(sum(a))),
    "max": _Final("print the max", "print(max(a))", "print(max({e}))", lambda a: str(max(a))),
    "min": _Final("print the min", "print(min(a))", "print(min({e}))", lambda a: str(min(a))),
    "count": _Final("print the count", "print(len(a))", "print(len({e}))", lambda a: str(len(a))),
    "list": _Final("print them", "print(*a)", "print(*{e})", lambda a: " ".join(map(str, a))),
}
"""List -> output: statement phrase, print line, nested print, expected stdout (without the newline)."""


@dataclass(frozen=True)
class Step:
    name: str
    constant: int | None = None

    def __post_init__(self) -> None:
        op = STEPS.get(self.name)
        if op is None:
            raise ValueError(f"Step.name: unknown step {self.name!r}; allowed: {', '.join(STEPS)}")
        if op.uses_constant != (self.constant is not None):
            raise ValueError(
                f"Step.constant: step {self.name!r} {'needs' if op.uses_constant else 'takes no'} constant, "
                f"got {self.constant!r}"
            )

    @property
    def phrase(self) -> str:
        return STEPS[self.name].phrase.format(k=self.constant)

    @property
    def line(self) -> str:
        return STEPS[self.name].line.format(k=self.constant)

    def apply(self, values: list[int]) -> list[int]:
        return STEPS[self.name].apply(values, self.constant or 0)


@dataclass(frozen=True)
class CodeProblem:
    """Read a line of ints, apply ``steps`` in order, print by ``final``; checked by ``tests``."""

    steps: tuple[Step, ...]
    final: str
    tests: tuple[StdioCase, ...] = ()

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("CodeProblem.steps: needs at least one step")
        if self.final not in FINALS:
            raise ValueError(f"CodeProblem.final: unknown final {self.final!r}; allowed: {', '.join(FINALS)}")

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def prompt(self) -> str:
        return f"{PROMPT_PREFIX}{', '.join(s.phrase for s in self.steps)}; {FINALS[self.final].phrase}."

    @property
    def solution(self) -> str:
        """The reference program: READ_LINE, one line per step, the print line (no trailing newline)."""
        return "\n".join([READ_LINE, *(s.line for s in self.steps), FINALS[self.final].line])

    @property
    def commented_solution(self) -> str:
        """The line-by-line program with each step's and the print's phrase as a comment
        line above its code line (the statement restated as a plan), e.g.::

            a=list(map(int,input().split()))
            # add 3
            a=[x+3 for x in a]
            # print the max
            print(max(a))
        """
        lines = [READ_LINE]
        for step in self.steps:
            lines += [f"# {step.phrase}", step.line]
        return "\n".join([*lines, f"# {FINALS[self.final].phrase}", FINALS[self.final].line])

    @property
    def nested_solution(self) -> str:
        """The same program as one nested expression: each step wraps the expression of the
        steps before it, the print wraps the last, e.g. ``print(max(sorted([x+3 for x in
        list(map(int,input().split()))])))`` for "add 3, sort; print the max" (written
        inside out: the statement's last step comes first)."""
        expression = READ_EXPRESSION
        for step in self.steps:
            expression = STEPS[step.name].nested.format(e=expression, k=step.constant)
        return FINALS[self.final].nested.format(e=expression)

    def program(self, style: ProgramStyle) -> str:
        """The reference program in ``style``: ``lines`` (:attr:`solution`), ``commented``
        (:attr:`commented_solution`) or ``nested`` (:attr:`nested_solution`)."""
        if style == "lines":
            return self.solution
        if style == "commented":
            return self.commented_solution
        if style == "nested":
            return self.nested_solution
        raise ValueError(f"program style: unknown style {style!r}; allowed: {', '.join(PROGRAM_STYLES)}")

    def reduced(self, values: Sequence[int]) -> list[int]:
        """The list the final print sees for input ``values``."""
        current = list(values)
        for step in self.steps:
            current = step.apply(current)
        return current

    def expected_output(self, values: Sequence[int]) -> str:
        """Reference stdout for input ``values``, ending in a newline."""
        return FINALS[self.final].output(self.reduced(values)) + "\n"

    def code_tests(self) -> CodeTests:
        return CodeTests(stdio=self.tests)

    def tests_json(self) -> str:
        """The tests in the code reward's format: ``{"stdio": [{"input": ..., "output": ...}], "asserts": []}``."""
        return json.dumps(self.code_tests().to_json(), sort_keys=True)


LONGEST_PRINT_LINE = max(len(final.line) for final in FINALS.values())


def max_prompt_bytes(spec: CodeSpec) -> int:
    """Upper bound of a prompt's UTF-8 length: ``len(PROMPT_PREFIX) + max_steps * longest
    phrase + 2 * (max_steps - 1) (", ") + 2 ("; ") + longest final phrase + 1 (".")``."""
    phrase = max(len(STEPS[name].phrase.format(k=spec.max_constant)) for name in spec.operations)
    final = max(len(f.phrase) for f in FINALS.values())
    return len(PROMPT_PREFIX) + spec.max_steps * phrase + 2 * (spec.max_steps - 1) + 2 + final + 1


def max_program_bytes(spec: CodeSpec, style: ProgramStyle = "lines") -> int:
    """Upper bound of a reference program's length in ``style`` (``nested`` programs are
    shorter than ``lines``, so they share its bound)::

        len(READ_LINE) + 1 + max_steps * max_{op in operations} step_bytes(op) + LONGEST_PRINT_LINE
            (+ len("# ") + longest final phrase + 1 for ``commented``: the print's comment line)

    with step_bytes(op) = len(line) + 1, plus len("# ") + len(phrase) + 1 for ``commented``
    (the comment line above it), the constant at ``max_constant`` (one digit)."""

    def step_bytes(name: str) -> int:
        op = STEPS[name]
        size = len(op.line.format(k=spec.max_constant)) + 1
        return size + (2 + len(op.phrase.format(k=spec.max_constant)) + 1 if style == "commented" else 0)

    bound = len(READ_LINE) + 1 + spec.max_steps * max(map(step_bytes, spec.operations)) + LONGEST_PRINT_LINE
    if style == "commented":
        bound += 2 + max(len(f.phrase) for f in FINALS.values()) + 1
    return bound


def step_weights(spec: CodeSpec) -> tuple[list[int], list[float]]:
    """Steps k = min_steps..max_steps and weights w_k = k ** -step_exponent (unnormalised)."""
    steps = list(range(spec.min_steps, spec.max_steps + 1))
    return steps, [k**-spec.step_exponent for k in steps]


def _draw_test_input(rng: random.Random, spec: CodeSpec) -> list[int]:
    return [rng.randint(0, spec.max_value) for _ in range(rng.randint(spec.min_list_len, spec.max_list_len))]


_TEST_DRAWS = 20
"""Tries for one test input leaving a non-empty list before the problem is redrawn."""


def _draw_tests(rng: random.Random, spec: CodeSpec, problem: CodeProblem) -> tuple[StdioCase, ...] | None:
    """``n_tests`` cases whose inputs all leave a non-empty list, not all with one output;
    None when that fails (the caller redraws the problem)."""
    cases: list[StdioCase] = []
    for _ in range(spec.n_tests):
        for _ in range(_TEST_DRAWS):
            values = _draw_test_input(rng, spec)
            if problem.reduced(values):
                cases.append(StdioCase(" ".join(map(str, values)) + "\n", problem.expected_output(values)))
                break
        else:
            return None
    if len({case.output for case in cases}) == 1:
        return None
    return tuple(cases)


def sample_problem(rng: random.Random, spec: CodeSpec, max_tries: int = 1000) -> CodeProblem:
    """One problem with its tests drawn from ``spec`` with ``rng`` (see :class:`CodeSpec`)."""
    ks, weights = step_weights(spec)
    k = rng.choices(ks, weights=weights)[0]  # drawn once: redraws keep P(k) exactly the power law
    for _ in range(max_tries):
        steps = []
        for _ in range(k):
            name = rng.choice(spec.operations)
            steps.append(Step(name, rng.randint(1, spec.max_constant) if STEPS[name].uses_constant else None))
        problem = CodeProblem(steps=tuple(steps), final=rng.choice(FINAL_NAMES))
        tests = _draw_tests(rng, spec, problem)
        if tests is not None:
            return CodeProblem(steps=problem.steps, final=problem.final, tests=tests)
    raise ValueError(
        f"sample_problem: no {k}-step problem with usable tests in {max_tries} draws; widen the CodeSpec ({spec})"
    )


def make_code_dataset(n: int, seed: int, spec: CodeSpec | None = None) -> list[CodeProblem]:
    """``n`` problems with distinct prompts, deterministic in (n, seed, spec) (:func:`draw_distinct`)."""
    if n < 0:
        raise ValueError(f"make_code_dataset: n must be >= 0, got {n}")
    spec = spec or CodeSpec()
    rng = random.Random(seed)
    return draw_distinct(n, lambda: sample_problem(rng, spec), lambda problem: problem.prompt, spec)


def split_code_problems(
    problems: Sequence[CodeProblem], *, n_train: int, n_heldout: int, seed: int
) -> tuple[list[CodeProblem], list[CodeProblem], list[CodeProblem]]:
    """Shuffle with ``seed`` and cut into (train, held-out, warm-start): the first
    ``n_heldout`` are held out, the next ``n_train`` are the RL prompts, the rest the SFT
    set. Prompts must be distinct, so no prompt is in two splits."""
    if n_train < 0 or n_heldout < 0 or n_train + n_heldout > len(problems):
        raise ValueError(
            f"split_code_problems: need 0 <= n_train, n_heldout and n_train + n_heldout <= {len(problems)}, "
            f"got n_train={n_train}, n_heldout={n_heldout}"
        )
    seen: set[str] = set()
    for index, problem in enumerate(problems):
        if problem.prompt in seen:
            raise ValueError(f"split_code_problems: problem {index} repeats the prompt {problem.prompt!r}")
        seen.add(problem.prompt)
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    shuffled = [problems[i] for i in order]
    return shuffled[n_heldout : n_heldout + n_train], shuffled[:n_heldout], shuffled[n_heldout + n_train :]


def mixed_code_solutions(problems: Sequence[CodeProblem], styles: Mapping[str, float], seed: int) -> list[str]:
    """Reference programs of a warm-start set written in a mix of styles
    (:meth:`CodeProblem.program`). Style s with weight w_s gets n_s of the n problems:

        n_s = floor(n * w_s / W) (W = sum of the weights), the n - sum_s n_s left over going
        one each to the styles with the largest remainders n * w_s / W - n_s,

    the problems of each style chosen uniformly with ``seed``. Every program is correct
    (all pass the problem's tests)."""
    unknown = sorted(set(styles) - set(PROGRAM_STYLES))
    if unknown:
        raise ValueError(f"mixed_code_solutions: unknown style(s) {unknown}; allowed: {', '.join(PROGRAM_STYLES)}")
    if any(not w >= 0 for w in styles.values()) or not sum(styles.values()) > 0:
        raise ValueError(f"mixed_code_solutions: style weights must be >= 0 with a positive sum, got {dict(styles)}")
    n, total = len(problems), sum(styles.values())
    names = sorted(styles)
    exact = {name: n * styles[name] / total for name in names}
    counts = {name: int(exact[name]) for name in names}
    by_remainder = sorted(names, key=lambda name: (counts[name] - exact[name], name))
    for name in by_remainder[: n - sum(counts.values())]:
        counts[name] += 1
    assigned = [name for name in names for _ in range(counts[name])]
    # A seed of its own, so the choice is independent of the SFT batch order (seeded with the
    # run seed; see synthetic.mixed_solutions).
    random.Random(f"styles:{seed}").shuffle(assigned)
    return [p.program(style) for p, style in zip(problems, assigned, strict=True)]  # type: ignore[arg-type]


def write_code_problems(
    path: Path,
    problems: Sequence[CodeProblem],
    metadata: dict[str, str] | None = None,
    solutions: Sequence[str] | None = None,
) -> Path:
    """Write Parquet columns ``prompt``, ``tests`` (JSON text, the code reward's format),
    ``solution`` (``solutions`` if given, else each problem's line-by-line reference
    program), ``task`` (``"code"``) and ``num_steps``; atomic (temporary file, then rename)."""
    import pyarrow as pa

    if solutions is None:
        solutions = [p.solution for p in problems]
    elif len(solutions) != len(problems):
        raise ValueError(f"write_code_problems: {len(solutions)} solutions for {len(problems)} problems")
    table = pa.table(
        {
            "prompt": pa.array([p.prompt for p in problems], pa.string()),
            "tests": pa.array([p.tests_json() for p in problems], pa.string()),
            "solution": pa.array(list(solutions), pa.string()),
            "task": pa.array([CODE_TASK] * len(problems), pa.string()),
            "num_steps": pa.array([p.num_steps for p in problems], pa.int32()),
        }
    )
    return write_table_atomic(path, table, metadata)


def generator_metadata(seed: int, spec: CodeSpec, **extra: int) -> dict[str, str]:
    return {"asyncrl.synthetic": json.dumps({"task": CODE_TASK, "seed": seed, "spec": asdict(spec), **extra}, sort_keys=True)}


def write_code_splits(
    *,
    train_path: Path,
    heldout_path: Path | None,
    sft_path: Path | None,
    n_train: int,
    n_heldout: int,
    n_sft: int,
    seed: int,
    spec: CodeSpec | None = None,
    sft_styles: Mapping[str, float] | None = None,
) -> dict[str, Path]:
    """One draw of ``n_train + n_heldout + n_sft`` distinct problems, split by
    :func:`split_code_problems` and written where a path is given (the SFT split only when
    ``n_sft > 0``, its programs mixed by :func:`mixed_code_solutions` in ``sft_styles``,
    default all ``lines``). Returns {"train"|"heldout"|"sft": path} of the files written."""
    spec = spec or CodeSpec()
    problems = make_code_dataset(n_train + n_heldout + n_sft, seed, spec)
    train, heldout, sft = split_code_problems(problems, n_train=n_train, n_heldout=n_heldout, seed=seed)
    metadata = generator_metadata(seed, spec, n_train=n_train, n_heldout=n_heldout, n_sft=n_sft)
    written = {"train": write_code_problems(Path(train_path), train, metadata)}
    if heldout_path is not None:
        written["heldout"] = write_code_problems(Path(heldout_path), heldout, metadata)
    if sft_path is not None and sft:
        solutions = mixed_code_solutions(sft, sft_styles or {"lines": 1.0}, seed)
        written["sft"] = write_code_problems(Path(sft_path), sft, metadata, solutions)
    return written
