"""SFT on the synthetic arithmetic task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.synthetic import ArithmeticSpec, make_arithmetic_dataset, mixed_solutions, write_synthetic_dataset
from asyncrl.tasks.trainer.sft import SFTSettings, batch_indices, run_sft, sft_loss, sft_sequences


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
