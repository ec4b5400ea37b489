"""`asyncrl bench trainer-memory` end to end on the tiny model: each heap in its own real
process (DeepSpeed engine, forward, backward, optimizer step, publish), its phases read from
/proc; and two ZeRO stage 3 ranks under torchrun, each measured."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from asyncrl.bench.trainer_memory import rank_state_bytes
from asyncrl.cli.main import build_parser

PHASES = ("proximal forward", "forward", "backward", "optimizer")


def _bench(argv: list[str], out: Path) -> dict[str, Any]:
    args = build_parser().parse_args(["bench", "trainer-memory", *argv, "--steps", "2", "--tokens", "264", "--json", str(out)])
    assert args.handler(args) == 0
    return json.loads(out.read_text())


def _check_rank(measured: dict[str, Any], heap: str) -> None:
    assert measured["heap"] == heap
    assert measured["peaks_per_phase"] is True  # /proc/self/clear_refs reset VmHWM between phases
    assert measured["micro_batch_tokens"] == 264
    names = [phase["name"] for phase in measured["phases"]]
    assert names == ["build"] + [f"step {step} {phase}" for step in range(2) for phase in PHASES] + ["publish"]
    for phase in measured["phases"]:
        assert phase["peak_bytes"] >= phase["rss_bytes"] > 100_000_000  # torch alone is resident
        assert phase["seconds"] > 0
    figures = measured["figures"]
    assert figures["peak_bytes"] == max(phase["peak_bytes"] for phase in measured["phases"])
    assert figures["weight_bytes"] == 4 * measured["parameters"]
    assert len(figures["step_s_each"]) == 1


@pytest.mark.slow
def test_bench_measures_every_phase_of_each_heap(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _bench(["--model", str(tiny_model_dir), "--heaps", "glibc,1"], tmp_path / "memory.json")
    assert list(result["heaps"]) == ["glibc", "1"]
    for heap, measured in result["heaps"].items():
        (rank,) = measured["ranks"]
        _check_rank(rank, heap)
        assert rank["figures"]["model_state_bytes"] == 16 * rank["parameters"]
    table = capsys.readouterr().out
    assert "| glibc's own |" in table and "| mmap threshold 1 MiB |" in table


@pytest.mark.slow
def test_bench_runs_zero3_ranks_under_torchrun(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks, parameters partitioned: each counts the whole model (not its empty shards),
    its states are half the model's, and the publish leaves no version behind."""
    result = _bench(["--model", str(tiny_model_dir), "--heaps", "1", "--zero-stage", "3", "--world-size", "2"],
                    tmp_path / "memory.json")  # fmt: skip
    ranks = result["heaps"]["1"]["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as weights:  # tied copies are not saved
        parameters = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
    for rank in ranks:
        _check_rank(rank, "1")
        assert (rank["world_size"], rank["zero_stage"], rank["parameters"]) == (2, 3, parameters)
        assert rank["figures"]["model_state_bytes"] == rank_state_bytes(parameters, 3, 2) == 8 * parameters
    assert "| mmap threshold 1 MiB, rank 1 |" in capsys.readouterr().out
