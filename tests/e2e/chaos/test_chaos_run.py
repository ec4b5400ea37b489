"""`asyncrl chaos` in its short CI setting: a real vLLM server, the DeepSpeed trainer, the
scheduler process and the reward service, each SIGKILLed once, at a seeded training step
spread over the run plus a short random delay, and restarted by the run's own supervisors;
every planned kill must fire, the run must finish and the audit of its run root must be
clean: no group lost or trained twice, and no sample dropped as too stale (zero waste: the
audit fails on any drop)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ports import restartable_base_port
from process_scan import processes_with_env, wait_gone

from asyncrl.chaos.run import CHAOS_REPORT
from asyncrl.cli.main import main
from asyncrl.storage import fs
from asyncrl.storage.fs import open_root
from asyncrl.tasks.data.synthetic import write_synthetic_splits

pytestmark = pytest.mark.slow

RUN = "chaos-ci"
STEPS, B = 32, 2  # enough steps for all four kills: the trainer takes about 1 s a step here
MARKER = "ASYNCRL_RUN_TEST_MARKER"  # tests/conftest.py: process_marker


def chaos_config(tmp_path: Path, model_dir: Path) -> dict[str, Any]:
    splits = write_synthetic_splits(tmp_path / "data", n_train=64, n_heldout=4, seed=0)
    return {
        "name": RUN,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(splits["train"]), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "shard_groups": 1, "shard_seconds": 1.0},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": B, "max_steps": STEPS, "micro_batch_tokens": 256, "checkpoint_every": 1,
                    "optimizer": {"lr": 1.0e-4}},
        "reward": {"pool": {"workers": 1}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }  # fmt: skip


def launches(log: Path) -> list[str]:
    """The parts of a component's log, one per start (each begins with its "$ command" line)."""
    parts: list[str] = []
    for line in log.read_text().splitlines():
        if line.startswith("$ "):
            parts.append("")
        if parts:
            parts[-1] += line + "\n"
    return parts


def test_every_component_killed_and_restarted_the_run_finishes_and_audits_clean(
    tiny_model_dir: Path, tmp_path: Path, process_marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = chaos_config(tmp_path, tiny_model_dir)
    config_path = tmp_path / "chaos.yaml"
    config_path.write_text(yaml.safe_dump(config))

    code = main(["chaos", str(config_path), "--kills", "1", "--seed", "1", "--max-delay", "3", "--timeout", "420"])

    printed = capsys.readouterr()
    report = json.loads(fs.read_bytes(open_root(config["storage"]["root"]), CHAOS_REPORT))
    assert code == 0 and report["ok"] is True, printed.out + printed.err
    assert "result: OK" in printed.out and "| 4 |" in printed.out
    assert report["steps"] == STEPS and report["final_version"] >= STEPS
    assert sorted(report["planned"]) == ["reward", "rollout", "scheduler", "trainer"] and report["problems"] == []
    assert report["kills_planned"] == report["kills_fired"] == 4 and report["unfired"] == []
    assert report["planned_steps"] == sorted(report["planned_steps"]) and report["planned_steps"][-1] < STEPS
    assert report["restarts"] == {"trainer": 1, "rollout": 1, "scheduler": 1, "reward": 1}
    assert report["supervisor_restarts"] == {"rollout-server-0": 1, "reward-service": 1, "trainer": 1, "scheduler": 1}
    for kill in report["kills"]:  # each came back, and the run published a newer version after it
        assert kill["restarted_at_s"] >= kill["at_s"] and kill["up_at_s"] is not None
        assert kill["step"] >= kill["planned_step"]  # armed once the published weights reached its step
        assert kill["recovered_at_s"] is not None
    audit = report["audit"]
    assert audit["ok"] is True and audit["violations"] == []
    assert audit["admitted"] >= STEPS * B and audit["groups_written"] == audit["admitted"]
    assert audit["unwritten_groups"] == [] and audit["ledger_steps"] == STEPS
    assert audit["versions"] == sorted(audit["versions"]) and audit["versions"][-1] == report["final_version"]
    assert audit["trained_samples"] == STEPS * B * 2  # every consumed sample trained
    assert audit["dropped_stale"] == 0 and audit["trainer_dropped_stale"] == 0 and audit["dropped_steps"] == {}, audit
    # the second, independent count: every trained group's admission record, none over the bound
    assert audit["admission_dropped_stale"] == 0 and audit["unrecorded_admissions"] == 0, audit
    # waste in tokens: what the two scheduler processes received, less what shards and left-out
    # records keep, within what the scheduler and server kills may lose (the journal's bound)
    counts = list((tmp_path / "work" / RUN / "token-counts").glob("delivered-*.count"))
    assert len(counts) == 2  # the scheduler and its restart, each its own count
    assert report["tokens_received"] >= audit["shard_tokens"] + audit["left_out_tokens"] > 0
    assert report["tokens_regenerated"] == report["tokens_received"] - audit["shard_tokens"] - audit["left_out_tokens"]
    assert 0 <= report["tokens_regenerated"] <= report["tokens_regenerated_bound"], report
    assert set(report["tokens_regenerated_bound_per_kind"]) == {"trainer", "rollout", "scheduler", "reward"}
    assert f"{report['tokens_regenerated']} of them lost to kills" in printed.out

    logs = tmp_path / "work" / RUN / "logs"
    trainer_starts = [json.loads(line) for line in (logs / "trainer.log").read_text().splitlines()
                      if line.startswith('{"event": "start"')]  # fmt: skip
    assert len(trainer_starts) == 2 and trainer_starts[1]["resumed_from"] is not None  # resumed from its checkpoint
    assert len(launches(logs / "scheduler.log")) == 2
    assert len(launches(logs / "reward-service.log")) == 2
    # The restarted rollout server served generation: it came back into rotation.
    first_server, restarted_server = launches(logs / "rollout-0.log")
    assert '"POST /inference/v1/generate HTTP/1.1" 200' in restarted_server
    left = wait_gone(processes_with_env(MARKER, process_marker), timeout_s=30.0)
    assert not left, f"processes left behind: {[p.cmdline[:120] for p in left]}"
