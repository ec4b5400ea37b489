"""The synthetic arithmetic task: exact answers, valid step-by-step solutions, long tail."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.tasks.data.synthetic import Problem, make_arithmetic_dataset, mixed_solutions, split_train_heldout, write_problems, write_synthetic_dataset, write_synthetic_splits
from asyncrl.configs.synthetic_specs import ArithmeticSpec

EXPRESSION = re.compile(r"^What is ([0-9+\-*]+)\?$")
STEP_LINE = re.compile(r"^(-?\d+)([+\-*])(\d+)=(-?\d+)$")


def evaluate_prompt(prompt: str) -> int:
    """Independent oracle: Python's own evaluation of the expression in the prompt."""
    match = EXPRESSION.match(prompt)
    assert match, prompt
    return int(eval(match.group(1), {"__builtins__": {}}, {}))  # digits and + - * only


def check_solution(problem: Problem) -> None:
    lines = problem.solution.split("\n")
    *steps, final = lines
    assert final == f"#### {problem.answer}"
    assert len(steps) == problem.num_steps
    for line in steps:
        match = STEP_LINE.match(line)
        assert match, line
        left, op, right, result = int(match[1]), match[2], int(match[3]), int(match[4])
        expected = {"+": left + right, "-": left - right, "*": left * right}[op]
        assert result == expected, line
    assert int(STEP_LINE.match(steps[-1])[4]) == int(problem.answer)


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    return make_arithmetic_dataset(3000, seed=7)


def test_answers_are_exact(problems: list[Problem]) -> None:
    for problem in problems:
        assert problem.answer == str(evaluate_prompt(problem.prompt))


def test_reference_solutions_are_valid_step_by_step(problems: list[Problem]) -> None:
    for problem in problems:
        check_solution(problem)


def test_example_solution() -> None:
    problem = Problem(numbers=(3, 4, 2, 5, 3), operators=("+", "*", "-", "*"))
    assert problem.prompt == "What is 3+4*2-5*3?"
    assert problem.solution == "4*2=8\n5*3=15\n3+8=11\n11-15=-4\n#### -4"
    assert problem.answer == "-4"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["+", "-", "*"]), st.integers(0, 99)), min_size=1, max_size=20),
    st.integers(0, 99),
)
def test_any_expression_solves_exactly(ops: list[tuple[str, int]], first: int) -> None:
    problem = Problem(numbers=(first, *(n for _, n in ops)), operators=tuple(op for op, _ in ops))
    assert problem.answer == str(evaluate_prompt(problem.prompt))
    check_solution(problem)


def test_steps_are_long_tailed(problems: list[Problem]) -> None:
    steps = sorted(p.num_steps for p in problems)
    median = statistics.median(steps)
    top_decile = steps[int(0.9 * len(steps)) :]
    assert statistics.mean(top_decile) >= 3 * median
    assert steps[-1] >= 3 * median
    lengths = sorted(len(p.solution) for p in problems)
    assert statistics.mean(lengths[int(0.9 * len(lengths)) :]) >= 3 * statistics.median(lengths)


def test_prompts_fit_a_64_token_budget(problems: list[Problem]) -> None:
    # The tiny tokenizer has one token per byte.
    assert max(len(p.prompt.encode("utf-8")) for p in problems) <= 64


def test_solutions_parse_with_math_verify(problems: list[Problem]) -> None:
    from math_verify import parse, verify

    for problem in problems[:200]:
        assert verify(parse(problem.answer), parse(problem.solution)), problem.solution


def test_deterministic_by_seed() -> None:
    first = make_arithmetic_dataset(200, seed=3)
    assert first == make_arithmetic_dataset(200, seed=3)
    assert first != make_arithmetic_dataset(200, seed=4)
    assert make_arithmetic_dataset(50, seed=3) == first[:50]


def test_prompts_are_distinct(problems: list[Problem]) -> None:
    assert len({p.prompt for p in problems}) == len(problems)


def test_split_has_no_overlap_and_is_deterministic(problems: list[Problem]) -> None:
    train, heldout = split_train_heldout(problems, 300, seed=1)
    assert len(train) == len(problems) - 300 and len(heldout) == 300
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}
    assert {p.prompt for p in train} | {p.prompt for p in heldout} == {p.prompt for p in problems}
    assert split_train_heldout(problems, 300, seed=1) == (train, heldout)
    assert split_train_heldout(problems, 300, seed=2)[1] != heldout


def test_split_rejects_repeated_prompts() -> None:
    problem = Problem(numbers=(1, 2), operators=("+",))
    with pytest.raises(ValueError, match=r"problem 1 repeats the prompt 'What is 1\+2\?'"):
        split_train_heldout([problem, problem], 1, seed=0)


def test_small_problem_space_is_reported() -> None:
    spec = ArithmeticSpec(min_steps=1, max_steps=1, mul_prob=1.0, max_addend=1, max_factor=2)
    with pytest.raises(ValueError, match="found only 1 distinct problems of the 5 asked"):
        make_arithmetic_dataset(5, seed=0, spec=spec)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_steps": 0}, "min_steps=0"),
        ({"min_steps": 5, "max_steps": 4}, "max_steps=4"),
        ({"mul_prob": 1.5}, "mul_prob must be in"),
        ({"max_factor": 1}, "max_factor must be >= 2"),
    ],
)
def test_spec_rejects_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArithmeticSpec(**kwargs)  # type: ignore[arg-type]


def test_problem_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="len\\(numbers\\) == len\\(operators\\) \\+ 1"):
        Problem(numbers=(1, 2, 3), operators=("+",))
    with pytest.raises(ValueError, match="unknown operator '/'"):
        Problem(numbers=(1, 2), operators=("/",))  # type: ignore[arg-type]


def test_write_dataset_columns(tmp_path: Path) -> None:
    path = write_synthetic_dataset(tmp_path / "d" / "train.parquet", 100, seed=5)
    table = pq.read_table(path)
    assert table.column_names == ["prompt", "answer", "solution", "num_steps"]
    expected = make_arithmetic_dataset(100, seed=5)
    assert table.column("prompt").to_pylist() == [p.prompt for p in expected]
    assert table.column("answer").to_pylist() == [str(evaluate_prompt(p.prompt)) for p in expected]
    assert b"asyncrl.synthetic" in table.schema.metadata
    assert [p.name for p in path.parent.iterdir()] == ["train.parquet"]  # no temporary left


def test_write_splits(tmp_path: Path) -> None:
    paths = write_synthetic_splits(tmp_path, n_train=400, n_heldout=50, seed=2)
    assert set(paths) == {"train", "heldout"}
    train = pq.read_table(paths["train"]).column("prompt").to_pylist()
    heldout = pq.read_table(paths["heldout"]).column("prompt").to_pylist()
    assert (len(train), len(heldout)) == (400, 50)
    assert not set(train) & set(heldout)
    again = write_synthetic_splits(tmp_path / "again", n_train=400, n_heldout=50, seed=2)
    assert paths["train"].read_bytes() == again["train"].read_bytes()


def test_mixed_solutions_give_the_asked_share_of_answer_only_lines(problems: list[Problem]) -> None:
    chosen = problems[:200]
    solutions = mixed_solutions(chosen, 0.3, seed=4)
    answer_only = [s == f"#### {p.answer}" for p, s in zip(chosen, solutions, strict=True)]
    assert sum(answer_only) == 60
    for problem, solution, short in zip(chosen, solutions, answer_only, strict=True):
        assert solution.endswith(f"#### {problem.answer}")  # every final answer is right
        assert short or solution == problem.solution
    assert mixed_solutions(chosen, 0.3, seed=4) == solutions
    assert mixed_solutions(chosen, 0.3, seed=5) != solutions
    assert mixed_solutions(chosen, 0.0, seed=4) == [p.solution for p in chosen]
    with pytest.raises(ValueError, match="answer_only_share must be in"):
        mixed_solutions(chosen, 1.2, seed=4)


def test_write_problems_refuses_a_solution_count_mismatch(tmp_path: Path, problems: list[Problem]) -> None:
    with pytest.raises(ValueError, match="2 solutions for 3 problems"):
        write_problems(tmp_path / "x.parquet", problems[:3], solutions=["#### 1", "#### 2"])
    assert not (tmp_path / "x.parquet").exists()


WORKED_STEP = re.compile(r"^Step (\d+): take (-?\d+) and (add|subtract|multiply it by) (\d+)\.$")
WORKED_EQUATION = re.compile(r"^(-?\d+) ([+\-*]) (\d+) = (-?\d+)\.$")


def test_worked_solutions_write_every_step_out_and_stay_exact(problems: list[Problem]) -> None:
    from asyncrl.tasks.data.synthetic import reference_solution

    for problem in problems[:500]:
        lines = reference_solution(problem, "worked").split("\n")
        assert lines[-2:] == [f"The answer is {problem.answer}.", f"#### {problem.answer}"]
        body = lines[:-2]
        compact = problem.solution.split("\n")[:-1]
        for index, line in enumerate(compact):
            left, op, right, result = STEP_LINE.match(line).groups()
            step, equation, *check, result_line = body[:4] if op != "*" else body[:3]
            body = body[4:] if op != "*" else body[3:]
            assert WORKED_STEP.match(step).groups() == (
                str(index + 1), left, {"+": "add", "-": "subtract", "*": "multiply it by"}[op], right,
            )
            assert WORKED_EQUATION.match(equation).groups() == (left, op, right, result)
            if op != "*":  # the check undoes the step: result -/+ right gives back left
                undo, value = {"+": ("-", int(result) - int(right)), "-": ("+", int(result) + int(right))}[op]
                assert check == [f"Check: {result} {undo} {right} = {left}, as it should be."] and value == int(left)
            assert result_line == f"The result is {result}."
        assert body == []


def test_worked_solutions_are_reasoning_length() -> None:
    from asyncrl.tasks.data.synthetic import reference_solution

    spec = ArithmeticSpec(min_steps=2, max_steps=3, mul_prob=0.0, max_addend=9, solution_style="worked")
    lengths = [len(reference_solution(p, "worked").encode()) for p in make_arithmetic_dataset(1000, seed=0, spec=spec)]
    # one token per byte: 200-335 tokens, a mean near 250 (the compact style: 20-40 tokens)
    assert 195 <= min(lengths) and max(lengths) <= 340 and statistics.mean(lengths) >= 240


def test_worked_style_reaches_the_written_files(tmp_path: Path) -> None:
    spec = ArithmeticSpec(solution_style="worked")
    paths = write_synthetic_splits(tmp_path, n_train=20, n_heldout=5, seed=0, spec=spec)
    solutions = pq.read_table(paths["train"]).column("solution").to_pylist()
    assert all(s.startswith("Step 1: take ") for s in solutions)
    mixed = mixed_solutions(make_arithmetic_dataset(10, seed=0), 0.5, seed=0, style="worked")
    assert sum(s.startswith("####") for s in mixed) == 5 and sum(s.startswith("Step 1:") for s in mixed) == 5


TALLY_LINE = re.compile(r"^([a-z])([+-])(\d): (\d+) ([+-]) (\d) = (\d+)$")
TALLY_SPEC = ArithmeticSpec(min_steps=9, max_steps=16, step_exponent=0.0, mul_prob=0.0, max_addend=9, max_total=30,
                            solution_style="tally")  # fmt: skip


def test_tally_prompts_letter_each_term_and_the_solution_keeps_a_line_a_term() -> None:
    from asyncrl.tasks.data.synthetic import reference_solution

    for problem in make_arithmetic_dataset(300, seed=0, spec=TALLY_SPEC):
        terms = problem.prompt.removeprefix("What is ").removesuffix("?").split(" ")
        *lines, final = reference_solution(problem, "tally").split("\n")
        assert final == f"#### {problem.answer}" and len(lines) == len(terms) == problem.num_steps + 1
        total = 0
        for index, (term, line) in enumerate(zip(terms, lines, strict=True)):
            label, sign, number, before, sign_again, number_again, after = TALLY_LINE.match(line).groups()
            assert term == f"{label}{sign}{number}" and label == "abcdefghijklmnopqrstuvwxyz"[index]
            assert (sign_again, number_again) == (sign, number)  # the line's term, then the step with it
            assert int(before) == total and int(after) == total + (int(number) if sign == "+" else -int(number))
            assert 0 <= int(after) <= 30  # max_total keeps every running total in [0, 30]
            total = int(after)
        assert str(total) == problem.answer


def test_tally_solutions_are_reasoning_length() -> None:
    from asyncrl.tasks.data.synthetic import reference_solution

    problems = make_arithmetic_dataset(1000, seed=0, spec=TALLY_SPEC)
    lengths = [len(reference_solution(p, "tally").encode()) for p in problems]
    # one token per byte: about 17 tokens a term, 150-295 for 10-17 terms (configs/reasoning.yaml)
    assert 150 <= min(lengths) and max(lengths) <= 295 and statistics.mean(lengths) >= 200
    assert max(len(p.prompt) for p in problems) <= 96  # the config's max_prompt_tokens


def test_a_tally_needs_sums_of_at_most_26_terms_and_max_total_needs_room() -> None:
    with pytest.raises(ValueError, match="tally needs mul_prob 0 and max_steps <= 25"):
        ArithmeticSpec(mul_prob=0.25, solution_style="tally")
    with pytest.raises(ValueError, match="tally needs mul_prob 0 and max_steps <= 25"):
        ArithmeticSpec(mul_prob=0.0, max_steps=26, solution_style="tally")
    with pytest.raises(ValueError, match="max_total needs max_total >= max_addend and mul_prob 0"):
        ArithmeticSpec(mul_prob=0.0, max_addend=9, max_total=5)


def test_unknown_solution_style_is_refused() -> None:
    from asyncrl.tasks.data.synthetic import reference_solution

    with pytest.raises(ValueError, match="solution_style must be one of lines, worked, tally"):
        ArithmeticSpec(solution_style="essay")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="style must be one of lines, worked, tally, got 'essay'"):
        reference_solution(make_arithmetic_dataset(1, seed=0)[0], "essay")  # type: ignore[arg-type]


def test_an_unbounded_spec_draws_the_problems_it_always_drew() -> None:
    # max_total changes the order of the draws only when set: the demo's data (seed 0) and any
    # earlier dataset stay the same problems (these prompts were drawn by the code before it).
    demo = ArithmeticSpec(min_steps=2, max_steps=3, mul_prob=0.0, max_addend=9)
    assert [p.prompt for p in make_arithmetic_dataset(4, seed=0, spec=demo)] == [
        "What is 7-7-8+9?", "What is 3-9+5?", "What is 2-8-7?", "What is 4-8-1?"]  # fmt: skip
    assert [p.prompt for p in make_arithmetic_dataset(3, seed=7)] == [
        "What is 5+3+12+2?", "What is 14*3+19?", "What is 8+19+8?"]  # fmt: skip
