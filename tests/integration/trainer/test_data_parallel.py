"""Data-parallel training: the token-balanced split, world size 2 against world size 1,
checkpoints resumed at another world size, ZeRO stage 3 and its publish (real DeepSpeed,
gloo, ``torch.distributed.run``).

The multi-process cases run ``dp_worker.py`` (this directory) as subprocesses, one after
the other: world size 1 as a plain process, world size 2 under ``torch.distributed.run``.
"""

from __future__ import annotations

import json
import sys
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.tasks.system.process_group import kill_group, read_log_tail, spawn_session
from asyncrl.tasks.trainer.checkpoint import (
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from asyncrl.tasks.trainer.data_parallel import balanced_partition
from asyncrl.tasks.trainer.process import TrainerLaunch, trainer_env
from asyncrl.tasks.trainer.zero3_reshard import repartition, reshard_zero3_states
from asyncrl.tasks.trainer.zero_reshard import ReshardError, reshard_for, zero_world_size

WORKER = Path(__file__).with_name("dp_worker.py")
LR = 1e-3  # dp_worker's learning rate


# --- the split --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=500), max_size=40), st.integers(min_value=1, max_value=6))
def test_balanced_partition_places_every_item_once_within_the_longest_item(lengths: list[int], parts: int) -> None:
    shares = balanced_partition(lengths, parts)
    assert len(shares) == parts
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in shares)
    assert balanced_partition(list(lengths), parts) == shares  # a pure function of its input
    tokens = [sum(lengths[i] for i in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(lengths, default=0)


def test_balanced_partition_balances_tokens_not_counts() -> None:
    lengths = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    shares = balanced_partition(lengths, 2)
    assert [sum(lengths[i] for i in share) for share in shares] == [10, 10]
    assert shares == [[0], list(range(1, 11))]
    # Round-robin would give 15 and 5 tokens.
    assert [sum(lengths[i::2]) for i in range(2)] == [15, 5]
    assert balanced_partition([3, 3], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balanced_partition([1], 0)


def test_collectives_share_results_and_failures_between_two_ranks(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(WORKER.with_name("dp_collectives.py")), str(tmp_path)]  # fmt: skip
    log = tmp_path / "collectives.log"
    process = spawn_session(command, log, env=trainer_env(TrainerLaunch(Path("unused.yaml"), log)))
    try:
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            kill_group(process, grace_s=2.0)
    assert code == 0, read_log_tail(log, 40)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, view in enumerate(seen):
        assert view["sum"] == [3.0, 10.0] and view["max"] == [1.0, 0.0]
        assert view["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert view["broadcast"] == ["chosen by", 0]  # rank 0's value on every rank
        assert view["error"] == ["ValueError", "no shards"]  # rank 0's failure fails every rank
    assert seen[0]["two_argument_error"] == ["TwoArgumentError", "1/2"]
    assert seen[1]["two_argument_error"] == ["DataParallelError", "rank 0: TwoArgumentError: 1/2"]
    assert seen[1]["agreed"] == ["OSError", "disk full"]
    assert seen[0]["agreed"] == ["DataParallelError", "upload failed on 1 rank(s): rank 1: OSError: disk full"]


# --- re-partitioning ZeRO optimizer state --------------------------------------------------------

Address = namedtuple("Address", ["numel", "start"])  # stands in for DeepSpeed's fragment_address


def _zero_states(flat: torch.Tensor, world: int, size: int, params: dict[str, int]) -> list[dict[str, Any]]:
    """DeepSpeed-shaped ZeRO 1/2 states of one flat group ``flat`` split over ``world``
    partitions of ``size`` elements (tail padding), AdamW-like state per element."""
    total = flat.numel()
    states = []
    for r in range(world):
        lean = flat[r * size : min((r + 1) * size, total)]
        padded = torch.zeros(size)
        padded[: lean.numel()] = lean
        mapping, offset = {}, 0
        for name, numel in params.items():
            begin, end = max(offset, r * size), min(offset + numel, (r + 1) * size)
            if begin < end:
                mapping[name] = Address(numel=end - begin, start=begin - r * size)
            offset += numel
        states.append(
            {
                "base_optimizer_state": {
                    "state": {0: {"step": torch.tensor(3.0), "exp_avg": padded * 10, "exp_avg_sq": padded * 100}},
                    "param_groups": [{"lr": 0.1, "params": [0]}],
                },
                "single_partition_of_fp32_groups": [lean.clone()],
                "group_paddings": [size - lean.numel()],
                "partition_count": [world],
                "param_slice_mappings": [mapping],
                "clip_grad": 1.0,
            }
        )
    return states


def test_reshard_moves_every_element_to_its_new_partition_and_back() -> None:
    flat = torch.arange(1.0, 12.0)  # F = 11 elements: p0 (5), p1 (6)
    params = {"p0": 5, "p1": 6}
    two = _zero_states(flat, world=2, size=6, params=params)  # DeepSpeed: ceil(11 / 4) * 4 / 2
    three = reshard_for(two, world=3, partition_sizes=[4])
    assert len(three) == 3
    assert [s["single_partition_of_fp32_groups"][0].tolist() for s in three] == [
        [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0],
    ]  # fmt: skip
    assert [s["group_paddings"] for s in three] == [[0], [0], [1]]
    assert [s["partition_count"] for s in three] == [[3]] * 3
    assert three[2]["base_optimizer_state"]["state"][0]["exp_avg"].tolist() == [90.0, 100.0, 110.0, 0.0]
    assert all(float(s["base_optimizer_state"]["state"][0]["step"]) == 3.0 for s in three)
    assert [dict(s["param_slice_mappings"][0]) for s in three] == [
        {"p0": Address(4, 0)}, {"p0": Address(1, 0), "p1": Address(3, 1)}, {"p1": Address(3, 0)},
    ]  # fmt: skip
    back = reshard_for(three, world=2, partition_sizes=[6])
    for old, new in zip(two, back):
        assert torch.equal(old["single_partition_of_fp32_groups"][0], new["single_partition_of_fp32_groups"][0])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(old["base_optimizer_state"]["state"][0][key], new["base_optimizer_state"]["state"][0][key])
        assert dict(old["param_slice_mappings"][0]) == dict(new["param_slice_mappings"][0])
        assert old["group_paddings"] == new["group_paddings"] and new["clip_grad"] == 1.0
    one = reshard_for(two, world=1, partition_sizes=[12])
    assert torch.equal(one[0]["single_partition_of_fp32_groups"][0], flat)


def test_reshard_refuses_what_it_cannot_partition() -> None:
    two = _zero_states(torch.arange(1.0, 12.0), world=2, size=6, params={"p0": 11})
    with pytest.raises(ReshardError, match="3 partitions of 3 elements cannot hold its 11"):
        reshard_for(two, world=3, partition_sizes=[3])
    with pytest.raises(ReshardError, match="lacks .*'single_partition_of_fp32_groups'"):
        reshard_for([{"base_optimizer_state": {}, "group_paddings": [0], "partition_count": [1]}], 1, [4])
    two[1]["base_optimizer_state"]["state"][0]["step"] = torch.tensor(4.0)
    with pytest.raises(ReshardError, match="'step' differs between ranks"):
        reshard_for(two, world=1, partition_sizes=[12])
    assert zero_world_size(["mp_rank_00_model_states.pt"]) is None
    names = ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert zero_world_size(names) == 2


def test_zero3_reshard_moves_every_element_to_its_new_pieces_and_back() -> None:
    """Parameters of 5 and 3 elements: at W = 2 pieces of 3 and 2 (rank 1's first piece
    padded), at W = 3 pieces of 2 and 1; back to 2 ranks and to 1, bit for bit."""
    whole = torch.arange(1.0, 9.0)  # p0 = 1..5, p1 = 6..8
    two = [torch.tensor([1.0, 2.0, 3.0, 6.0, 7.0]), torch.tensor([4.0, 5.0, 0.0, 8.0, 0.0])]
    three = repartition(two, [5, 3], 3)
    assert [t.tolist() for t in three] == [[1.0, 2.0, 6.0], [3.0, 4.0, 7.0], [5.0, 0.0, 8.0]]
    assert all(torch.equal(a, b) for a, b in zip(repartition(three, [5, 3], 2), two))
    assert torch.equal(repartition(two, [5, 3], 1)[0], whole)
    with pytest.raises(ReshardError, match="rank 1's flat group holds 4 elements"):
        repartition([two[0], two[1][:4]], [5, 3], 3)
    states = [
        {"partition_count": 2, "fp32_flat_groups": [flat], "loss_scaler": "same",
         "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": flat * 10}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]}}
        for flat in two
    ]  # fmt: skip
    one = reshard_zero3_states(states, [[5, 3]], 1)[0]
    assert one["partition_count"] == 1 and one["loss_scaler"] == "same"
    assert torch.equal(one["fp32_flat_groups"][0], whole)
    assert torch.equal(one["optimizer_state_dict"]["state"][0]["exp_avg"], whole * 10)
    assert float(one["optimizer_state_dict"]["state"][0]["step"]) == 3.0
    states[1]["optimizer_state_dict"]["state"][0]["step"] = torch.tensor(4.0)
    with pytest.raises(ReshardError, match="'step' differs between ranks"):
        reshard_zero3_states(states, [[5, 3]], 1)


def test_a_checkpoint_that_cannot_be_repartitioned_names_both_world_sizes(
    engine: Any, run_root: Any, tmp_path: Path
) -> None:
    """A checkpoint claiming two ranks whose rank-1 optimizer file is missing (files of
    ranks 0 and 2): loading it at world size 1 fails with both sizes in the message."""
    save_checkpoint(run_root, engine, CheckpointState(step=7, version=7), tmp_path / "work")
    manifest = read_manifest(run_root, 7)
    rank0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    stray = "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    directory = paths.checkpoint_dir(7)
    fs.download_file(run_root, paths.join(directory, rank0), tmp_path / "z0.pt")
    fs.upload_file(run_root, tmp_path / "z0.pt", paths.join(directory, stray))
    manifest["files"][stray] = manifest["files"][rank0]
    manifest["sha256"][stray] = manifest["sha256"][rank0]
    manifest["world_size"] = 2
    fs.delete(run_root, paths.join(directory, "_COMPLETE"))
    fs.put_if_absent(run_root, paths.join(directory, "_COMPLETE"), json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match=r"saved by 2 data-parallel ranks and cannot be loaded by 1: .*ranks \[0, 2\]"):
        load_checkpoint(run_root, engine, 7, tmp_path / "work")


def test_a_checkpoint_file_changed_after_the_save_is_refused_naming_it(
    engine: Any, run_root: Any, tmp_path: Path
) -> None:
    """Same size, other bytes: the manifest's sha256 catches what the size cannot."""
    save_checkpoint(run_root, engine, CheckpointState(step=3, version=3), tmp_path / "work")
    manifest = read_manifest(run_root, 3)
    assert manifest["format"] == 2 and set(manifest["sha256"]) == set(manifest["files"])
    name = "mp_rank_00_model_states.pt"
    relpath = paths.join(paths.checkpoint_dir(3), name)
    fs.download_file(run_root, relpath, tmp_path / "states.pt")
    raw = bytearray((tmp_path / "states.pt").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "states.pt").write_bytes(bytes(raw))
    fs.upload_file(run_root, tmp_path / "states.pt", relpath)
    with pytest.raises(CheckpointError, match=rf"{name}: sha256 .* manifest says .*changed after the checkpoint was saved"):
        load_checkpoint(run_root, engine, 3, tmp_path / "work")
    # A manifest that drops a file's sha256 is corrupt, not a checkpoint checked by size.
    del manifest["sha256"][name]
    directory = paths.checkpoint_dir(3)
    fs.delete(run_root, paths.join(directory, "_COMPLETE"))
    fs.put_if_absent(run_root, paths.join(directory, "_COMPLETE"), json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match=rf"corrupt checkpoint manifest \(no sha256 for \['{name}'\]\)"):
        read_manifest(run_root, 3)


# --- world size 2 against world size 1 ------------------------------------------------------------


def run_worker(world: int, out: Path, model: Path, *args: str, timeout_s: float = 240.0) -> dict[str, Any]:
    """Run dp_worker.py with ``world`` processes (a process group of its own, killed on
    timeout) and return what it saved."""
    prefix = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
    ]  # fmt: skip
    command = [*prefix, str(WORKER), "--model", str(model), "--out", str(out), "--work", str(out.parent / "work"), *args]
    log = out.with_suffix(".log")
    # Blocks of 64 KiB and more mmap'd and unmapped when freed: the resident memory a
    # publish measures (dp_worker.measured_publish) follows the tensors it allocates.
    env = {**trainer_env(TrainerLaunch(Path("unused.yaml"), log)), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    process = spawn_session(command, log, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        code = kill_group(process, grace_s=5.0) if process.poll() is None else process.returncode
    assert code == 0, f"dp_worker (world size {world}) exited with {code}:\n{read_log_tail(log, 40)}"
    return torch.load(out, weights_only=False)


def runs_at_both_world_sizes(stage: int, base: Path, model: Path, *extra: str) -> dict[int, Any]:
    """Steps A and B (and one SFT update) at world sizes 1 and 2 with ZeRO ``stage``, each
    saving checkpoint 1 after step A into its own run root and publishing its weights
    before and after training into ``base/pub-ws{world}``."""
    runs = {}
    for world in (1, 2):
        store, publish = base / f"store-ws{world}", base / f"pub-ws{world}"
        out = base / f"ws{world}" / "out.pt"
        args = ("--zero", str(stage), "--save-root", str(store), "--publish", str(publish), *extra)
        runs[world] = run_worker(world, out, model, *args)
        runs[world].update(store=store, base=base, published=publish)
    return runs


@pytest.fixture(scope="module")
def zero2_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return runs_at_both_world_sizes(2, tmp_path_factory.mktemp("dp"), tiny_model_dir)


@pytest.fixture(scope="module")
def zero3_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """ZeRO 3 with every parameter partitioned, and logits in chunks of 16 positions: the
    ranks' chunk counts differ, and the head's one call per pass keeps their gathers paired."""
    return runs_at_both_world_sizes(3, tmp_path_factory.mktemp("dp3"), tiny_model_dir, "--chunk", "16")


def _flat(dump: dict[str, Any], key: str) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in dump[key].values()])


def assert_same_update(one: dict[str, Any], two: dict[str, Any]) -> None:
    """Tolerances (float32, same data, different summation order and micro-batch packing):

    - AdamW's moments, exp_avg = sum_k c_k g_k and exp_avg_sq (no gradient clipping in the
      worker, so they carry the gradients' scale): within 1e-4 of their largest magnitude.
      Measured: 5.7e-6 and 3.7e-6 of it. A wrong normalisation scales a whole gradient
      (relative error ~1), a sample trained twice or not at all moves many coordinates by
      ~1/12 of the gradient.
    - parameters: every coordinate within 0.05 lr, and fewer than 1 in 10^4 coordinates
      off by more than 10^-3 lr (measured: at most 2.3e-5 = 0.023 lr, and 4 of 410752
      coordinates above 1e-6). Adam's early updates are lr * m / (sqrt(v) + 1e-8): where a
      coordinate's gradient is near 1e-8 at one update, summation-order rounding of the
      gradient changes its update by a fraction of lr; a real difference in the data moves
      most coordinates by about lr.
    """
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = _flat(one, key), _flat(two, key)
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max()), key
    a, b = _flat(one, "params"), _flat(two, "params")
    diff = (a - b).abs()
    assert float(diff.max()) < 0.05 * LR
    assert int((diff > 1e-3 * LR).sum()) < 1e-4 * diff.numel()
    assert one["adam_step"] == two["adam_step"]


def check_same_steps(runs: dict[int, Any]) -> None:
    one, two = runs[1], runs[2]
    assert (one["world"], two["world"]) == (1, 2)
    for step in ("a", "b"):
        assert_same_update(one[step], two[step])
        m1, m2 = one[step]["metrics"], two[step]["metrics"]
        # rank 0's metrics describe the whole step, not its own share
        for key in ("output_tokens", "sequence_tokens", "trained_samples", "optimizer_updates"):
            assert m1[key] == m2[key], key
        for key in ("loss", "grad_norm", "clip_fraction", "behav_weight_mean", "approx_kl"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7, nan_ok=True), key  # grad_norm: NaN at ZeRO 0
        assert m1["rank_token_imbalance"] == 1.0 and 1.0 <= m2["rank_token_imbalance"] < 1.1
        assert m1["filler_micro_batches"] == 0
    assert one["a"]["adam_step"] == 2.0  # two mini-batches: two updates per step
    assert_same_update(one["sft"], two["sft"])
    assert two["sft"]["metrics"]["sft_loss"] == pytest.approx(one["sft"]["metrics"]["sft_loss"], rel=1e-5)


def check_resume_at_the_other_world_size(runs: dict[int, Any], model: Path, stage: int) -> None:
    """Checkpoint 1 of world size 1 loaded by 2 processes, and that of world size 2 by one:
    the loaded parameters and optimizer state equal the saved ones exactly, and step B from
    there is the step B of the run that never stopped."""
    base = runs[1]["base"]
    for saved, loading in ((1, 2), (2, 1)):
        store = runs[saved]["store"]
        manifest = read_manifest(open_root(str(store)), 1)
        assert manifest["world_size"] == saved
        assert zero_world_size(list(manifest["files"])) == (None if stage == 0 else saved)
        resumed = run_worker(loading, base / f"ws{saved}-to-ws{loading}" / "out.pt", model, "--zero", str(stage),
                             "--load-root", str(store))  # fmt: skip
        assert resumed["world"] == loading and resumed["loaded_state"] == {"step": 1, "version": 1}
        before = runs[saved]["a"]
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_flat(resumed["loaded"], key), _flat(before, key)), key
        assert resumed["loaded"]["adam_step"] == before["adam_step"] == 2.0
        assert resumed["loaded"]["lr"] == before["lr"]
        assert_same_update(runs[saved]["b"], resumed["b"])


def test_world_size_two_trains_the_same_update_as_world_size_one_rl_and_sft(zero2_runs: dict[int, Any]) -> None:
    check_same_steps(zero2_runs)


def test_checkpoints_resume_at_another_world_size(zero2_runs: dict[int, Any], tiny_model_dir: Path) -> None:
    check_resume_at_the_other_world_size(zero2_runs, tiny_model_dir, stage=2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_other_zero_stages_train_alike_and_resume_at_another_world_size(
    stage: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """ZeRO 0 keeps the optimizer state whole in the model-states file, which loads at any
    world size as it is: resumed both ways. ZeRO 1 partitions it like ZeRO 2, in the same
    files, re-partitioned on load by the same code that
    :func:`test_checkpoints_resume_at_another_world_size` resumes both ways: trained alike only."""
    runs = runs_at_both_world_sizes(stage, tmp_path, tiny_model_dir)
    check_same_steps(runs)
    if stage == 0:
        check_resume_at_the_other_world_size(runs, tiny_model_dir, stage)


# --- ZeRO stage 3 ----------------------------------------------------------------------------------


def test_zero3_at_world_size_two_trains_the_same_update_as_world_size_one(
    zero3_runs: dict[int, Any], zero2_runs: dict[int, Any]
) -> None:
    """Against ZeRO 3 at one rank, and against one rank of ZeRO 2 (which at one rank runs
    ZeRO 1's optimizer on whole parameters), within the same tolerances."""
    check_same_steps(zero3_runs)
    for step in ("a", "b", "sft"):
        assert_same_update(zero2_runs[1][step], zero3_runs[2][step])
    assert zero3_runs[2]["b"]["metrics"]["loss"] == pytest.approx(zero2_runs[1]["b"]["metrics"]["loss"], rel=1e-5)
    # Forward passes are collectives under ZeRO 3: rank 1, with one micro-batch against rank
    # 0's several, runs filler passes, and rank 0's log-probs are those of one rank.
    one, two = zero3_runs[1]["uneven_proximal"], zero3_runs[2]["uneven_proximal"]
    assert sorted(two) == sorted(one) and len(one) > 4
    for index, values in one.items():
        assert float((values - two[index]).abs().max()) < 1e-5, index


def test_zero3_publishes_what_stage_two_publishes_gathering_one_parameter_at_a_time(
    zero3_runs: dict[int, Any], zero2_runs: dict[int, Any], tiny_model_dir: Path
) -> None:
    """The initial weights' directory is byte for byte ZeRO 2's (``save_pretrained``'s
    safetensors layout included: the source checkpoint's names, dtypes, shapes and tied
    lm_head left out); the trained weights are what the worker dumped. Memory of the ZeRO 3
    publish at world size 2 (rank 0, which writes): at most one parameter gathered at a
    time, and a peak resident memory over the publish's start below half the model, where
    a second copy of the model adds the model's size (gathering everything at once
    measured 2.6-3.1 MB over its start on this 1.6 MB model; one at a time 0.2-0.4 MB)."""
    stage2 = zero2_runs[1]["published"] / "initial"
    names = sorted(p.name for p in stage2.iterdir())
    assert "model.safetensors" in names and "lm_head.weight" not in load_file(stage2 / "model.safetensors")
    for world, run in zero3_runs.items():
        initial = run["published"] / "initial"
        assert sorted(p.name for p in initial.iterdir()) == names, world
        for name in names:
            assert (initial / name).read_bytes() == (stage2 / name).read_bytes(), (world, name)
        final = load_file(run["published"] / "final" / "model.safetensors")
        assert set(final) == set(run["sft"]["params"])  # named_parameters() leaves the tied copy out too
        assert all(torch.equal(tensor, run["sft"]["params"][name]) for name, tensor in final.items()), world

    memory = zero3_runs[2]["publish"]
    assert memory["model_bytes"] == (stage2 / "model.safetensors").stat().st_size - _header_bytes(stage2 / "model.safetensors")
    assert 0 < memory["peak_gathered_bytes"] <= memory["largest_param_bytes"] < memory["model_bytes"] / 8
    assert memory["rss_extra_bytes"] < memory["model_bytes"] / 2, memory


def _header_bytes(path: Path) -> int:
    """The length of a safetensors file's header (8-byte size + JSON)."""
    with open(path, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def test_zero3_checkpoints_resume_at_another_world_size(zero3_runs: dict[int, Any], tiny_model_dir: Path) -> None:
    """Bit for bit after re-partitioning the stage 3 files (zero3_reshard), both ways."""
    check_resume_at_the_other_world_size(zero3_runs, tiny_model_dir, stage=3)
