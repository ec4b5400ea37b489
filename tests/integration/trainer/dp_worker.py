"""One data-parallel trainer process of the tests in test_data_parallel.py (not a test module).

Run alone (world size 1) or under ``python -m torch.distributed.run --nproc-per-node=W``.
Builds the DeepSpeed engine on ``--model``, then either

- trains step A on a fixed batch, dumps the state ("a"), optionally saves checkpoint 1 to
  ``--save-root``, trains step B and dumps again ("b"); or
- with ``--load-root``: loads checkpoint 1 from that run root (saved at any world size),
  dumps the loaded state ("loaded"), trains step B and dumps again ("b");

then makes one SFT update on a third batch and dumps ("sft"), and computes log pi_prox of a
fourth batch with an uneven split (rank 0 all of it, the others one sample:
"uneven_proximal", rank 0's values). With ``--publish DIR`` it also publishes the weights
(``save_hf_weights``, every rank) to ``DIR/initial`` right after building and to
``DIR/final`` at the end, measuring the memory of the second publish ("publish"; warm:
the first one's imports and caches are not the model's).

A dump holds every parameter (gathered over the ZeRO 3 partitions), AdamW's full
``exp_avg`` / ``exp_avg_sq`` per parameter (gathered over the ZeRO partitions with
DeepSpeed's ``safe_get_full_optimizer_state``), the optimizer's step count, and the step's
metrics (those rank 0 logs). Rank 0 writes everything to ``--out`` with ``torch.save``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.bench.process_memory import own_memory, reset_own_peak
from asyncrl.configs.trainer import OptimizerConfig
from asyncrl.storage.fs import open_root
from asyncrl.storage.schema import Sample
from asyncrl.tasks.trainer.batch import TokenSequence
from asyncrl.tasks.trainer.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from asyncrl.tasks.trainer.engine import EngineSettings, TrainEngine, build_engine, save_hf_weights
from asyncrl.tasks.trainer.sft import SFTSettings, sft_update
from asyncrl.tasks.trainer.step import compute_proximal, prepare_step, run_rl_step
from asyncrl.tasks.trainer.rl_settings import RLSettings

LR = 1e-3
SETTINGS = RLSettings(micro_batch_tokens=64, mini_batches=2, behav_weight_cap=5.0)


def batch(seed: int, groups: int = 4, per_group: int = 3) -> list[list[Sample]]:
    """Prompt groups with varied prompt (3-12) and output (2-40) lengths, so micro-batch
    counts and the token-balanced split differ between ranks; behaviour log-probs near
    the tiny model's (about -log 320) so most tokens pass the behaviour-weight cap."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(32, 127) for _ in range(rng.randint(3, 12))]
        group = []
        for k in range(per_group):
            n = rng.randint(2, 40)
            group.append(
                Sample(
                    prompt_id=f"p{seed}-{g}",
                    group_id=f"g{seed}-{g}",
                    prompt_token_ids=prompt,
                    output_token_ids=[rng.randrange(32, 127) for _ in range(n)],
                    behaviour_logprobs=[-5.8 + rng.uniform(-0.3, 0.3) for _ in range(n)],
                    token_versions=[0] * n,
                    reward=float(rng.random() < 0.5) if k else 1.0,
                    finish_reason="stop",
                    submit_time=0.0,
                    finish_time=1.0,
                )
            )
        out.append(group)
    return out


def dump(engine: TrainEngine, metrics: dict[str, float] | None) -> dict[str, Any]:
    """Parameters, full AdamW state per parameter, the step count (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage3 = engine.parameters_partitioned
    zero = stage3 or hasattr(engine.ds.optimizer, "_lazy_init_hp_params_optimizer_state")
    if zero and not stage3:
        # DeepSpeed links the per-parameter views of the optimizer state at the first step;
        # an engine that only loaded a checkpoint has none yet.
        engine.ds.optimizer._lazy_init_hp_params_optimizer_state()
    base_optimizer = engine.ds.optimizer.optimizer if zero else engine.ds.optimizer
    params, exp_avg, exp_avg_sq = {}, {}, {}
    for name, param in engine.module.named_parameters():
        # float32 training: ZeRO 3's fp32 master copy is the module's parameter
        params[name] = (safe_get_full_fp32_param(param) if stage3 else param).detach().clone().cpu()
        if zero:
            exp_avg[name] = safe_get_full_optimizer_state(param, "exp_avg")
            exp_avg_sq[name] = safe_get_full_optimizer_state(param, "exp_avg_sq")
        else:  # ZeRO stage 0: torch's AdamW on the module's parameters, whole on every rank
            exp_avg[name] = base_optimizer.state[param]["exp_avg"]
            exp_avg_sq[name] = base_optimizer.state[param]["exp_avg_sq"]
    # The live state, not state_dict(): ZeRO 3 detaches its base optimizer's param groups between steps.
    states = [state for state in base_optimizer.state.values() if "step" in state]
    step = float(states[0]["step"]) if states else 0.0
    return {
        "params": params,
        "exp_avg": {k: None if v is None else v.detach().clone().cpu() for k, v in exp_avg.items()},
        "exp_avg_sq": {k: None if v is None else v.detach().clone().cpu() for k, v in exp_avg_sq.items()},
        "adam_step": step,
        "lr": engine.learning_rate(),
        "metrics": metrics,
    }


def measured_publish(engine: TrainEngine, out: Path) -> dict[str, int]:
    """``save_hf_weights`` to ``out`` (collective), measured on this rank:

    - peak_gathered_bytes: the most parameter bytes materialised (whole, not ZeRO-3
      persistent) at the entry of any ``deepspeed.zero.GatheredParameters`` context;
    - rss_extra_bytes: peak resident memory during the publish (VmHWM, reset first through
      ``/proc/self/clear_refs``) minus the resident memory before it;
    - model_bytes, largest_param_bytes: the whole model's and its largest parameter's bytes.
    """
    import math

    import deepspeed

    module = engine.module
    whole = {id(p): math.prod(getattr(p, "ds_shape", p.shape)) * p.element_size() for p in module.parameters()}
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id") and not p.ds_persist]
    peak = [0]
    original = deepspeed.zero.GatheredParameters

    class Measured(original):  # type: ignore[misc,valid-type]
        def __enter__(self) -> None:
            super().__enter__()
            peak[0] = max(peak[0], sum(whole[id(p)] for p in partitioned if p.data.numel() > 0))

    deepspeed.zero.GatheredParameters = Measured
    try:
        assert reset_own_peak(), "VmHWM := VmRSS through /proc/self/clear_refs"
        before = own_memory().rss_bytes
        save_hf_weights(engine, out)
        high = own_memory().hwm_bytes
    finally:
        deepspeed.zero.GatheredParameters = original
    return {
        "peak_gathered_bytes": peak[0],
        "rss_extra_bytes": high - before,
        "model_bytes": sum(whole.values()),
        "largest_param_bytes": max(whole.values()),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--save-root", default=None)
    parser.add_argument("--load-root", default=None)
    parser.add_argument("--chunk", type=int, default=None, help="logit_chunk_tokens")
    parser.add_argument("--publish", type=Path, default=None)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    settings = EngineSettings(
        optimizer=OptimizerConfig(lr=LR, grad_clip=None),
        zero_stage=args.zero,
        logit_chunk_tokens=args.chunk,
        zero3_persistence_threshold=0,  # ZeRO 3: partition every parameter of the tiny model
    )
    engine = build_engine(args.model, settings)
    work = args.work  # one node: its ranks share the work directory, as in the trainer
    result: dict[str, Any] = {"world": engine.world_size, "zero": args.zero}
    if args.publish:
        save_hf_weights(engine, args.publish / "initial")
    if args.load_root:
        state = load_checkpoint(open_root(args.load_root), engine, 1, work)
        result["loaded_state"] = vars(state)
        result["loaded"] = dump(engine, None)
    else:
        step_a = run_rl_step(engine, batch(seed=1), SETTINGS, trainer_updates=0)
        result["a"] = dump(engine, step_a.metrics())
        if args.save_root:
            save_checkpoint(open_root(args.save_root), engine, CheckpointState(step=1, version=1), work)
    step_b = run_rl_step(engine, batch(seed=2), SETTINGS, trainer_updates=1)
    result["b"] = dump(engine, step_b.metrics())
    # One SFT update (the warm-start mode) on the prompts and outputs of another batch.
    sequences = [TokenSequence(tuple(s.prompt_token_ids), tuple(s.output_token_ids)) for g in batch(seed=3) for s in g]
    sft_loss = sft_update(engine, sequences, SFTSettings(steps=1, batch_size=len(sequences), micro_batch_tokens=64))
    result["sft"] = dump(engine, {"sft_loss": sft_loss})
    # Rank 0 runs several micro-batches, the others one: under ZeRO 3 they run filler passes.
    items = prepare_step(batch(seed=4), SETTINGS, trainer_updates=3).items
    indices = list(range(len(items))) if engine.rank == 0 else [0]
    result["uneven_proximal"] = compute_proximal(engine, items, indices, SETTINGS)
    if args.publish:
        result["publish"] = measured_publish(engine, args.publish / "final")
    result["seconds"] = time.perf_counter() - started
    if engine.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
