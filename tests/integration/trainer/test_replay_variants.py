"""`asyncrl replay` beyond the plain case: every weight version reproduced bit for bit for a
LoRA run (adapters published) trained on agent rows (masked environment tokens, turn starts)
mixed with code-task rows, and for a ZeRO-2 run at world size 2 (two trainer processes under
torchrun, gloo) on the same kinds of rows. The original runs are the real trainer process on
stored shards, as a run trains; the replay is the trainer alone over their ledgers. A LoRA
fork that would reshape the adapters, or whose base model is gone, is refused, naming it."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_trainer import Trajectories

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardWriter
from asyncrl.tasks.launch.context import open_run_context
from asyncrl.tasks.pipeline.replay import ReplayError, ReplayRequest, replay_run
from asyncrl.tasks.pipeline.stages import run_with_metrics
from asyncrl.tasks.placement.launch_settings import trainer_launch

pytestmark = pytest.mark.slow

STEPS = 3
VARIANTS: dict[str, dict[str, Any]] = {
    "lora": {"lora": {"rank": 4, "alpha": 8}, "zero_stage": 0},
    "zero2-world-size-2": {"processes": 2, "zero_stage": 2},
}


def agent_row(sample: Sample) -> Sample:
    """``sample`` as a two-turn episode: its middle third inserted by the environment (masked,
    log-prob 0, the version of the model token before it), a model turn after it."""
    n = len(sample.output_token_ids)
    start, end = n // 3, 2 * n // 3
    mask = [not start <= t < end for t in range(n)]
    logprobs = [lp if keep else 0.0 for lp, keep in zip(sample.behaviour_logprobs, mask)]
    return dataclasses.replace(sample, output_mask=mask, behaviour_logprobs=logprobs, turn_starts=[0, end], task="tool")


def write_original(base: Path, model_dir: Path, trainer: dict[str, Any]) -> Path:
    """A finished run root of STEPS steps of two groups each (an agent group and a code-task
    group), trained by the real trainer process with ``trainer`` settings."""
    from transformers import AutoTokenizer

    store = base / "store"
    config = RunConfig.model_validate({
        "name": "replay-variant", "work_dir": str(base / "work"), "model": {"path": str(model_dir)},
        "data": {"train_path": str(base / "unused.parquet"), "max_prompt_tokens": 32},
        "rollout": {"n_samples": 3, "max_new_tokens": 24, "eta": 2},
        "trainer": {"batch_groups": 2, "max_steps": STEPS, "micro_batch_tokens": 128, "checkpoint_every": STEPS,
                    "mini_batches": 1, "optimizer": {"lr": 1.0e-3}, **trainer},
        "storage": {"root": str(store)}, "tracking": {"mlflow_uri": f"sqlite:///{base / 'mlflow.db'}"},
    })  # fmt: skip
    trajectories = Trajectories(AutoTokenizer.from_pretrained(model_dir), seed=7)
    writer = ShardWriter(open_root(str(store)), "replay-variant")
    for k in range(STEPS):
        version = max(0, k - 1)
        agent = trajectories.group(f"a{k}", [1.0, 0.0, 0.5], output_len=(9, 18), versions=version)
        code = trajectories.group(f"c{k}", [0.0, 1.0, 1.0], versions=version)
        episodes, code = [agent_row(s) for s in agent], [dataclasses.replace(s, task="code") for s in code]
        writer.write_groups([episodes, code])
    context = open_run_context(config)
    launch = trainer_launch(config, context.paths)
    run_with_metrics(launch, lambda step, metrics: None)
    context.lineage.end()
    assert Ledger(open_root(str(store))).last_step() == STEPS
    return store


@pytest.fixture(scope="module")
def originals(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The original run root of a variant, trained once per module."""
    made: dict[str, Path] = {}

    def original(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_original(tmp_path_factory.mktemp(variant), tiny_model_dir, VARIANTS[variant])
        return made[variant]

    return original


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_version_of_the_variant_is_reproduced_bit_for_bit(
    variant: str, originals: Callable[[str], Path], tmp_path: Path
) -> None:  # fmt: skip
    report = replay_run(ReplayRequest(str(originals(variant)), tmp_path / "replay"))
    assert report["steps"] == STEPS and report["versions_compared"] == STEPS + 1, report
    assert report["first_difference"] is None and report["versions_identical"] == STEPS + 1, report["comparisons"]


def test_a_lora_fork_that_reshapes_the_adapters_or_lost_its_base_is_refused_naming_it(
    originals: Callable[[str], Path], tmp_path: Path
) -> None:  # fmt: skip
    original = originals("lora")
    with pytest.raises(ReplayError, match=r"trainer.lora.rank: a fork of a LoRA run keeps its adapters' shape"):
        replay_run(ReplayRequest(str(original), tmp_path / "fork", overrides=("trainer.lora.rank=8",)))
    moved = tmp_path / "moved-root"
    shutil.copytree(original, moved)
    frozen = yaml.safe_load((moved / "config.yaml").read_text())
    frozen["model"]["path"] = str(tmp_path / "gone")
    (moved / "config.yaml").write_text(yaml.safe_dump(frozen))
    with pytest.raises(ReplayError, match=r"model.path '.*gone': the base model of this LoRA run is not there"):
        replay_run(ReplayRequest(str(moved), tmp_path / "replay-moved"))
    assert not [f for f in (tmp_path / "replay-moved").rglob("*") if f.is_file()]  # refused before anything is written
