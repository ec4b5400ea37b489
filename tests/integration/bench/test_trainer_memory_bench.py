"""`asyncrl bench trainer-memory` end to end on the tiny model: each heap in its own real
process (DeepSpeed engine, forward, backward, optimizer step), its phases read from /proc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli.main import build_parser

PHASES = ("proximal forward", "forward", "backward", "optimizer")


@pytest.mark.slow
def test_bench_measures_every_phase_of_each_heap(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.json"
    args = build_parser().parse_args(["bench", "trainer-memory", "--model", str(tiny_model_dir), "--heaps", "glibc,1",
                                      "--steps", "2", "--tokens", "264", "--json", str(out)])  # fmt: skip
    assert args.handler(args) == 0
    result = json.loads(out.read_text())
    assert list(result["heaps"]) == ["glibc", "1"]
    for heap, measured in result["heaps"].items():
        assert measured["heap"] == heap
        assert measured["peaks_per_phase"] is True  # /proc/self/clear_refs reset VmHWM between phases
        assert measured["micro_batch_tokens"] == 264
        names = [phase["name"] for phase in measured["phases"]]
        assert names == ["build"] + [f"step {step} {phase}" for step in range(2) for phase in PHASES]
        for phase in measured["phases"]:
            assert phase["peak_bytes"] >= phase["rss_bytes"] > 100_000_000  # torch alone is resident
            assert phase["seconds"] > 0
        figures = measured["figures"]
        assert figures["peak_bytes"] == max(phase["peak_bytes"] for phase in measured["phases"])
        assert figures["model_state_bytes"] == 16 * measured["parameters"]
        assert len(figures["step_s_each"]) == 1
    table = capsys.readouterr().out
    assert "| glibc's own |" in table and "| mmap threshold 1 MiB |" in table
