"""`asyncrl bench storage` on small numbers: storage operations per step must not grow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import s3_servers

from asyncrl.bench.storage import StorageBenchSettings, cmd_bench_storage, run_backend
from asyncrl.cli.main import build_parser
from asyncrl.storage.fs import open_root

SETTINGS = StorageBenchSettings(steps=60, sample_at=(10, 60), window=5)


def _check(result: Any) -> None:
    early, late = result.points
    assert (early.step, late.step) == (10, 60)
    assert early.ops_per_step > 0
    assert result.ops_ratio <= 1.2, result.to_json()
    # The trainer's poll lists only the waiting shards, and no component but the weight
    # publish (storage/weights.py lists the versions) lists more names late than early.
    for component in ("scheduler", "trainer", "lineage"):
        assert late.listed_by_component[component] == early.listed_by_component[component], result.to_json()
        assert late.ops_by_component[component] == early.ops_by_component[component], result.to_json()


def test_ops_per_step_do_not_grow_on_local_disk(tmp_path: Path) -> None:
    _check(run_backend("local", open_root(str(tmp_path / "root")), SETTINGS, tmp_path / "work"))


def test_ops_per_step_do_not_grow_on_moto(moto_endpoint: Any, tmp_path: Path) -> None:
    bucket = s3_servers.create_bucket(moto_endpoint)
    root = open_root(f"s3://{bucket}/run", s3_servers.storage_options(moto_endpoint))
    _check(run_backend("moto", root, SETTINGS, tmp_path / "work"))


def test_cli_prints_table_and_json_and_fails_over_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["bench", "storage", "--steps", "12", "--sample-at", "5,12", "--work-dir", str(tmp_path / "a"),
         "--json", str(tmp_path / "report.json")]
    )  # fmt: skip
    assert cmd_bench_storage(args) == 0
    out = capsys.readouterr().out
    assert "ops/step" in out and "ratio" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["results"][0]["points"][1]["step"] == 12
    # A bound below 1 cannot be met: exit 1, saying why.
    args = build_parser().parse_args(
        ["bench", "storage", "--steps", "12", "--sample-at", "5,12", "--work-dir", str(tmp_path / "b"),
         "--max-ops-ratio", "0.5"]
    )  # fmt: skip
    assert cmd_bench_storage(args) == 1
    assert "over --max-ops-ratio 0.5" in capsys.readouterr().err


def test_bad_sample_points_are_refused() -> None:
    with pytest.raises(ValueError, match="sample_at"):
        StorageBenchSettings(steps=50, sample_at=(10, 60))
