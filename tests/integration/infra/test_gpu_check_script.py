"""``infra/gpu-check.sh`` without a GPU: its syntax, its ``--dry-run`` (the commands it would
run, and its config validated with the overrides it uses), its refusal on a machine without
nvidia-smi, and its figures table read from an output folder shaped as the benches, the run
and the trainer write it (built here from their own record types, so a renamed field shows)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from asyncrl.bench.weight_sync import phase_figures
from asyncrl.bench.rollout import StallRow, ThroughputRow
from asyncrl.flows.prefect_api.artifacts import PipelineSummary

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "infra" / "gpu-check.sh"
VENV = Path(sys.executable).parent.parent


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "ASYNCRL_VENV": str(VENV), **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=environ, check=False)


def test_syntax() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, check=False).returncode == 0
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.skipif(not (VENV / "bin" / "asyncrl").exists(), reason="needs the venv's asyncrl command")
def test_dry_run_prints_the_commands_and_validates_the_config(tmp_path: Path) -> None:
    done = run_script("--dry-run", "--out", str(tmp_path / "check"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    check = tmp_path / "check"
    assert f"configs/gpu-check.yaml validates with: work_dir={check}/work" in out
    lines = {line.split(" (limit")[0].removeprefix("[dry-run] "): line for line in out.splitlines() if "(limit" in line}
    assert list(lines) == ["nvidia-smi", "versions", "ds-report", "bench-weight-sync", "bench-e2e", "bench-scale", "run", "replay"]
    assert "CUDA_VISIBLE_DEVICES=0" in lines["bench-weight-sync"] and "bench weight-sync --size 0.5b" in lines["bench-weight-sync"]
    assert "bench e2e --gpus 0 --etas 0,4" in lines["bench-e2e"] and "CUDA_VISIBLE_DEVICES" not in lines["bench-e2e"]
    assert "bench scale --gpus 0 --sizes 125m,0.5b,1.5b" in lines["bench-scale"]
    assert f"--work-dir {check}/scale " in lines["bench-scale"]
    # the run trains the 0.5B checkpoint the scale bench wrote
    assert f"run configs/gpu-check.yaml work_dir={check}/work storage.root={check}/store" in lines["run"]
    assert f"model.path={check}/scale/0.5b/model" in lines["run"]
    limits = [int(line.split("(limit ")[1].split("s)")[0]) for name, line in lines.items() if name.startswith(("bench", "run"))]
    assert sum(limits) <= 15.5 * 60  # what the script's help promises
    assert f"replay {check}/store --work-dir {check}/replay" in lines["replay"]  # the run's training again
    assert int(lines["replay"].split("(limit ")[1].split("s)")[0]) <= 2 * 60
    assert not check.exists()  # a dry run writes nothing
    skipped = run_script("--dry-run", "--skip-benches", "--out", str(check))
    assert "bench-e2e" not in skipped.stdout and "[dry-run] run (limit" in skipped.stdout
    assert "[dry-run] bench-scale (limit" in skipped.stdout  # it writes the run's model
    # the benches' server is the first GPU the caller's CUDA_VISIBLE_DEVICES shows
    assert "CUDA_VISIBLE_DEVICES=5 " in run_script("--dry-run", env={"CUDA_VISIBLE_DEVICES": "5,6"}).stdout


def test_the_run_config_is_the_0_5b_shape_the_scale_bench_writes() -> None:
    from asyncrl.bench.scale_settings import SIZE_SPECS
    from asyncrl.configs.loading import load_config

    config = load_config(REPO / "configs" / "gpu-check.yaml")
    assert config.model.path.endswith("/0.5b/model") and not config.pipeline.init_tiny_model
    assert SIZE_SPECS["0.5b"].num_parameters() == 494_032_768
    assert config.trainer.max_steps == 20 and config.pipeline.synthetic_data is not None


def test_usage_errors_and_help() -> None:
    bad = run_script("--bogus")
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
    assert "What it expects of the machine" in run_script("--help").stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
@pytest.mark.skipif(not (VENV / "bin" / "asyncrl").exists(), reason="needs the venv's asyncrl command")
def test_refuses_a_machine_without_nvidia_smi(tmp_path: Path) -> None:
    done = run_script("--out", str(tmp_path / "check"))
    assert done.returncode == 1 and "nvidia-smi not found" in done.stderr
    assert not (tmp_path / "check").exists()


def test_figures_of_an_output_folder(tmp_path: Path) -> None:
    (tmp_path / "step-windows.txt").write_text("window versions 100 110 10\nwindow run 200 400 200\n")
    (tmp_path / "gpu-samples.txt").write_text("105 1024,10\n250 20480,50\n300 10240,30\n310 [N/A],[N/A]\n")
    (tmp_path / "gpu-apps.txt").write_text("250 4242 900MiB /v/bin/python -m asyncrl.tasks.trainer.main --config c\n")
    rollout = {
        "throughput": [asdict(ThroughputRow(concurrency=16, requests=64, output_tokens=8000, seconds=2.0, tokens_per_s=4000.0))],
        "update_stall": [asdict(StallRow("recompute", 2, 0.5, 0.5, 0.6, 0.1, 0.3, 0.1, 1.67, 8.0))],
    }
    (tmp_path / "bench-rollout.json").write_text(json.dumps(rollout))
    load = {"backend": "local", "phase": "load", **phase_figures([1.0, 3.0], 2 * 10**9, ("disk", 2.0))}
    (tmp_path / "bench-weight-sync.json").write_text(json.dumps({"server_start_s": 41.5, "phases": [load], "hashes_verified": True}))
    e2e_runs = [
        {"eta": 0, "mode": "keep", "steps": 16, "wall_s": 20.0, "limit_s": 18.0, "efficiency": 0.9,
         "first_batch_wait_s": 1.25, "weight_sync_stall_fraction": 0.012, "weight_updates": 15},
        {"eta": 4, "mode": "keep", "error": "ComponentFailed: trainer failed: boom\nthe log tail"},
    ]  # fmt: skip
    (tmp_path / "bench-e2e.json").write_text(json.dumps({"settings": {"steps": 16}, "runs": e2e_runs}))
    (tmp_path / "store").mkdir()
    summary = PipelineSummary(
        run="gpu-check", steps=8, final_version=9, pass_at_1_before=0.25, pass_at_1_after=0.5, best_version=9,
        registered_model=None, registered_model_version=None, wall_s=300.0, train_wall_s=90.0, mlflow_uri="sqlite://",
        mlflow_run_id="r", storage_root="s", restarts={}, stages={},
    )  # fmt: skip
    (tmp_path / "store" / "summary.json").write_text(json.dumps(asdict(summary)))
    work = tmp_path / "work" / "gpu-check"
    work.mkdir(parents=True)
    steps = [{"step": i, "time": 1.0 * i, "step_time_s": 9.0 if i == 1 else 2.0, "tokens_per_s": 100.0 * i} for i in (1, 2, 3)]
    (work / "trainer-metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))

    figures = {"step_s": 1.5, "tokens_per_s": 900.0, "publish_s": 0.25, "fetch_s": 0.125, "load_s": 0.5, "stall_s": None,
               "trainer_rss_over_states": 1.25}  # fmt: skip
    scale = {
        "sizes": [{"size": "0.5b", "parameters": 494_032_768, "figures": figures},
                  {"size": "1.5b", "parameters": 1_543_714_304, "error": "ComponentFailed: trainer failed\ntail"}],
        "exponents": {"step_s": {"pairs": [], "overall": 0.95}},
    }  # fmt: skip
    (tmp_path / "bench-scale.json").write_text(json.dumps(scale))
    replay = {"versions_identical": 20, "versions_compared": 21, "wall_s": 64.2,
              "first_difference": {"step": 7, "first_tensor": "model.safetensors:lm_head.weight", "max_abs_diff": 3e-8}}  # fmt: skip
    (tmp_path / "replay.json").write_text(json.dumps(replay))
    done = run_script("--figures", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = dict(line.strip("|").split(" | ", 1) for line in done.stdout.splitlines()[2:])
    rows = {name.strip(): value.strip(" |") for name, value in rows.items()}
    assert rows["step versions"] == "10 s; GPU: peak 1.0 GiB, mean utilisation 10%"
    assert rows["step run"] == "200 s; GPU: peak 20.0 GiB, mean utilisation 40%"
    assert rows["vLLM generation (tiny model), concurrency 16"] == "4000 tokens/s (8000 tokens in 2.00 s)"
    assert rows["vLLM weight update while generating, recompute (tiny model)"] == "stall 0.500 s, load 0.300 s (mean of 2)"
    assert rows["weight sync 0.5B (2.00 GB): load"] == "2.000 s (1.00 GB/s)"
    assert rows["bench e2e (tiny model, 16 steps): eta 0 sync"] == (
        "wall 20.0 s, limit 18.0 s, efficiency 0.90, first batch 1.2 s, stall fraction 0.012 (15 updates)"
    )
    assert rows["bench e2e (tiny model, 16 steps): eta 4 keep"] == "failed: ComponentFailed: trainer failed: boom"
    assert rows["asyncrl run: held-out pass@1"] == "25.0% -> 50.0%"
    assert rows["asyncrl run: wall time"] == "300 s (RL 90 s for 8 steps)"
    assert rows["RL step (DeepSpeed), step_time_s: mean of steps 2-3"] == "2.000 s"
    assert rows["RL step (DeepSpeed), tokens_per_s: mean of steps 2-3"] == "250.000 tokens/s"
    assert rows["trainer process seen holding GPU memory"] == "yes"
    assert rows["bench scale 0.5b (494M parameters)"] == (
        "step 1.50 s, publish 0.25 s, fetch 0.12 s, load 0.50 s, stall n/a, trainer peak RSS / model states 1.25"
    )
    assert rows["bench scale 1.5b (1,544M parameters)"] == "failed: ComponentFailed: trainer failed"
    assert rows["bench scale exponent k of step_s ~ params^k"] == "0.95"
    assert rows["asyncrl replay: weight versions identical"] == (
        "20 of 21 in 64 s; first difference after step 7: model.safetensors:lm_head.weight (max abs diff 3e-08)"
    )
    empty = run_script("--figures", str(tmp_path / "nothing"))
    assert empty.returncode == 0 and empty.stdout.splitlines() == ["| figure | value |", "| --- | --- |"]


FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
case "$*" in
  *query-gpu*) echo "2048, 7" ;;
  *query-compute-apps*) ;;
  -L) echo "GPU 0: Fake GPU (UUID: GPU-fake)" ;;
  *) echo "fake nvidia-smi" ;;
esac
"""


def test_every_step_runs_and_a_failure_fails_the_check(tmp_path: Path) -> None:
    """The script's own machinery on a faked GPU machine: a fake nvidia-smi, and a venv whose
    asyncrl command only prints its arguments (its `run` fails) and whose python answers the
    version check; every step still runs, the failed one is named, and the exit status is 1."""
    fake_bin, venv = tmp_path / "bin", tmp_path / "venv" / "bin"
    for folder in (fake_bin, venv):
        folder.mkdir(parents=True)
    scripts = {
        fake_bin / "nvidia-smi": FAKE_NVIDIA_SMI,
        venv / "asyncrl": '#!/usr/bin/env bash\necho "asyncrl $*"\n[ "$1" != run ] || exit 3\n',
        venv / "ds_report": "#!/usr/bin/env bash\necho 'fused_adam ... [OKAY]'\n",
        # the version check reads its program from stdin; the figures are real Python
        venv / "python": f'#!/usr/bin/env bash\nif [ "$*" = - ]; then cat >/dev/null; echo versions; exit 0; fi\nexec {sys.executable} "$@"\n',
    }
    for path, body in scripts.items():
        path.write_text(body)
        path.chmod(0o755)
    out = tmp_path / "check"
    done = run_script("--out", str(out), env={"ASYNCRL_VENV": str(venv.parent), "PATH": f"{fake_bin}:{os.environ['PATH']}",
                                              "CUDA_VISIBLE_DEVICES": "3"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gpu-check: run FAILED (status 3" in done.stderr and "FAILED steps: run " in done.stderr
    for name in ("nvidia-smi", "versions", "ds-report", "bench-weight-sync", "bench-e2e", "bench-scale"):
        assert f"gpu-check: {name} passed" in done.stdout
    assert "asyncrl bench scale --gpus 0 --sizes 125m,0.5b,1.5b" in (out / "bench-scale.log").read_text()
    assert "GPU 0: Fake GPU" in (out / "nvidia-smi.log").read_text()
    figures = (out / "figures.md").read_text()
    assert "| step run | " in figures and "GPU: peak 2.0 GiB, mean utilisation 7%" in figures
