"""The rollout benchmark's workload and report (the measurement itself runs in `asyncrl bench rollout`)."""

from __future__ import annotations

import statistics

from asyncrl.tasks.rollout.bench import BenchSettings, format_tables, long_tailed_lengths


def test_lengths_are_bounded_long_tailed_and_seeded() -> None:
    settings = BenchSettings(requests=2000, min_tokens=16, max_tokens=512, seed=3)
    lengths = long_tailed_lengths(2000, settings)
    assert min(lengths) >= 16 and max(lengths) <= 512
    median = statistics.median(lengths)
    top_decile = sorted(lengths)[int(0.9 * len(lengths)) :]
    assert statistics.fmean(top_decile) > 4 * median  # a few long generations dominate
    assert long_tailed_lengths(2000, settings) == lengths


def test_report_lists_every_row() -> None:
    result = {
        "settings": {"requests": 8},
        "length_mean": 40.0,
        "length_p90": 90,
        "throughput": [{"concurrency": c, "output_tokens": 100 * c, "seconds": 1.0, "tokens_per_s": 100.0 * c}
                       for c in (1, 4)],
        "update_stall": [{"mode": m, "updates": 2, "stall_s_mean": 0.5, "stall_s_max": 0.7, "load_s_mean": 0.3,
                          "interrupted_mean": 8.0} for m in ("recompute", "keep")],
    }
    table = format_tables(result)
    assert "| 4 | 400 | 1.00 | 400 |" in table
    assert "| keep | 2 | 0.50 | 0.70 | 0.30 | 8.0 |" in table
