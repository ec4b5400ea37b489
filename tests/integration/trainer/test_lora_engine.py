"""LoRA on the real DeepSpeed engine (tiny model, ZeRO stage 1): the optimizer holds the
adapters alone and a step moves nothing else; a published version is the adapter alone, in
the weight store, loadable by PEFT with the trainer's log-probs; the merged export loads with
``AutoModelForCausalLM``; a checkpoint holds the adapters (not the frozen base) and resuming
from it restores the adapters and the optimizer state; SFT trains the adapters too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.configs.trainer import LoraConfig, OptimizerConfig
from asyncrl.configs.loading import config_from_dict
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.shards import ShardWriter
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.model.weight_fetch import model_weights
from asyncrl.tasks.trainer.batch import TokenSequence
from asyncrl.tasks.trainer.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from asyncrl.tasks.trainer.engine import EngineSettings, build_engine
from asyncrl.tasks.trainer.logprobs import sequence_logprobs
from asyncrl.tasks.trainer.loop import LoopSettings, RLTrainer, publish_weights
from asyncrl.tasks.trainer.main import lora_start
from asyncrl.tasks.trainer.metrics import JsonlMetricsSink
from asyncrl.tasks.model.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir, merge_adapter
from asyncrl.tasks.trainer.rl_settings import RLSettings
from asyncrl.tasks.trainer.sft import SFTSettings, run_sft
from asyncrl.tasks.trainer.step import run_rl_step

LORA = LoraConfig(rank=4, alpha=8.0)
LR = 1e-2
RUN_ID = "trainer-test"


def _settings(model_dir: Path, initial_adapter: Path | None = None) -> EngineSettings:
    return EngineSettings(
        optimizer=OptimizerConfig(lr=LR, grad_clip=1.0),
        zero_stage=1,
        logit_chunk_tokens=64,
        lora=LORA,
        initial_adapter=initial_adapter,
        base_model_reference=str(model_dir),
    )


@pytest.fixture(scope="module")
def shared_lora_engine(trainer_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    engine = build_engine(trainer_model_dir, _settings(trainer_model_dir))
    initial = tmp_path_factory.mktemp("lora-initial")
    engine.ds.save_checkpoint(str(initial), tag="initial", save_latest=False)
    yield engine, initial


@pytest.fixture
def lora_engine(shared_lora_engine: tuple[Any, Path]) -> Any:
    """The module's LoRA engine, reset to its initial state (B = 0, fresh optimizer)."""
    engine, initial = shared_lora_engine
    path, _ = engine.ds.load_checkpoint(str(initial), tag="initial")
    assert path is not None
    return engine


def _split(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapter, base) parameters by name, cloned."""
    adapter, base = {}, {}
    for name, param in engine.module.named_parameters():
        (adapter if param.requires_grad else base)[name] = param.detach().clone()
    return adapter, base


def _groups(trajectories: Any, count: int = 2) -> list[Any]:
    return [trajectories.group(f"g{k}", [1.0, 0.0, 0.5], output_len=(6, 10)) for k in range(count)]


def _step(engine: Any, groups: list[Any], updates: int = 0) -> None:
    run_rl_step(engine, groups, RLSettings(micro_batch_tokens=256), trainer_updates=updates)


def _logprobs(model: Any, groups: list[Any], chunk: int | None) -> list[torch.Tensor]:
    sequences = [TokenSequence(tuple(s.prompt_token_ids), tuple(s.output_token_ids)) for g in groups for s in g]
    return sequence_logprobs(model, sequences, [[i] for i in range(len(sequences))], chunk)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_the_optimizer_holds_only_the_adapters_and_a_step_moves_only_them(lora_engine: Any, trajectories: Any) -> None:
    engine = lora_engine
    adapter, base = _split(engine)
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert all(float(t.abs().max()) == 0.0 for n, t in adapter.items() if ".lora_B." in n)  # B = 0 at the start
    trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
    in_optimizer = {id(p) for group in engine.ds.optimizer.bit16_groups for p in group}
    assert in_optimizer == trainable
    partition = sum(t.numel() for t in engine.ds.optimizer.single_partition_of_fp32_groups)
    assert partition == sum(t.numel() for t in adapter.values())  # one rank: its partition is everything

    groups = _groups(trajectories)
    _step(engine, groups, 0)
    _step(engine, groups, 1)
    after_adapter, after_base = _split(engine)
    assert all(torch.equal(after_base[n], base[n]) for n in base)
    assert all(not torch.equal(after_adapter[n], adapter[n]) for n in adapter)  # every A and B moved


def test_a_published_version_is_the_adapter_and_peft_loads_it_with_the_trainer_logprobs(
    lora_engine: Any, trajectories: Any, run_root: RunRoot, tmp_path: Path, trainer_model_dir: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = lora_engine
    groups = _groups(trajectories)
    _step(engine, groups, 0)
    _step(engine, groups, 1)
    store = WeightStore(run_root)
    publish_weights(store, engine, 0, {"parent_version": None, "step": 2}, tmp_path / "work")
    assert store.latest() == 0
    version_dir = model_weights(run_root, str(trainer_model_dir), 0, tmp_path / "cache")

    names = {p.name for p in version_dir.iterdir()}
    assert names == {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "config.json", LINEAGE_FILE}
    assert is_adapter_dir(version_dir)
    tensors = load_file(str(version_dir / ADAPTER_WEIGHTS))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in tensors
    assert all(name.startswith("base_model.model.model.layers.") and ".default." not in name for name in tensors)
    assert len(tensors) == 2 * len(LORA.target_modules) * 2
    config = json.loads((version_dir / ADAPTER_CONFIG).read_text())
    assert config["r"] == LORA.rank and config["lora_alpha"] == LORA.alpha
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    assert config["base_model_name_or_path"] == str(trainer_model_dir)
    assert config["peft_type"] == "LORA" and config["inference_mode"] is True

    base = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    loaded = PeftModel.from_pretrained(base, str(version_dir)).eval()
    engine.module.eval()
    ours = _logprobs(engine.ds, groups, engine.logit_chunk_tokens)
    theirs = _logprobs(loaded, groups, engine.logit_chunk_tokens)
    with loaded.disable_adapter():
        plain = _logprobs(loaded, groups, None)
    assert _max_diff(ours, theirs) < 1e-6
    assert _max_diff(ours, plain) > 1e-4  # the adapter carries the training


def test_a_published_adapter_merged_into_its_base_loads_as_a_full_model_with_the_adapted_logprobs(
    lora_engine: Any, trajectories: Any, tmp_path: Path
) -> None:
    """What MLflow registration does with a LoRA version (merge_adapter of the published
    files into the base): a full HF model computing the trained model's log-probs."""
    from transformers import AutoModelForCausalLM

    engine = lora_engine
    groups = _groups(trajectories)
    _step(engine, groups, 0)
    _step(engine, groups, 1)
    from asyncrl.tasks.trainer.engine import save_hf_weights

    published = save_hf_weights(engine, tmp_path / "v2")
    out = merge_adapter(engine.model_dir, published, tmp_path / "merged")
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not any(name.startswith("adapter_") for name in names)
    merged = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    engine.module.eval()
    assert _max_diff(_logprobs(engine.ds, groups, None), _logprobs(merged, groups, None)) < 1e-5


def test_a_checkpoint_holds_the_adapters_and_resuming_restores_them_and_the_optimizer(
    lora_engine: Any, trajectories: Any, run_root: RunRoot, tmp_path: Path
) -> None:
    engine = lora_engine
    first, second = _groups(trajectories), _groups(trajectories)
    _step(engine, first, 0)  # Adam's moments are non-zero from here
    saved_adapter, base = _split(engine)
    save_checkpoint(run_root, engine, CheckpointState(step=1, version=1), tmp_path / "work")

    (states,) = list((tmp_path / "store").rglob("*model_states.pt"))  # the run_root fixture's directory
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    frozen_saved = [name for name in module if ".lora_" not in name]
    # The frozen base is not stored; at most a tied alias of a frozen weight (the tiny model ties
    # lm_head to the embedding, and DeepSpeed drops frozen parameters by their first name only).
    assert frozen_saved in ([], ["base_model.model.lm_head.weight"])
    assert {name for name in module if ".lora_" in name} == set(saved_adapter)

    _step(engine, second, 1)
    continued, _ = _split(engine)
    assert any(not torch.equal(continued[n], saved_adapter[n]) for n in saved_adapter)

    state = load_checkpoint(run_root, engine, 1, tmp_path / "work")
    assert state == CheckpointState(step=1, version=1)
    restored, restored_base = _split(engine)
    assert all(torch.equal(restored[n], saved_adapter[n]) for n in saved_adapter)
    assert all(torch.equal(restored_base[n], base[n]) for n in base)
    _step(engine, second, 1)  # the same update again: equal only if the optimizer state came back too
    again, _ = _split(engine)
    assert max(float((again[n] - continued[n]).abs().max()) for n in continued) < 1e-7


def test_a_new_engine_starts_from_a_published_adapter(
    lora_engine: Any, trajectories: Any, tmp_path: Path, trainer_model_dir: Path
) -> None:
    engine = lora_engine
    _step(engine, _groups(trajectories), 0)
    published = tmp_path / "adapter"
    from asyncrl.tasks.trainer.engine import save_hf_weights

    save_hf_weights(engine, published)
    trained, _ = _split(engine)
    resumed = build_engine(trainer_model_dir, _settings(trainer_model_dir, initial_adapter=published))
    assert resumed.model_dir == trainer_model_dir
    started, _ = _split(resumed)
    assert set(started) == set(trained)
    assert all(torch.equal(started[n], trained[n]) for n in trained)


def test_sft_trains_the_adapters_only(lora_engine: Any, trajectories: Any) -> None:
    engine = lora_engine
    adapter, base = _split(engine)
    sequences = [
        TokenSequence(tuple(trajectories.prompt_ids(f"Q{k}: 2+{k}?\n")), tuple(trajectories.prompt_ids(f"{2 + k}")))
        for k in range(4)
    ]
    losses = run_sft(engine, sequences, SFTSettings(steps=2, batch_size=2, micro_batch_tokens=256))
    assert len(losses) == 2
    after_adapter, after_base = _split(engine)
    assert all(torch.equal(after_base[n], base[n]) for n in base)
    assert any(not torch.equal(after_adapter[n], adapter[n]) for n in adapter if ".lora_B." in n)


def test_the_loop_publishes_adapters_and_a_restart_resumes_the_adapters_from_its_checkpoint(
    shared_lora_engine: tuple[Any, Path],
    lora_engine: Any,
    trajectories: Any,
    run_root: RunRoot,
    tmp_path: Path,
    trainer_model_dir: Path,
) -> None:
    engine, initial = shared_lora_engine
    writer = ShardWriter(run_root, RUN_ID)
    for k in range(2):
        writer.write_groups([trajectories.group(f"g{k}", [1.0, 0.0, 0.5], output_len=(6, 10))])
    loop = LoopSettings(batch_groups=1, max_steps=2, checkpoint_every=1, poll_interval_s=0.05, wait_timeout_s=5)

    def trainer() -> RLTrainer:
        settings = RLSettings(micro_batch_tokens=256, max_staleness=4)
        return RLTrainer(run_root, RUN_ID, engine, settings, loop, tmp_path / "work", JsonlMetricsSink(tmp_path / "m.jsonl"))

    first = trainer()
    assert first.start().published_initial
    assert first.run().step == 2
    store = WeightStore(run_root)
    assert store.list_versions() == [0, 1, 2]
    for version in (0, 1, 2):
        local = model_weights(run_root, str(trainer_model_dir), version, tmp_path / "cache")
        assert is_adapter_dir(local) and not (local / "model.safetensors").exists()
    trained, base = _split(engine)

    engine.ds.load_checkpoint(str(initial), tag="initial")  # a fresh process: B = 0 again
    report = trainer().start()
    assert report.resumed_from == 2 and report.state.step == 2
    restored, restored_base = _split(engine)
    assert all(torch.equal(restored[n], trained[n]) for n in trained)
    assert all(torch.equal(restored_base[n], base[n]) for n in base)

    # What a restarted trainer process builds its engine from: the base model, and the latest adapter.
    config = config_from_dict(
        {
            "name": RUN_ID,
            "model": {"path": str(trainer_model_dir)},
            "data": {"train_path": str(tmp_path / "train.jsonl")},
            "trainer": {"lora": {"rank": LORA.rank, "alpha": LORA.alpha}},
            "storage": {"root": str(tmp_path / "store")},
        }
    )
    latest = model_weights(run_root, str(trainer_model_dir), 2, tmp_path / "work" / "weights-cache")
    base_dir, adapter = lora_start(run_root, config, latest, 2, tmp_path / "work")
    assert base_dir == trainer_model_dir and adapter == latest
    assert lora_start(run_root, config, trainer_model_dir, None, tmp_path / "work") == (trainer_model_dir, None)


@pytest.mark.parametrize("stage", [0, 2])
def test_other_zero_stages_with_activation_checkpointing_train_the_adapters_only(
    stage: int, trainer_model_dir: Path, trajectories: Any
) -> None:
    settings = EngineSettings(
        optimizer=OptimizerConfig(lr=LR), zero_stage=stage, logit_chunk_tokens=16, activation_checkpointing=True, lora=LORA
    )
    engine = build_engine(trainer_model_dir, settings)
    adapter, base = _split(engine)
    groups = _groups(trajectories)
    _step(engine, groups, 0)
    _step(engine, groups, 1)
    after_adapter, after_base = _split(engine)
    assert all(torch.equal(after_base[n], base[n]) for n in base)
    assert all(not torch.equal(after_adapter[n], adapter[n]) for n in adapter)


def test_the_entry_point_trains_and_publishes_adapters_in_sft_mode_and_refuses_zero_3(
    trainer_model_dir: Path, tmp_path: Path, run_config_writer: Any
) -> None:
    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.data.synthetic import write_synthetic_dataset
    from asyncrl.tasks.trainer.main import main

    data = write_synthetic_dataset(tmp_path / "train.parquet", n=8, seed=4)
    lora = {"rank": LORA.rank, "alpha": LORA.alpha}
    config = run_config_writer(
        tmp_path / "run.yaml", model=trainer_model_dir, store=tmp_path / "store", data=data, trainer={"lora": lora}
    )
    args = ["--config", str(config), "--mode", "sft", "--sft-steps", "2", "--sft-batch-size", "4",
            "--work-dir", str(tmp_path / "work")]  # fmt: skip
    assert main(args) == 0
    assert main(args) == 0  # the second run goes on from version 0's adapter, on the same base
    store = WeightStore(open_root(str(tmp_path / "store")))
    assert store.list_versions() == [0, 1]
    versions = [store.download(v, tmp_path / f"v{v}") for v in (0, 1)]
    for local in versions:
        assert {p.name for p in local.iterdir()} == {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "config.json", LINEAGE_FILE}
        assert json.loads((local / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(trainer_model_dir)
    first, second = (load_file(str(local / ADAPTER_WEIGHTS)) for local in versions)
    assert any(float(t.abs().max()) > 0 for n, t in first.items() if ".lora_B." in n)
    assert any(not torch.equal(first[n], second[n]) for n in first)
    assert json.loads((versions[1] / LINEAGE_FILE).read_text())["parent_version"] == 0

    assert main([*args, "trainer.zero_stage=3"]) == 2


def test_a_lora_run_s_kl_reference_is_its_base_with_the_adapters_off(lora_engine: Any, trajectories: Any) -> None:
    from asyncrl.tasks.trainer.reference import load_reference, reference_logprobs

    reference = load_reference(lora_engine, None)
    assert reference.adapters_off and reference.model is lora_engine.ds  # no copy of the model
    groups = _groups(trajectories)
    settings = RLSettings(micro_batch_tokens=128, kl_coef=0.5)
    first = run_rl_step(lora_engine, groups, settings, 0, reference=reference)
    assert first.update.means()["ref_kl"] == pytest.approx(0.0, abs=1e-9)  # B = 0: the policy is the base
    later = run_rl_step(lora_engine, groups, settings, 1, reference=reference)
    assert later.update.means()["ref_kl"] > 0

    items = first.prepared.items
    ref = reference_logprobs(reference, lora_engine, items, range(len(items)), "ffd", 128)
    base = sequence_logprobs(lora_engine.ds, [items[0].sequence], [[0]])[0]
    with lora_engine.module.disable_adapter():
        off = sequence_logprobs(lora_engine.ds, [items[0].sequence], [[0]])[0]
    assert not torch.allclose(base, off)  # the adapters have moved the policy
    assert torch.allclose(ref[0], off) and lora_engine.module.training  # base log-probs; train mode restored
