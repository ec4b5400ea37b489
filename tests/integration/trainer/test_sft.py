"""SFT on the synthetic arithmetic task; the targets of code rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.records import CODE_TASK, PromptRecord
from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, mixed_solutions, write_synthetic_dataset
from asyncrl.configs.synthetic_specs import ArithmeticSpec
from asyncrl.tasks.reward.code_reward import extract_program
from asyncrl.tasks.reward.types import CodeTests, StdioCase
from asyncrl.tasks.trainer.sft import SFTSettings, batch_indices, run_sft, sft_loss, sft_sequences, sft_target


def test_sft_lowers_the_loss_on_the_synthetic_task(engine: Any, tmp_path: Path) -> None:
    records = load_prompts(write_synthetic_dataset(tmp_path / "train.parquet", n=16, seed=3))
    sequences = sft_sequences(records, engine.tokenizer)
    first = sequences[0]
    assert engine.tokenizer.decode(first.prompt_ids) == f"{records[0].prompt}\n"
    assert engine.tokenizer.decode(first.output_ids[:-1]) == records[0].solution
    assert first.output_ids[-1] == engine.tokenizer.eos_token_id
    settings = SFTSettings(steps=12, batch_size=8, micro_batch_tokens=256)
    before = sft_loss(engine, sequences, settings)
    losses = run_sft(engine, sequences, settings)
    after = sft_loss(engine, sequences, settings)
    assert len(losses) == 12
    assert after < 0.8 * before, (before, after, losses)


def test_batches_visit_every_example_once_per_epoch() -> None:
    batches = batch_indices(10, 4, seed=3)
    first = [next(batches) for _ in range(5)]  # 20 indices: exactly two epochs
    assert [len(b) for b in first] == [4, 4, 4, 4, 4]
    flat = [i for b in first for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert next(batch_indices(3, 8, seed=0)) != [] and len(next(batch_indices(3, 8, seed=0))) == 3


def test_a_mixed_warm_start_set_is_mixed_in_every_batch() -> None:
    # Regression: the answer-only choice and the batch order once drew the same random
    # numbers (both Fisher-Yates from Random(seed)), so every early batch was answer-only.
    problems = make_arithmetic_dataset(2000, seed=0, spec=ArithmeticSpec(min_steps=1, max_steps=3, mul_prob=0.0, max_addend=9))
    answer_only = [s.startswith("####") for s in mixed_solutions(problems, 0.5, seed=0)]
    batches = batch_indices(len(problems), 64, seed=0)
    shares = [sum(answer_only[i] for i in next(batches)) / 64 for _ in range(20)]
    assert all(0.25 <= share <= 0.75 for share in shares), shares


def code_row(solution: str | None, prompt: str = "Read ints; add 3; print the sum.") -> PromptRecord:
    return PromptRecord(
        prompt_id="000000-code", prompt=prompt, answer="", solution=solution, task=CODE_TASK,
        tests=CodeTests(stdio=(StdioCase("1 2\n", "9\n"),)),
    )


PROGRAM = "a=list(map(int,input().split()))\na=[x+3 for x in a]\nprint(sum(a))"


def test_a_code_rows_target_is_its_program_in_the_form_the_code_reward_extracts() -> None:
    record = code_row(PROGRAM + "\n")
    fenced = sft_target(record)
    assert fenced == f"```python\n{PROGRAM}\n```"
    assert sft_target(record, "first_fence") == fenced
    assert sft_target(record, "whole") == PROGRAM
    for mode in ("last_fence", "first_fence", "whole"):
        assert extract_program(sft_target(record, mode), mode).rstrip("\n") == PROGRAM
    with pytest.raises(ValueError, match="reward.code.extract: unknown mode 'middle'"):
        sft_target(record, "middle")
    with pytest.raises(ValueError, match="000000-code: a code row without a reference program"):
        sft_target(code_row(None))
    with pytest.raises(ValueError, match="without a reference program"):
        sft_target(code_row("  \n"))


def test_math_targets_are_unchanged_by_the_code_mode() -> None:
    worked = PromptRecord(prompt_id="0", prompt="What is 1+2?", answer="3", solution="1+2=3")
    assert sft_target(worked) == sft_target(worked, "whole") == "1+2=3\n#### 3"
    ended = PromptRecord(prompt_id="1", prompt="What is 1+2?", answer="3", solution="1+2=3\n#### 3")
    assert sft_target(ended) == "1+2=3\n#### 3"
    assert sft_target(PromptRecord(prompt_id="2", prompt="What is 1+2?", answer="3")) == "#### 3"


def test_code_sequences_hold_the_fenced_program_then_eos() -> None:
    from asyncrl.tasks.model.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(320, 2048)
    record = code_row(PROGRAM)
    fenced, whole = (sft_sequences([record], tokenizer, code_extract=mode)[0] for mode in ("last_fence", "whole"))
    assert tokenizer.decode(fenced.prompt_ids) == f"{record.prompt}\n"
    assert tokenizer.decode(fenced.output_ids[:-1]) == f"```python\n{PROGRAM}\n```"
    assert tokenizer.decode(whole.output_ids[:-1]) == PROGRAM
    assert fenced.output_ids[-1] == whole.output_ids[-1] == tokenizer.eos_token_id
