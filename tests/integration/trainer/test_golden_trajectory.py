"""The golden trajectory: a few recorded shards (checked in under ``golden/``) trained by the real
trainer process from the tiny model, step by step against the recorded loss, gradient norm and
weight digests. A change that alters the trainer's numbers fails here, and must update the
golden values on purpose, saying why in its commit:

    ASYNCRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/integration/trainer/test_golden_trajectory.py

rewrites ``golden/golden.json`` (and, with ``ASYNCRL_UPDATE_GOLDEN=shards``, the shards too).

Bit-exact weights depend on the CPU's kernels as well as on the code: the digests are checked
where the machine's kernel signature (torch version, the CPU's vector extensions, the trainer's
thread count) is the recorded one, and the losses everywhere, within 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from fixtures_trainer import Trajectories

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.tasks.pipeline.stages import run_with_metrics
from asyncrl.tasks.placement.launch_settings import trainer_launch
from asyncrl.tasks.trainer.metrics import read_jsonl_metrics

GOLDEN = Path(__file__).parent / "golden"
RUN_ID = "golden"
STEPS = 3
UPDATE = os.environ.get("ASYNCRL_UPDATE_GOLDEN", "")


def kernel_signature(threads: str) -> dict[str, str]:
    """What besides the code decides a CPU run's bits: torch, the vector extensions its kernels
    pick from (AVX-512 or AVX2), and the trainer's threads."""
    flags = set()
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pass
    vector = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"torch": torch.__version__, "vector": vector, "threads": threads}


def write_shards(store: Path, model_dir: Path) -> None:
    """The recorded input: STEPS shards of one group of four samples (seeded outputs, rewards
    with a spread so every step has a gradient), behaviour versions one step behind."""
    from transformers import AutoTokenizer

    trajectories = Trajectories(AutoTokenizer.from_pretrained(model_dir), seed=7)
    writer = ShardWriter(open_root(str(store)), RUN_ID)
    for k in range(STEPS):
        writer.write_groups([trajectories.group(f"g{k}", [1.0, 0.0, 0.5, 0.0], versions=max(0, k - 1))])


def test_the_recorded_shards_train_to_the_recorded_numbers(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    if UPDATE == "shards":
        shutil.rmtree(GOLDEN / "shards", ignore_errors=True)
        write_shards(tmp_path / "recorded", tiny_model_dir)
        shutil.copytree(tmp_path / "recorded" / paths.TRAJECTORIES_DIR, GOLDEN / "shards", ignore=shutil.ignore_patterns("_seq"))
    (store / paths.TRAJECTORIES_DIR).parent.mkdir(parents=True)
    shutil.copytree(GOLDEN / "shards", store / paths.TRAJECTORIES_DIR)
    config = RunConfig.model_validate({
        "name": RUN_ID, "work_dir": str(tmp_path / "work"), "model": {"path": str(tiny_model_dir)},
        "data": {"train_path": str(tmp_path / "unused.parquet"), "max_prompt_tokens": 32},
        "rollout": {"n_samples": 4, "max_new_tokens": 16, "eta": 2},
        "trainer": {"batch_groups": 1, "max_steps": STEPS, "micro_batch_tokens": 128, "mini_batches": 1,
                    "checkpoint_every": STEPS, "optimizer": {"lr": 1.0e-3}},
        "storage": {"root": str(store)},
    })  # fmt: skip
    run = prepare_run(config)
    launch = trainer_launch(config, run)
    run_with_metrics(launch, lambda step, metrics: None)
    weights = WeightStore(open_root(str(store)))
    metrics = read_jsonl_metrics(launch.metrics_file)
    observed = {
        "signature": kernel_signature(launch.env["OMP_NUM_THREADS"]),
        "steps": [
            {"step": int(m["step"]), "loss": m["loss"], "grad_norm": m["grad_norm"],
             "model_sha256": weights.weight_digests(int(m["version"]))["model.safetensors"]}
            for m in metrics
        ],
        "first_weights_sha256": weights.weight_digests(0)["model.safetensors"],
    }  # fmt: skip
    if UPDATE:
        (GOLDEN / "golden.json").write_text(json.dumps(observed, indent=1) + "\n")
        pytest.skip("golden/golden.json rewritten: commit it, saying why the trainer's numbers changed")
    golden = json.loads((GOLDEN / "golden.json").read_text())
    assert [s["step"] for s in observed["steps"]] == [s["step"] for s in golden["steps"]] == list(range(1, STEPS + 1))
    for seen, recorded in zip(observed["steps"], golden["steps"], strict=True):
        for key in ("loss", "grad_norm"):
            assert seen[key] == pytest.approx(recorded[key], rel=1e-5, abs=1e-7), (
                f"step {seen['step']}: {key} {seen[key]!r}, golden {recorded[key]!r}; if the change is meant, "
                "update the golden values (module docstring)"
            )
    if observed["signature"] != golden["signature"]:
        pytest.skip(f"losses match; weight digests are recorded for {golden['signature']}, this machine is {observed['signature']}")
    assert observed["first_weights_sha256"] == golden["first_weights_sha256"], "the tiny model's first weights changed"
    assert [s["model_sha256"] for s in observed["steps"]] == [s["model_sha256"] for s in golden["steps"]], (
        "the trained weights differ from the golden ones bit for bit; if the change is meant, update them (module docstring)"
    )
