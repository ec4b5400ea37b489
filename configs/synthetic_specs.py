"""How the synthetic tasks draw their problems (arithmetic and code): the one home of their
defaults and checks, read by the ``pipeline.synthetic`` config section and by the generators
in :mod:`asyncrl.tasks.data.synthetic` and :mod:`asyncrl.tasks.data.synthetic_code`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args


SolutionStyle = Literal["lines", "worked", "tally"]
"""How a reference solution is written (:func:`asyncrl.tasks.data.synthetic.reference_solution`):
``lines`` one ``a op b=c`` line per step (tens of tokens); ``worked`` each step written out
in words and checked, about 85 tokens a step, as a reasoning model writes its work (hundreds
of tokens); ``tally`` a sum of lettered terms (``What is a+7 b-2 c+5?``) kept one line a term
(``b-2: 7 - 2 = 5``), about 17 tokens a step, so 9-16 steps are reasoning-length."""

TALLY_LABELS = "abcdefghijklmnopqrstuvwxyz"
"""The letters that name a tally problem's terms: at most 26 terms (25 steps)."""

SOLUTION_STYLES: tuple[str, ...] = get_args(SolutionStyle)


@dataclass(frozen=True)
class ArithmeticSpec:
    """How problems are drawn, and how their reference solutions are written.

    - steps: k in [min_steps, max_steps] with P(k) proportional to k ** -step_exponent.
    - operators: ``*`` with probability mul_prob, else ``+`` or ``-`` with equal chance.
    - operands: first number and ``+``/``-`` operands uniform in [1, max_addend];
      ``*`` operands uniform in [2, max_factor].
    - solution_style: how the reference solution writes the steps (:data:`SolutionStyle`);
      it changes no problem, only the demonstrations, except ``tally``, whose prompts name
      each term by a letter (only ``+``/``-``: mul_prob must be 0).
    - max_total: with it, each ``+``/``-`` is drawn among those that keep every running total
      in [0, max_total] (the first number too), so a long sum's steps stay small.
    The defaults keep the longest prompt under 64 bytes (= tokens of the tiny tokenizer).
    """

    min_steps: int = 2
    max_steps: int = 16
    step_exponent: float = 1.5
    mul_prob: float = 0.25
    max_addend: int = 20
    max_factor: int = 9
    solution_style: SolutionStyle = "lines"
    max_total: int | None = None

    def __post_init__(self) -> None:
        if self.solution_style not in SOLUTION_STYLES:
            raise ValueError(
                f"ArithmeticSpec: solution_style must be one of {', '.join(SOLUTION_STYLES)}, got {self.solution_style!r}"
            )
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"ArithmeticSpec: need 1 <= min_steps <= max_steps, got min_steps={self.min_steps}, "
                f"max_steps={self.max_steps}"
            )
        if self.step_exponent < 0:
            raise ValueError(f"ArithmeticSpec: step_exponent must be >= 0, got {self.step_exponent}")
        if not 0.0 <= self.mul_prob <= 1.0:
            raise ValueError(f"ArithmeticSpec: mul_prob must be in [0, 1], got {self.mul_prob}")
        if self.max_addend < 1:
            raise ValueError(f"ArithmeticSpec: max_addend must be >= 1, got {self.max_addend}")
        if self.max_factor < 2:
            raise ValueError(f"ArithmeticSpec: max_factor must be >= 2, got {self.max_factor}")
        if self.max_total is not None and (self.max_total < self.max_addend or self.mul_prob > 0):
            raise ValueError(
                f"ArithmeticSpec: max_total needs max_total >= max_addend and mul_prob 0, got max_total={self.max_total}, "
                f"max_addend={self.max_addend}, mul_prob={self.mul_prob}"
            )
        if self.solution_style == "tally" and (self.mul_prob > 0 or self.max_steps >= len(TALLY_LABELS)):
            raise ValueError(
                f"ArithmeticSpec: solution_style tally needs mul_prob 0 and max_steps <= {len(TALLY_LABELS) - 1} "
                f"(a letter a term), got mul_prob={self.mul_prob}, max_steps={self.max_steps}"
            )


ProgramStyle = Literal["lines", "commented", "nested"]
"""How a reference program is written (:meth:`CodeProblem.program`)."""


PROGRAM_STYLES: tuple[str, ...] = get_args(ProgramStyle)


StepName = Literal[
    "sort", "reverse", "evens", "odds", "add", "sub", "mul", "above", "below",
    "double", "square", "increment", "decrement", "halve", "negate", "last_digit",
]


STEP_NAMES: tuple[str, ...] = get_args(StepName)


DEFAULT_OPERATIONS: tuple[str, ...] = ("sort", "reverse", "evens", "odds", "add", "sub", "mul", "above", "below")
"""The operations problems draw from unless :attr:`CodeSpec.operations` says otherwise."""


@dataclass(frozen=True)
class CodeSpec:
    """How problems are drawn.

    - steps: k in [min_steps, max_steps] with P(k) proportional to k ** -step_exponent
      (the module docstring gives the lengths this implies);
    - each step: one of ``operations`` (names of STEPS) uniformly; a constant, where the step takes one, uniform in
      [1, max_constant]; the final print: one of FINALS uniformly;
    - tests: n_tests lines of n integers, n uniform in [min_list_len, max_list_len],
      each integer uniform in [0, max_value]. A problem is kept only when every test
      leaves a non-empty list for the final print (so max/min are defined and printing
      nothing never passes) and the tests do not all expect the same output (a program
      printing a constant never passes); otherwise its steps, final and tests are redrawn
      with the same k, so k keeps exactly the power law.
    The defaults keep every prompt within 80 bytes (= tokens of the tiny tokenizer).
    """

    min_steps: int = 1
    max_steps: int = 4
    step_exponent: float = 1.5
    n_tests: int = 4
    min_list_len: int = 3
    max_list_len: int = 8
    max_value: int = 20
    max_constant: int = 9
    operations: tuple[str, ...] = DEFAULT_OPERATIONS

    def __post_init__(self) -> None:
        unknown = [name for name in self.operations if name not in STEP_NAMES]
        if unknown or not self.operations:
            raise ValueError(
                f"CodeSpec.operations: must name at least one operation out of {', '.join(STEP_NAMES)}; "
                f"unknown: {', '.join(unknown) or 'none given'}"
            )
        if len(set(self.operations)) != len(self.operations):
            raise ValueError(f"CodeSpec.operations: lists an operation twice: {', '.join(self.operations)}")
        if self.min_steps < 1:
            raise ValueError(f"CodeSpec.min_steps: must be >= 1, got {self.min_steps}")
        if self.max_steps < self.min_steps:
            raise ValueError(
                f"CodeSpec.max_steps: must be >= min_steps ({self.min_steps}), got {self.max_steps}"
            )
        if not self.step_exponent >= 0:
            raise ValueError(f"CodeSpec.step_exponent: must be >= 0, got {self.step_exponent}")
        if self.n_tests < 2:
            raise ValueError(f"CodeSpec.n_tests: must be >= 2 (tests must tell programs apart), got {self.n_tests}")
        if self.min_list_len < 1:
            raise ValueError(f"CodeSpec.min_list_len: must be >= 1, got {self.min_list_len}")
        if self.max_list_len < self.min_list_len:
            raise ValueError(
                f"CodeSpec.max_list_len: must be >= min_list_len ({self.min_list_len}), got {self.max_list_len}"
            )
        if self.max_value < 1:
            raise ValueError(f"CodeSpec.max_value: must be >= 1, got {self.max_value}")
        if not 1 <= self.max_constant <= 9:
            raise ValueError(f"CodeSpec.max_constant: must be in [1, 9] (one digit), got {self.max_constant}")
