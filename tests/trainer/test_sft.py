"""SFT on the synthetic arithmetic task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.synthetic import write_synthetic_dataset
from asyncrl.tasks.trainer.sft import SFTSettings, run_sft, sft_loss, sft_sequences


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
