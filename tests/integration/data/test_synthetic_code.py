"""The synthetic code task: programs that pass their own tests, a long tail of lengths,
distinct splits in the code-row layout, validated settings, and the demo's limits."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from asyncrl.configs.pipeline import SyntheticDataConfig
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.data.records import CODE_TASK, PromptRecord
from asyncrl.tasks.data.synthetic_code import FINALS, READ_LINE, STEPS, CodeProblem, Step, make_code_dataset, max_program_bytes, mixed_code_solutions, max_prompt_bytes, sample_problem, split_code_problems, step_weights, write_code_splits
from asyncrl.configs.synthetic_specs import CodeSpec
from asyncrl.tasks.reward.code_reward import code_tests_from_json, score_code
from asyncrl.configs.reward import CodeRewardConfig
from asyncrl.tasks.pipeline.stages import prepare_inputs
from asyncrl.tasks.trainer.sft import sft_target

REPO = Path(__file__).resolve().parents[3]
DEMO_CONFIG = REPO / "configs" / "demo-code.yaml"


CONSTANT_FREE = ("sort", "reverse", "evens", "odds", "double", "square", "increment", "decrement", "halve",
                 "negate", "last_digit")
"""Every operation that takes no constant (a task whose statements hold no digit)."""


@pytest.fixture(scope="module")
def problems() -> list[CodeProblem]:
    return make_code_dataset(1500, seed=5)


def run_in_process(program: str, stdin: str) -> str:
    """The program's stdout for ``stdin`` (an independent run of the reference text)."""
    lines = iter(stdin.splitlines())
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(program, "<program>", "exec"), {"input": lambda: next(lines)})  # noqa: S102 - our own programs
    return out.getvalue()


def code_record(problem: CodeProblem, row: int = 0) -> PromptRecord:
    return PromptRecord(
        prompt_id=f"{row:06d}-test", prompt=problem.prompt, answer="", solution=problem.solution,
        task=CODE_TASK, tests=problem.code_tests(),
    )


def test_the_same_seed_gives_the_same_problems_and_tests() -> None:
    first, again = make_code_dataset(300, seed=3), make_code_dataset(300, seed=3)
    assert first == again
    assert [p.tests_json() for p in first] == [p.tests_json() for p in again]
    other = make_code_dataset(300, seed=4)
    assert [p.prompt for p in other] != [p.prompt for p in first]


def test_written_splits_are_deterministic(tmp_path: Path) -> None:
    def write(out: Path) -> dict[str, Any]:
        paths = write_code_splits(
            train_path=out / "train.parquet", heldout_path=out / "heldout.parquet", sft_path=out / "sft.parquet",
            n_train=60, n_heldout=20, n_sft=30, seed=9,
        )
        return {name: pq.read_table(path).to_pylist() for name, path in paths.items()}

    assert write(tmp_path / "a") == write(tmp_path / "b")


def test_every_reference_program_passes_its_own_tests_in_both_styles(problems: list[CodeProblem]) -> None:
    for problem in problems:
        assert len(problem.tests) == CodeSpec().n_tests
        for case in problem.tests:
            assert run_in_process(problem.solution, case.input) == case.output, (problem.prompt, case)
            for program in (problem.commented_solution, problem.nested_solution):
                assert run_in_process(program, case.input) == case.output, (program, case)


def test_reference_programs_pass_as_real_processes(problems: list[CodeProblem]) -> None:
    # One problem per final and per step kind, run by a fresh interpreter as the sandbox does.
    chosen: dict[str, CodeProblem] = {}
    for problem in [*problems, *make_code_dataset(200, seed=5, spec=CodeSpec(operations=CONSTANT_FREE))]:
        for key in (f"final:{problem.final}", *(f"step:{s.name}" for s in problem.steps)):
            chosen.setdefault(key, problem)
    assert len(chosen) == len(FINALS) + len(STEPS)
    for problem in {p.prompt: p for p in chosen.values()}.values():
        for program in (problem.solution, problem.commented_solution, problem.nested_solution):
            for case in problem.tests:
                run = subprocess.run(
                    [sys.executable, "-I", "-c", program], input=case.input, capture_output=True, text=True, timeout=30
                )
                assert run.returncode == 0, run.stderr
                assert run.stdout == case.output, (program, case)


def test_tests_tell_programs_apart(problems: list[CodeProblem]) -> None:
    for problem in problems:
        assert len({case.output for case in problem.tests}) > 1, problem.prompt
        for case in problem.tests:
            values = [int(v) for v in case.input.split()]
            assert problem.reduced(values), (problem.prompt, case)  # max/min are defined, output is not empty


def test_the_prompt_states_each_step_and_the_program_has_one_line_per_step(problems: list[CodeProblem]) -> None:
    for problem in problems[:200]:
        lines = problem.solution.split("\n")
        assert lines[0] == READ_LINE
        assert len(lines) == problem.num_steps + 2
        assert lines[-1] == FINALS[problem.final].line
        for step, line in zip(problem.steps, lines[1:-1], strict=True):
            assert step.phrase in problem.prompt
            assert line == step.line


def test_the_nested_program_is_one_expression_written_inside_out() -> None:
    problem = CodeProblem(steps=(Step("evens"), Step("add", 3), Step("sort")), final="max")
    assert problem.nested_solution == "print(max(sorted([x+3 for x in [x for x in list(map(int,input().split())) if x%2==0]])))"
    assert problem.solution == "\n".join(
        [READ_LINE, "a=[x for x in a if x%2==0]", "a=[x+3 for x in a]", "a.sort()", "print(max(a))"]
    )
    reverse = CodeProblem(steps=(Step("reverse"),), final="list")
    assert reverse.nested_solution == "print(*list(map(int,input().split()))[::-1])"


def test_the_commented_program_states_each_step_above_its_line() -> None:
    problem = CodeProblem(steps=(Step("evens"), Step("add", 3)), final="max")
    assert problem.commented_solution == "\n".join(
        [READ_LINE, "# keep evens", "a=[x for x in a if x%2==0]", "# add 3", "a=[x+3 for x in a]", "# print the max", "print(max(a))"]
    )
    assert [problem.program(style) for style in ("lines", "commented", "nested")] == [
        problem.solution, problem.commented_solution, problem.nested_solution,
    ]
    with pytest.raises(ValueError, match="unknown style 'golfed'"):
        problem.program("golfed")  # type: ignore[arg-type]


def test_a_mixed_warm_start_takes_each_style_by_its_weight(problems: list[CodeProblem]) -> None:
    sample = problems[:401]
    mixed = mixed_code_solutions(sample, {"commented": 1.0, "nested": 1.0, "lines": 2.0}, seed=3)
    styles = Counter(
        next(style for style in ("lines", "commented", "nested") if program == p.program(style))  # type: ignore[arg-type]
        for p, program in zip(sample, mixed, strict=True)
    )
    # 401 x (1/4, 1/4, 1/2) = 100.25, 100.25, 200.5: the one left over goes to the largest remainder.
    assert styles == {"lines": 201, "commented": 100, "nested": 100}
    assert mixed == mixed_code_solutions(sample, {"commented": 1.0, "nested": 1.0, "lines": 2.0}, seed=3)
    assert mixed != mixed_code_solutions(sample, {"commented": 1.0, "nested": 1.0, "lines": 2.0}, seed=4)
    assert mixed_code_solutions(sample, {"lines": 1.0}, seed=3) == [p.solution for p in sample]
    with pytest.raises(ValueError, match="unknown style"):
        mixed_code_solutions(sample, {"golfed": 1.0}, seed=3)
    with pytest.raises(ValueError, match="positive sum"):
        mixed_code_solutions(sample, {"nested": 0.0}, seed=3)


def test_step_counts_follow_the_power_law_with_its_tail() -> None:
    import random

    spec = CodeSpec(min_steps=1, max_steps=6, step_exponent=1.5)
    rng = random.Random(0)
    draws = 6000
    counts = Counter(sample_problem(rng, spec).num_steps for _ in range(draws))
    ks, weights = step_weights(spec)
    total = sum(weights)
    for k, weight in zip(ks, weights, strict=True):
        expected = draws * weight / total
        assert abs(counts[k] - expected) < 0.1 * expected + 15, (k, counts[k], expected)
    assert counts[6] > 0
    assert [counts[k] for k in ks] == sorted((counts[k] for k in ks), reverse=True)


def test_program_lengths_have_a_long_tail(problems: list[CodeProblem]) -> None:
    lengths = sorted(len(p.solution) for p in problems)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    assert longest >= 1.4 * median, (median, longest)
    assert longest <= max_program_bytes(CodeSpec())
    assert max(len(p.prompt.encode()) for p in problems) <= max_prompt_bytes(CodeSpec())


def test_the_bounds_hold_for_every_constant_and_step() -> None:
    spec = CodeSpec(max_steps=3)
    worst = CodeProblem(steps=(Step("sub", 9),) * 3, final="count")
    assert len(worst.prompt) == max_prompt_bytes(spec)
    assert len(CodeProblem(steps=(Step("evens"),) * 3, final="count").solution) == max_program_bytes(spec)
    # The nested style is shorter than line by line (no `a=` per step); the commented one is
    # longer by a comment line per step and one for the print.
    longest_phrases = CodeProblem(steps=(Step("sub", 9),) * 3, final="count")
    comments = len(longest_phrases.commented_solution) - len(longest_phrases.solution)
    assert max_program_bytes(spec, "commented") == max_program_bytes(spec) + comments
    for problem in make_code_dataset(300, seed=2, spec=spec):
        assert len(problem.nested_solution) < len(problem.solution) <= max_program_bytes(spec)
        assert len(problem.commented_solution) <= max_program_bytes(spec, "commented")


def test_constant_free_operations_give_statements_without_a_digit_and_correct_programs() -> None:
    spec = CodeSpec(max_steps=3, n_tests=3, operations=CONSTANT_FREE)
    problems = make_code_dataset(400, seed=3, spec=spec)
    assert not any(ch.isdigit() for p in problems for ch in p.prompt)
    assert {step.name for p in problems for step in p.steps} == set(CONSTANT_FREE)
    for problem in problems[:150]:
        for program in (problem.solution, problem.commented_solution, problem.nested_solution):
            for case in problem.tests:
                assert run_in_process(program, case.input) == case.output, (problem.prompt, program)
        assert len(problem.prompt) <= max_prompt_bytes(spec)
        assert len(problem.commented_solution) <= max_program_bytes(spec, "commented")


def test_the_default_operations_are_the_original_nine() -> None:
    # Changing them would change every problem a seed draws (and the demo's held-out set).
    assert CodeSpec().operations == ("sort", "reverse", "evens", "odds", "add", "sub", "mul", "above", "below")
    # The first prompts of seed 0 as the code before `operations` drew them (911f3d5).
    assert [p.prompt for p in make_code_dataset(5, seed=0)] == [
        "Read ints; times 1, add 9, keep >7; print the min.",
        "Read ints; keep odds, keep <8; print the count.",
        "Read ints; add 8, reverse, reverse, keep evens; print the max.",
        "Read ints; keep odds; print the max.",
        "Read ints; reverse, times 2, subtract 2; print the sum.",
    ]


def test_splits_are_distinct_and_sized() -> None:
    problems = make_code_dataset(200, seed=1)
    train, heldout, sft = split_code_problems(problems, n_train=120, n_heldout=30, seed=1)
    assert (len(train), len(heldout), len(sft)) == (120, 30, 50)
    prompts = [{p.prompt for p in split} for split in (train, heldout, sft)]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    with pytest.raises(ValueError, match="n_train"):
        split_code_problems(problems, n_train=190, n_heldout=30, seed=1)


def pipeline_config(tmp_path: Path, **synthetic: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "work_dir": str(tmp_path / "work"),
            "model": {"path": str(tmp_path / "model")},
            "data": {
                "train_path": str(tmp_path / "train.parquet"),
                "eval_path": str(tmp_path / "heldout.parquet"),
                "sft_path": str(tmp_path / "sft.parquet"),
                "max_prompt_tokens": 96,
            },
            "rollout": {"max_new_tokens": 192},
            "pipeline": {"synthetic_data": {"task": "code", "n_train": 150, "n_heldout": 30, "n_sft": 60, **synthetic}},
            "storage": {"root": str(tmp_path / "store")},
        }
    )


def test_prepare_data_writes_disjoint_code_splits_in_the_code_row_layout(tmp_path: Path) -> None:
    prepare_inputs(pipeline_config(tmp_path))
    tables = {name: pq.read_table(tmp_path / f"{name}.parquet") for name in ("train", "heldout", "sft")}
    assert {name: t.num_rows for name, t in tables.items()} == {"train": 150, "heldout": 30, "sft": 60}
    prompts = {name: set(t.column("prompt").to_pylist()) for name, t in tables.items()}
    assert not (prompts["train"] & prompts["heldout"] or prompts["train"] & prompts["sft"] or prompts["heldout"] & prompts["sft"])
    for name, table in tables.items():
        assert {"prompt", "tests", "solution", "task"} <= set(table.column_names), name
        for row in table.to_pylist():
            assert row["task"] == "code"
            tests = code_tests_from_json(json.loads(row["tests"]), f"{name}: {row['prompt']}")
            assert len(tests.stdio) == 4
            case = tests.stdio[0]
            assert run_in_process(row["solution"], case.input) == case.output


def test_prepare_data_writes_a_mixed_style_warm_start_and_leaves_the_other_splits_line_by_line(tmp_path: Path) -> None:
    prepare_inputs(pipeline_config(tmp_path, sft_styles={"nested": 1.0, "commented": 1.0}))
    solutions = {name: [row["solution"] for row in pq.read_table(tmp_path / f"{name}.parquet").to_pylist()]
                 for name in ("train", "heldout", "sft")}
    one_line = {name: sum("\n" not in s for s in programs) for name, programs in solutions.items()}
    commented = {name: sum("\n# " in s for s in programs) for name, programs in solutions.items()}
    assert one_line == {"train": 0, "heldout": 0, "sft": 30}
    assert commented == {"train": 0, "heldout": 0, "sft": 30}
    for row in pq.read_table(tmp_path / "sft.parquet").to_pylist():
        case = code_tests_from_json(json.loads(row["tests"]), row["prompt"]).stdio[0]
        assert run_in_process(row["solution"], case.input) == case.output


def test_warm_start_styles_without_a_warm_start_set_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pipeline.synthetic_data.sft_styles: needs n_sft > 0"):
        pipeline_config(tmp_path, n_sft=0, sft_styles={"nested": 0.5})


def test_prepared_code_rows_load_as_code_records(tmp_path: Path) -> None:
    from asyncrl.tasks.data.loader import load_prompts

    prepare_inputs(pipeline_config(tmp_path))
    records = load_prompts(tmp_path / "heldout.parquet")
    rows = pq.read_table(tmp_path / "heldout.parquet").to_pylist()
    assert [r.prompt for r in records] == [row["prompt"] for row in rows]
    for record, row in zip(records, rows, strict=True):
        assert record.task == CODE_TASK
        assert record.solution == row["solution"]
        assert record.tests == code_tests_from_json(json.loads(row["tests"]), "row")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"task": "code", "mul_prob": 0.5}, "pipeline.synthetic_data.mul_prob: applies to task arithmetic only"),
        ({"task": "code", "sft_answer_only_share": 0.5}, "pipeline.synthetic_data.sft_answer_only_share: applies to task arithmetic only"),
        ({"sft_styles": {"nested": 1.0}}, "pipeline.synthetic_data.sft_styles: applies to task code only"),
        ({"task": "code", "sft_styles": {"nested": -1.0}}, "sft_styles.nested"),
        ({"task": "code", "sft_styles": {"golfed": 1.0}}, "sft_styles.golfed"),
        ({"task": "code", "sft_styles": {"nested": 0.0}}, "sft_styles: the weights must have a positive sum"),
        ({"n_tests": 3}, "pipeline.synthetic_data.n_tests: applies to task code only"),
        ({"task": "code", "min_list_len": 6, "max_list_len": 4}, "pipeline.synthetic_data.max_list_len: must be >= min_list_len"),
        ({"task": "code", "min_steps": 5}, r"pipeline.synthetic_data.min_steps \(5\) must be <= max_steps \(4\)"),
        ({"task": "code", "max_constant": 12}, "max_constant"),
        ({"task": "code", "n_tests": 1}, "n_tests"),
        ({"task": "python"}, "task"),
        ({"operations": ["sort"]}, "pipeline.synthetic_data.operations: applies to task code only"),
        ({"task": "code", "operations": ["sort", "cube"]}, "operations.1"),
        ({"task": "code", "operations": []}, "pipeline.synthetic_data.operations: must name at least one"),
        ({"task": "code", "operations": ["sort", "sort"]}, "pipeline.synthetic_data.operations: lists an operation twice"),
    ],
)
def test_config_errors_name_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticDataConfig.model_validate({"n_train": 10, "n_heldout": 2, **settings})


def test_the_code_task_has_its_own_step_defaults_and_round_trips() -> None:
    code = SyntheticDataConfig.model_validate({"task": "code"})
    assert (code.min_steps, code.max_steps) == (CodeSpec.min_steps, CodeSpec.max_steps)
    assert code.code_spec() == CodeSpec()
    assert SyntheticDataConfig.model_validate(code.model_dump(mode="json")) == code
    arithmetic = SyntheticDataConfig()
    assert (arithmetic.task, arithmetic.min_steps, arithmetic.max_steps) == ("arithmetic", 2, 16)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_steps", 0, "CodeSpec.min_steps: must be >= 1"),
        ("max_steps", 0, "CodeSpec.max_steps: must be >= min_steps"),
        ("step_exponent", -1.0, "CodeSpec.step_exponent"),
        ("n_tests", 1, "CodeSpec.n_tests"),
        ("min_list_len", 0, "CodeSpec.min_list_len"),
        ("max_value", 0, "CodeSpec.max_value"),
        ("max_constant", 10, "CodeSpec.max_constant"),
        ("operations", ("sort", "cube"), "CodeSpec.operations: .*unknown: cube"),
    ],
)
def test_spec_errors_name_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CodeSpec(**{field: value})


def test_steps_and_problems_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="Step.name: unknown step 'cube'"):
        Step("cube")
    with pytest.raises(ValueError, match="Step.constant: step 'add' needs"):
        Step("add")
    with pytest.raises(ValueError, match="Step.constant: step 'sort' takes no"):
        Step("sort", 3)
    with pytest.raises(ValueError, match="CodeProblem.final"):
        CodeProblem(steps=(Step("sort"),), final="median")
    with pytest.raises(ValueError, match="CodeProblem.steps"):
        CodeProblem(steps=(), final="sum")


def test_the_sft_target_of_a_code_row_scores_full_marks_in_the_sandbox(problems: list[CodeProblem]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    for problem in problems[:3]:
        record = code_record(problem)
        fenced = sft_target(record)
        assert fenced == f"```python\n{problem.solution}\n```"
        result = score_code(fenced, problem.code_tests(), CodeRewardConfig())
        assert (result.reward, result.reason) == (1.0, "ok"), result.detail
        whole = sft_target(record, code_extract="whole")
        assert whole == problem.solution
        assert score_code(whole, problem.code_tests(), CodeRewardConfig(extract="whole")).reward == 1.0
    wrong = problems[0].solution.replace(FINALS[problems[0].final].line, "print(0)")
    assert score_code(wrong, problems[0].code_tests(), CodeRewardConfig(extract="whole")).reward < 1.0


def test_the_demo_config_fits_its_prompts_and_programs_in_its_budgets() -> None:
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    config = RunConfig.model_validate(raw)
    synthetic = config.pipeline.synthetic_data
    assert synthetic is not None and synthetic.task == "code"
    assert config.reward.code.extract in ("last_fence", "first_fence")
    spec = synthetic.code_spec()
    # Byte-level tokenizer: one token per byte; the plain prompt format adds a newline.
    assert max_prompt_bytes(spec) + 1 <= config.data.max_prompt_tokens
    fence = len("```python\n") + len("\n```")
    for style in synthetic.sft_styles or {"lines": 1.0}:
        assert max_program_bytes(spec, style) + fence + 1 <= config.rollout.max_new_tokens  # + EOS
    assert config.tracking.experiment != "asyncrl-demo"
    assert config.pipeline.registered_model != "asyncrl-demo-policy"
    assert all(str(path).startswith("runs/demo-code/") for path in (config.model.path, config.data.train_path, config.storage.root))
