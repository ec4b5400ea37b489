"""`asyncrl bench trainer`: dynamic micro-batching against fixed-count padded micro-batches."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from asyncrl.cli.bench import add_trainer_bench
from asyncrl.bench.trainer import (
    TrainerBenchSettings,
    format_table,
    run_proximal_bench,
    run_trainer_bench,
)


def test_bench_rows_compare_packed_and_padded(engine: Any) -> None:
    settings = TrainerBenchSettings(sequences=16, min_len=16, max_len=128, budget=256, fixed_count=4, repeats=1)
    packed, fixed = run_trainer_bench(engine, settings)
    assert (packed.variant, fixed.variant) == ("packed", "fixed")
    assert packed.real_tokens == fixed.real_tokens
    assert packed.computed_positions == packed.real_tokens  # no padding at all
    assert fixed.computed_positions > fixed.real_tokens
    assert packed.packing_efficiency > fixed.packing_efficiency
    assert packed.micro_batches < fixed.micro_batches
    assert packed.tokens_per_s > 0 and fixed.tokens_per_s > 0
    assert "packed" in format_table([packed, fixed])


def test_proximal_rows_time_both_ways_on_one_batch(engine: Any) -> None:
    settings = TrainerBenchSettings(sequences=16, min_len=16, max_len=128, budget=256, repeats=1)
    separate, reused = run_proximal_bench(engine, settings)
    assert (separate.variant, reused.variant) == ("separate", "reused")
    assert separate.real_tokens == reused.real_tokens and separate.micro_batches == reused.micro_batches > 1
    assert separate.seconds_per_update > 0 and reused.seconds_per_update > 0


def test_cli_entry_prints_table_and_writes_json(tiny_model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    parser = argparse.ArgumentParser(prog="asyncrl bench")
    add_trainer_bench(parser.add_subparsers(dest="bench", required=True))
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["trainer", "--model", str(tiny_model_dir), "--sequences", "8", "--max-len", "64", "--budget", "128",
         "--repeats", "1", "--json", str(out)]
    )
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "dynamic micro-batching:" in printed
    result = json.loads(out.read_text())
    assert [row["variant"] for row in result["rows"]] == ["packed", "fixed"]
    assert [row["variant"] for row in result["proximal_rows"]] == ["separate", "reused"]
    assert "steps/s of a separate proximal pass" in printed
    assert result["speedup"] > 0 and result["model"] == str(tiny_model_dir)


def test_a_generated_model_is_removed_after_the_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --model the bench writes the tiny model to a temporary directory that is gone afterwards."""
    import asyncrl.tasks.model.tiny as tiny

    written: list[Path] = []
    write = tiny.write_tiny_model
    monkeypatch.setattr(tiny, "write_tiny_model", lambda path, **kw: written.append(path) or write(path, **kw))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        parser = argparse.ArgumentParser(prog="asyncrl bench")
        add_trainer_bench(parser.add_subparsers(dest="bench", required=True))
        out = tmp_path / "out" / "bench.json"
        out.parent.mkdir()
        args = parser.parse_args(["trainer", "--sequences", "4", "--max-len", "32", "--budget", "64", "--repeats", "1",
                                  "--json", str(out)])  # fmt: skip
        assert args.handler(args) == 0
    finally:
        tempfile.tempdir = None
    assert json.loads(out.read_text())["model"] == "tiny (generated)"
    (model,) = written
    assert model.parent.name.startswith("asyncrl-bench-trainer-") and model.parent.parent == tmp_path
    assert not model.parent.exists()
