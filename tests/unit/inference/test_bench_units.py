"""The rollout benchmark's workload and report (the measurement itself runs in `asyncrl bench rollout`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

import asyncrl.bench.rollout as bench_module
from asyncrl.cli.main import build_parser
from asyncrl.bench.rollout import RolloutBenchSettings, format_tables, long_tailed_lengths, run_rollout_bench, stall_row
from asyncrl.tasks.inference.samples import UpdateStats


def test_lengths_are_bounded_long_tailed_and_seeded() -> None:
    settings = RolloutBenchSettings(requests=2000, min_tokens=16, max_tokens=512, seed=3)
    lengths = long_tailed_lengths(2000, settings)
    assert min(lengths) >= 16 and max(lengths) <= 512
    median = statistics.median(lengths)
    top_decile = sorted(lengths)[int(0.9 * len(lengths)) :]
    assert statistics.fmean(top_decile) > 4 * median  # a few long generations dominate
    assert long_tailed_lengths(2000, settings) == lengths


def test_report_lists_every_row() -> None:
    result = {
        "settings": {"requests": 8, "worker_in_engine_process": False},
        "server_start_s": 38.04,
        "engine_core_forked": False,
        "length_mean": 40.0,
        "length_p90": 90,
        "throughput": [{"concurrency": c, "output_tokens": 100 * c, "seconds": 1.0, "tokens_per_s": 100.0 * c}
                       for c in (1, 4)],
        "update_stall": [{"mode": m, "updates": 2, "stall_s_mean": 0.5, "stall_s_p50": 0.45, "stall_s_max": 0.7,
                          "pause_s_mean": 0.1, "load_s_mean": 0.3, "resume_s_mean": 0.1, "stall_over_load": 5 / 3,
                          "interrupted_mean": 8.0, "prefetch_s_mean": 0.02} for m in ("recompute", "keep")],
    }
    table = format_tables(result)
    assert table.startswith("server start: 38.0 s (model worker in its own process, engine core spawned)\n")
    assert "| 4 | 400 | 1.00 | 400 |" in table
    assert "| keep | 2 | 0.020 | 0.500 | 0.450 | 0.700 | 0.100 | 0.300 | 0.100 | 1.67 | 8.0 |" in table


def _update(stall: float, pause: float, load: float, resume: float) -> UpdateStats:
    phases = {"pause": pause, "load": load, "set_version": resume / 2, "resume": resume / 2}
    return UpdateStats(1, "keep", stall, {}, {"http://a": load}, 3, phase_s=phases)


def test_stall_row_splits_the_stall_into_its_phases() -> None:
    updates = [_update(0.2, 0.05, 0.1, 0.05), _update(0.4, 0.1, 0.2, 0.1), _update(0.3, 0.1, 0.1, 0.1)]
    row = stall_row("keep", updates, [0.01, 0.03, 0.02])
    assert row.prefetch_s_mean == pytest.approx(0.02) and stall_row("keep", updates).prefetch_s_mean == 0.0
    assert row.stall_s_mean == pytest.approx(0.3) and row.stall_s_p50 == pytest.approx(0.3)
    assert row.stall_s_max == pytest.approx(0.4)
    assert row.pause_s_mean == pytest.approx(0.25 / 3) and row.resume_s_mean == pytest.approx(0.25 / 3)
    assert row.load_s_mean == pytest.approx(0.4 / 3)
    assert row.stall_over_load == pytest.approx(0.3 / (0.4 / 3))
    assert row.interrupted_mean == 3


def test_the_bench_keeps_its_files_only_in_a_work_dir_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model, versions and log (~250 MB by default) go to a temporary directory that is
    removed afterwards, even when the measurement fails; ``--work-dir`` keeps them."""
    used: list[Path] = []

    def measure(model_dir: Path | None, settings: RolloutBenchSettings, work: Path) -> dict[str, Any]:
        used.append(work)
        (work / "server.log").write_text("log")
        if settings.seed == 1:
            raise RuntimeError("server failed")
        return {"work": str(work)}

    monkeypatch.setattr(bench_module, "_measure_rollout", measure)
    assert run_rollout_bench(None, RolloutBenchSettings()) == {"work": str(used[0])}
    with pytest.raises(RuntimeError, match="server failed"):
        run_rollout_bench(None, RolloutBenchSettings(seed=1))
    assert not used[0].exists() and not used[1].exists()
    kept = tmp_path / "kept"
    run_rollout_bench(None, RolloutBenchSettings(), kept)
    assert used[2] == kept and (kept / "server.log").read_text() == "log"
    args = build_parser().parse_args(["bench", "rollout", "--work-dir", str(kept)])
    assert args.work_dir == str(kept) and build_parser().parse_args(["bench", "rollout"]).work_dir is None
