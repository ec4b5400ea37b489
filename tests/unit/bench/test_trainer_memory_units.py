"""Units of `asyncrl bench trainer-memory`: the options' checks, the figures from hand-made
phases, the table, and that each measured process starts without glibc's malloc variables
(the measurement itself: tests/integration/bench/test_trainer_memory_bench.py)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest
from asyncrl.cli.bench import add_trainer_memory_bench
from asyncrl.bench.trainer_memory import (
    HEAP_ENV,
    MemorySettings,
    format_table,
    heap_figures,
    parse_heaps,
    rank_state_bytes,
    run_heap,
    worker_command,
)


def test_parse_heaps_keeps_order_and_names_what_is_wrong() -> None:
    assert parse_heaps("glibc, 1,8") == ("glibc", "1", "8")
    for text, wrong in (("", "at least one"), ("glibc,0", "'0'"), ("jemalloc", "'jemalloc'"), ("1,1", "repeats")):
        with pytest.raises(ValueError, match="--heaps") as error:
            parse_heaps(text)
        assert wrong in str(error.value)


@pytest.mark.parametrize(
    ("fields", "option"),
    [({"tokens": 100}, "--tokens"), ({"steps": 1}, "--steps"), ({"zero_stage": 4}, "--zero-stage"), ({"world_size": 0}, "--world-size")],
)
def test_settings_name_the_option(fields: dict[str, int], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        MemorySettings(model_dir=Path("m"), **fields)


def _phase(name: str, seconds: float, rss: int, peak: int) -> dict[str, object]:
    return {"name": name, "seconds": seconds, "rss_bytes": rss, "peak_bytes": peak}


@pytest.mark.parametrize(("stage", "per_param"), [(0, 16), (1, 4 + 4 + 4), (2, 4 + 2 + 4), (3, 8)])
def test_rank_state_bytes_follows_zeros_partitions(stage: int, per_param: int) -> None:
    assert rank_state_bytes(10, stage, 2) == 10 * per_param
    assert rank_state_bytes(10, stage, 1) == 160  # one rank holds every state


def _measured(rank: int = 0, world_size: int = 1, zero_stage: int = 0) -> dict[str, object]:
    phases = [_phase("build", 5.0, 100, 120)]
    for step, (seconds, peak) in enumerate(((4.0, 900), (2.0, 700), (3.0, 650))):
        phases += [_phase(f"step {step} proximal forward", seconds / 4, 300, 400),
                   _phase(f"step {step} forward", seconds / 4, 320, 420),
                   _phase(f"step {step} backward", seconds / 4, 350, peak),
                   _phase(f"step {step} optimizer", seconds / 4, 330 - step, 360)]  # fmt: skip
    phases.append(_phase("publish", 1.5, 340, 348))
    return {"rank": rank, "world_size": world_size, "zero_stage": zero_stage, "parameters": 10, "largest_parameter": 4,
            "micro_batch_tokens": 264, "peaks_per_phase": True, "phases": phases}  # fmt: skip


def test_heap_figures_peak_between_steps_and_later_steps() -> None:
    figures = heap_figures(_measured())
    assert figures["model_state_bytes"] == 160.0  # 10 parameters x 16 bytes in float32
    assert figures["peak_bytes"] == 900.0
    assert figures["peak_over_states"] == pytest.approx(900 / 160)
    assert figures["between_steps_bytes"] == 328.0  # after the last optimizer step
    assert figures["first_step_s"] == pytest.approx(4.0)
    assert figures["step_s_each"] == pytest.approx([2.0, 3.0])
    assert figures["step_s"] == pytest.approx(2.5)
    assert figures["publish_s"] == 1.5
    assert figures["publish_extra_bytes"] == 348 - 328  # its peak over what was resident before it
    assert figures["weight_bytes"] == 40.0
    assert figures["publish_extra_over_weights"] == pytest.approx(20 / 40)
    assert figures["publish_extra_over_largest"] == pytest.approx(20 / 16)


def test_heap_figures_of_a_zero3_rank_use_its_share_of_the_states() -> None:
    figures = heap_figures(_measured(rank=1, world_size=2, zero_stage=3))
    assert figures["model_state_bytes"] == 80.0
    assert figures["peak_over_states"] == pytest.approx(900 / 80)
    assert figures["weight_bytes"] == 40.0  # the whole model's, what a gather would materialise


def test_format_table_has_a_row_per_heap_and_per_phase() -> None:
    measured = _measured()
    result = {"heaps": {heap: {"heap": heap, "ranks": [{**measured, "figures": heap_figures(measured)}]} for heap in ("glibc", "1")}}
    table = format_table(result)
    assert "| glibc's own | 0.00 | 5.62 |" in table
    assert "| mmap threshold 1 MiB |" in table
    assert "| 1.5 | 0.00 / 0.50 / 1.25 |" in table  # the publish: seconds, extra GB / weights / largest
    assert table.count("| step 2 backward |") == 1
    assert table.count("| publish |") == 1
    assert "one micro-batch of 264 positions per rank" in table


def test_format_table_names_each_rank_when_there_are_several() -> None:
    ranks = [_measured(rank, 2, 3) for rank in (0, 1)]
    table = format_table({"heaps": {"1": {"heap": "1", "ranks": [{**r, "figures": heap_figures(r)} for r in ranks]}}})
    assert "| mmap threshold 1 MiB, rank 0 |" in table and "| mmap threshold 1 MiB, rank 1 |" in table
    assert "ZeRO stage 3, 2 rank(s)" in table


def test_worker_command_starts_torchrun_for_several_ranks(tmp_path: Path) -> None:
    one = worker_command(MemorySettings(model_dir=tmp_path), "1", tmp_path / "out", python="py")
    assert one[:3] == ["py", "-m", "asyncrl.bench.trainer_memory_worker"]
    two = worker_command(MemorySettings(model_dir=tmp_path, zero_stage=3, world_size=2), "1", tmp_path / "out", python="py")
    assert two[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert two[two.index("--out-dir") + 1] == str(tmp_path / "out")
    assert '"world_size": 2' in two[two.index("--settings") + 1]


def test_each_heap_runs_without_glibcs_malloc_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's MALLOC_* would make "glibc's own" something else: the measured process
    starts without them (a stand-in interpreter records the environment it was given)."""
    for name in HEAP_ENV:
        monkeypatch.setenv(name, "65536")
    monkeypatch.setenv("ASYNCRL_KEPT", "yes")
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nwhile [ "$1" != --out-dir ]; do shift; done\nenv > "$2/env"\necho "{}" > "$2/rank0.json"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "glibc"
    assert run_heap(MemorySettings(model_dir=tmp_path), "glibc", out, python=str(python)) == [{}]
    seen = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    assert seen["ASYNCRL_KEPT"] == "yes"
    assert not set(HEAP_ENV) & set(seen)
    assert all(os.environ[name] == "65536" for name in HEAP_ENV)  # this process keeps them


def test_a_failing_heap_raises_with_its_output(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'no model here' >&2\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match=r"heap '1' failed \(exit 3\)") as error:
        run_heap(MemorySettings(model_dir=tmp_path), "1", tmp_path / "1", python=str(python))
    assert "no model here" in str(error.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--model DIR or --size NAME"),
        (["--size", "5m", "--model", "m"], "--model DIR or --size NAME"),
        (["--size", "7b"], "--size: unknown size '7b'"),
        (["--model", "{missing}"], "holds no config.json"),
        (["--size", "5m", "--heaps", "glibc,x"], "--heaps: 'x'"),
        (["--size", "5m", "--steps", "1"], "--steps must be >= 2"),
        (["--size", "5m", "--world-size", "0"], "--world-size must be >= 1"),
        (["--size", "5m", "--zero3-live-elements", "1000"], "--zero3-live-elements must be >= 1000000"),
    ],
)
def test_cli_refuses_bad_options_with_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_trainer_memory_bench(parser.add_subparsers())
    argv = [arg.replace("{missing}", str(tmp_path / "missing")) for arg in argv]
    args = parser.parse_args(["trainer-memory", *argv, "--work-dir", str(tmp_path)])
    assert args.handler(args) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before writing a model
