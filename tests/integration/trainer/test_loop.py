"""The RL loop in-process on a local run root: ledger, publish, checkpoints, resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from asyncrl.storage import fs, paths
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.schema import SCHEMA_VERSION, TRAJECTORY_SCHEMA, ShardMetadata
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.trainer.batch import TokenSequence
from asyncrl.tasks.trainer.checkpoint import complete_checkpoints
from asyncrl.tasks.trainer.feed import TrainerInputError
from asyncrl.tasks.trainer.logprobs import sequence_logprobs
from asyncrl.tasks.trainer.loop import LoopSettings, RLTrainer, TrainerWaitTimeout
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.tasks.trainer.metrics import JsonlMetricsSink, read_jsonl_metrics
from asyncrl.tasks.trainer.rl_settings import RLSettings

RUN_ID = "trainer-test"
VLLM_TOLERANCE = 1e-4
"""|vLLM behaviour log-prob - trainer log-prob| allowed (float32 both; kernels differ)."""
RL = RLSettings(micro_batch_tokens=256, max_staleness=4)


def _trainer(root: Any, engine: Any, tmp_path: Path, max_steps: int, timeout: float = 5.0) -> RLTrainer:
    loop = LoopSettings(batch_groups=1, max_steps=max_steps, checkpoint_every=2, poll_interval_s=0.05, wait_timeout_s=timeout)
    return RLTrainer(root, RUN_ID, engine, RL, loop, tmp_path / "work", JsonlMetricsSink(tmp_path / "metrics.jsonl"))


def sample_with_vllm(model_dir: Path, prompt: list[int], version: int, log_dir: Path) -> list[Any]:
    """Two 12-token samples of ``prompt`` from a vLLM rollout server on ``model_dir``."""
    import asyncio

    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.inference.server import RolloutServer
    from asyncrl.tasks.inference.server_config import RolloutServerConfig

    async def sample(server: RolloutServer) -> list[Any]:
        async with RolloutClient([server.handle], initial_version=version) as client:
            return await client.generate_group(prompt, 2, 12, 1.0, ignore_eos=True)

    with RolloutServer(RolloutServerConfig(model_dir=model_dir, kv_cache_gib=1.0, log_path=log_dir / "vllm.log")) as server:
        return asyncio.run(sample(server))


def test_steps_record_before_publish_and_weights_reproduce_logprobs(
    run_root: Any, engine: Any, trajectories: Any, tmp_path: Path
) -> None:
    writer = ShardWriter(run_root, RUN_ID)
    # The trainer takes shards in the order they were written (the scheduler writes groups
    # in admission order, see asyncrl.tasks.trainer.feed).
    oldest = writer.write_groups([trajectories.group("g-b", [0.0, 1.0], versions=0)])
    middle = writer.write_groups([trajectories.group("g-c", [1.0, 1.0, 0.0], versions=[1, 1, 0])])
    newest = writer.write_groups([trajectories.group("g-a", [1.0, 0.0], versions=2)])

    trainer = _trainer(run_root, engine, tmp_path, max_steps=3)
    report = trainer.start()
    assert report.published_initial and report.state.step == 0 and report.resumed_from is None
    state = trainer.run()
    assert (state.step, state.version) == (3, 3)

    ledger, store = Ledger(run_root), WeightStore(run_root)
    entries = ledger.entries()
    assert [e.shards for e in entries] == [(oldest.name,), (middle.name,), (newest.name,)]
    assert store.list_versions() == [0, 1, 2, 3]
    for entry in entries:  # each step's ledger entry precedes its weights
        assert entry.recorded_at <= store.manifest(entry.step)["published_at"]
    assert complete_checkpoints(run_root) == [0, 2]

    records = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "reward_mean", "advantage_std", "clip_fraction", "behav_weight_mean", "staleness_max",
                "tokens_per_s", "packing_efficiency", "step_time_s", "learning_rate", "version"):
        assert all(r[key] is not None for r in records), key
    assert [r["staleness_max"] for r in records] == [0.0, 1.0, 0.0]  # versions 0 at v0, 0..1 at v1, 2 at v2

    # The published version loads in plain transformers and reproduces the trainer's log-probs.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = store.download(3, tmp_path / "v3")
    lineage = json.loads((local / LINEAGE_FILE).read_text())
    assert lineage["parent_version"] == 2 and lineage["shards"] == [newest.name]
    model = AutoModelForCausalLM.from_pretrained(local).eval()
    tokenizer = AutoTokenizer.from_pretrained(local)
    assert tokenizer("What is 3+4*2?\n")["input_ids"] == trajectories.prompt_ids("What is 3+4*2?\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # unchanged from the source model
        assert (local / name).read_bytes() == (engine.model_dir / name).read_bytes()
    # Same tensor names, shapes and dtypes as the source checkpoint (what vLLM's loader maps).
    published, source = load_file(local / "model.safetensors"), load_file(engine.model_dir / "model.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in published.items()} == {k: (v.shape, v.dtype) for k, v in source.items()}
    samples = [s for g in ShardReader(run_root, RUN_ID).read_groups(middle) for s in g]
    seqs = [TokenSequence(tuple(s.prompt_token_ids), tuple(s.output_token_ids)) for s in samples]
    ours = sequence_logprobs(engine.ds, seqs, [[0, 1], [2]])
    theirs = sequence_logprobs(model, seqs, [[0], [1], [2]])
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) < 1e-5

    # ... and in vLLM: tokens a rollout server samples from the published version carry
    # behaviour log-probs equal to what the trainer's engine computes for them.
    prompt = trajectories.prompt_ids("What is 3+4*2?\n")
    vllm_outputs = sample_with_vllm(local, prompt, version=3, log_dir=tmp_path)
    seqs = [TokenSequence(tuple(prompt), tuple(o.output_token_ids)) for o in vllm_outputs]
    for output, trainer_logprobs in zip(vllm_outputs, sequence_logprobs(engine.ds, seqs, [[0, 1]])):
        assert output.token_versions == [3] * len(output.output_token_ids)
        assert float((torch.tensor(output.behaviour_logprobs) - trainer_logprobs).abs().max()) < VLLM_TOLERANCE

    # Restart on the same root: back to checkpoint 2, step 3 rolled back and redone with its
    # shard, numbered after the latest published version; then no data -> timeout.
    again = _trainer(run_root, engine, tmp_path, max_steps=4, timeout=0.3)
    report = again.start()
    assert report.resumed_from == 2 and report.rolled_back == (3,) and report.state.version == 3
    assert ledger.steps() == [1, 2]
    with pytest.raises(TrainerWaitTimeout, match="waited 0.3 s for 1 prompt groups"):
        again.run()
    assert [e.shards for e in ledger.entries()][-1] == (newest.name,)
    assert store.list_versions() == [0, 1, 2, 3, 4]
    # Its first version's parent is the checkpoint's version 2 (the weights it resumed from),
    # not version 3 of the rolled-back step.
    assert json.loads((store.download(4, tmp_path / "v4") / LINEAGE_FILE).read_text())["parent_version"] == 2


def _put_shard(root: Any, seq: int, data: bytes) -> str:
    name = paths.shard_name(seq, 0, 0)
    fs.put_if_absent(root, paths.shard_path(name), data)
    return name


def _empty_arrow(run_id: str, seq: int) -> bytes:
    meta = ShardMetadata(SCHEMA_VERSION, run_id, seq, 0, 0, 0, 0).to_arrow()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, TRAJECTORY_SCHEMA.with_metadata(meta)):
        pass
    return sink.getvalue().to_pybytes()


def _bad_shard(kind: str, root: Any, trajectories: Any) -> tuple[str, str]:
    """Write one bad shard of ``kind``; return (its name, the error text expected)."""
    if kind == "empty":
        return _put_shard(root, 50, _empty_arrow(RUN_ID, 50)), "table has no rows"
    if kind == "zero-bytes":
        return _put_shard(root, 51, b""), "not a readable Arrow IPC file"
    if kind == "corrupt":
        good = ShardWriter(root, "scratch-run").write_groups([trajectories.group("g-x", [1.0, 0.0])])
        data = fs.read_bytes(root, good.relpath)
        fs.delete(root, good.relpath)
        return _put_shard(root, 52, data[: len(data) // 2]), "not a readable Arrow IPC file"
    if kind == "other-run":
        info = ShardWriter(root, "another-run").write_groups([trajectories.group("g-y", [1.0, 0.0])])
        return info.name, "run_id 'another-run' is not this run's 'trainer-test'"
    if kind == "vocabulary":
        group = trajectories.group("g-z", [1.0, 0.0])
        group[0] = type(group[0])(**{**vars(group[0]), "output_token_ids": [400] * len(group[0].output_token_ids)})
        info = ShardWriter(root, RUN_ID).write_groups([group])
        return info.name, "output_token_ids holds token id 400, outside the model's vocabulary of 320 ids"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["empty", "zero-bytes", "corrupt", "other-run", "vocabulary"])
def test_bad_input_is_a_clear_error_and_loses_nothing(
    kind: str, run_root: Any, engine: Any, trajectories: Any, tmp_path: Path
) -> None:
    good = ShardWriter(run_root, RUN_ID).write_groups([trajectories.group("g-good", [1.0, 0.0])])
    bad, expected = _bad_shard(kind, run_root, trajectories)
    loop = LoopSettings(batch_groups=2, max_steps=1, checkpoint_every=1, poll_interval_s=0.05, wait_timeout_s=5)
    trainer = RLTrainer(run_root, RUN_ID, engine, RL, loop, tmp_path / "work", JsonlMetricsSink(tmp_path / "m.jsonl"))
    trainer.start()
    with pytest.raises(TrainerInputError, match=expected) as caught:
        trainer.run()
    assert bad in str(caught.value)
    assert Ledger(run_root).steps() == []
    assert WeightStore(run_root).list_versions() == [0]  # only the initial weights
    assert not (tmp_path / "m.jsonl").exists()
    assert good.name in [i.name for i in ShardReader(run_root, RUN_ID).list_unconsumed(set())]
    # Every rejected shard is quarantined, whatever check rejected it, and the error says where.
    quarantined = fs.list_dir(run_root, paths.QUARANTINE_DIR)
    assert [n for n in quarantined if n.startswith(bad)]
    assert f"moved to {paths.QUARANTINE_DIR}/{bad}" in str(caught.value)


def test_a_restarted_trainer_goes_on_past_a_shard_its_model_cannot_train(
    run_root: Any, engine: Any, trajectories: Any, tmp_path: Path
) -> None:
    writer = ShardWriter(run_root, RUN_ID)
    bad, expected = _bad_shard("vocabulary", run_root, trajectories)  # oldest: taken first
    good = writer.write_groups([trajectories.group("g-good", [1.0, 0.0], versions=1)])
    loop = LoopSettings(batch_groups=1, max_steps=1, checkpoint_every=1, poll_interval_s=0.05, wait_timeout_s=5)

    def trainer() -> RLTrainer:
        return RLTrainer(run_root, RUN_ID, engine, RL, loop, tmp_path / "work", JsonlMetricsSink(tmp_path / "m.jsonl"))

    with pytest.raises(TrainerInputError, match=expected) as caught:
        trainer().run()
    assert f"(shard moved to {paths.quarantine_path(bad)}; a restarted trainer goes on without it)" in str(caught.value)
    assert trainer().run().step == 1  # the restart trains on the good shard instead of crashing again
    assert [e.shards for e in Ledger(run_root).entries()] == [(good.name,)]
    assert ShardReader(run_root, RUN_ID).list_pending() == []
    assert fs.exists(run_root, paths.consumed_shard_path(good.name))
    assert fs.list_dir(run_root, paths.QUARANTINE_DIR) == [bad]


def test_a_waiting_trainer_starts_when_the_scheduler_rings_and_rings_after_publishing(
    run_root: Any, engine: Any, trajectories: Any, tmp_path: Path
) -> None:
    """With a 60 s poll interval, the shards doorbell alone starts the step: a shard written
    and rung while the trainer waits is trained at once, exactly once, and the trainer rings
    the weights doorbell after publishing the step's version."""
    import threading
    import time

    from asyncrl.storage.doorbell import SHARDS_TOPIC, WEIGHTS_TOPIC, Doorbell, DoorbellListener

    loop = LoopSettings(batch_groups=1, max_steps=1, checkpoint_every=1, poll_interval_s=60.0, wait_timeout_s=None)
    trainer = RLTrainer(run_root, RUN_ID, engine, RL, loop, tmp_path / "work", JsonlMetricsSink(tmp_path / "m.jsonl"))
    trainer.start()
    written: list[str] = []

    def scheduler() -> None:
        time.sleep(1.0)  # the trainer is waiting by now
        written.append(ShardWriter(run_root, RUN_ID).write_groups([trajectories.group("g-late", [1.0, 0.0])]).name)
        Doorbell(run_root, SHARDS_TOPIC).ring()

    with DoorbellListener(run_root, WEIGHTS_TOPIC) as weights_bell:
        thread = threading.Thread(target=scheduler)
        started = time.monotonic()
        thread.start()
        assert trainer.run().step == 1
        elapsed = time.monotonic() - started
        thread.join()
        assert weights_bell.wait(0.0)  # rung after version 1 was published
    assert elapsed < 30.0  # woken by the ring, not the 60 s poll
    assert [e.shards for e in Ledger(run_root).entries()] == [tuple(written)]
    assert WeightStore(run_root).list_versions()[-1] == 1
    assert fs.list_dir(run_root, paths.doorbell_dir(SHARDS_TOPIC)) == []  # the listener left no address
