"""``asyncrl bench trainer``: dynamic micro-batching versus fixed-count padded micro-batches.

Both variants run the same PPO update (DeepSpeed engine, forward + backward + optimizer
step) on the same long-tailed batch: ``packed`` (first-fit-decreasing packing under a token
budget, no padding) and ``fixed`` (groups of ``fixed_count`` sequences, right-padded).
Reported per variant: micro-batches, real tokens, positions computed, packing efficiency
(:func:`packing_efficiency`), seconds per update and trained tokens/s. A second table times
a whole decoupled-PPO step with log pi_prox from a separate forward pass (``separate``) and
from the update's own (``reused``, what :func:`~asyncrl.tasks.trainer.step.run_rl_step` does
when :func:`~asyncrl.tasks.trainer.step.reuses_update_forward` holds).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.algo.packing import fixed_count_micro_batches, get_packer, packing_efficiency

if TYPE_CHECKING:
    from asyncrl.tasks.trainer.engine import TrainEngine


@dataclass(frozen=True)
class TrainerBenchSettings:
    sequences: int = 64
    min_len: int = 16
    max_len: int = 512
    alpha: float = 1.2
    budget: int = 1024
    fixed_count: int = 8
    repeats: int = 2
    prompt_len: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.min_len <= self.max_len <= self.budget:
            raise ValueError(
                f"bench: need 2 <= min_len <= max_len <= budget, got {self.min_len}, {self.max_len}, {self.budget}"
            )
        if self.prompt_len >= self.min_len:
            raise ValueError(f"bench: prompt_len {self.prompt_len} must be below min_len {self.min_len}")
        for name in ("sequences", "fixed_count", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class BenchRow:
    variant: str
    micro_batches: int
    real_tokens: int
    computed_positions: int
    packing_efficiency: float
    seconds_per_update: float
    tokens_per_s: float


def long_tailed_lengths(n: int, min_len: int, max_len: int, seed: int, alpha: float = 1.2) -> list[int]:
    """Pareto-tailed sequence lengths, like reasoning-model generations.

        L_i = min(max_len, floor(min_len * U_i ** (-1 / alpha))),  U_i ~ Uniform(0, 1]

    so P(L > x) = (min_len / x) ** alpha up to the cap; deterministic in ``seed``.
    """
    rng = random.Random(seed)
    return [min(max_len, math.floor(min_len * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(n)]


def _items(settings: TrainerBenchSettings, vocab_size: int) -> list[Any]:
    import torch

    from asyncrl.tasks.trainer.batch import TokenSequence
    from asyncrl.tasks.trainer.step_data import TrainItem

    rng = random.Random(settings.seed + 1)
    items = []
    lengths = long_tailed_lengths(settings.sequences, settings.min_len, settings.max_len, settings.seed, settings.alpha)
    for k, length in enumerate(lengths):
        prompt = tuple(rng.randrange(vocab_size) for _ in range(settings.prompt_len))
        output = tuple(rng.randrange(vocab_size) for _ in range(length - settings.prompt_len))
        behav = torch.tensor([-rng.uniform(0.5, 6.0) for _ in output], dtype=torch.float32)
        items.append(TrainItem(TokenSequence(prompt, output), behav, 1.0 if k % 2 else -1.0, group=k))
    return items


def timed_row(
    name: str, step: Callable[[], object], lengths: list[int], groups: list[list[int]], batches: list[Any],
    budget: int | None, repeats: int,
) -> BenchRow:
    """Time ``repeats`` calls of ``step`` (after one warm-up call) over ``batches``, the
    micro-batches ``groups`` of sequences of ``lengths``; seconds per call and real tokens/s."""
    step()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    seconds = (time.perf_counter() - started) / repeats
    return BenchRow(
        variant=name,
        micro_batches=len(batches),
        real_tokens=sum(lengths),
        computed_positions=sum(b.slots for b in batches),
        packing_efficiency=packing_efficiency(lengths, groups, budget),
        seconds_per_update=seconds,
        tokens_per_s=sum(lengths) / seconds,
    )


def run_trainer_bench(engine: TrainEngine, settings: TrainerBenchSettings) -> list[BenchRow]:
    """Time ``repeats`` PPO updates per variant (after one warm-up update each)."""
    from asyncrl.tasks.trainer.batch import build_micro_batches
    from asyncrl.tasks.trainer.step import ppo_update
    from asyncrl.tasks.trainer.step_figures import UpdateStats
    from asyncrl.tasks.trainer.rl_settings import RLSettings

    items = _items(settings, engine.vocab_size)
    sequences = [item.sequence for item in items]
    lengths = [len(s) for s in sequences]
    rl = RLSettings(objective="standard", micro_batch_tokens=settings.budget)
    variants = {
        "packed": (get_packer("ffd")(lengths, settings.budget), "packed", settings.budget),
        "fixed": (fixed_count_micro_batches(lengths, settings.fixed_count), "padded", None),
    }
    rows = []
    for name, (groups, layout, budget) in variants.items():
        batches = build_micro_batches(sequences, groups, layout)  # type: ignore[arg-type]
        def update() -> None:
            ppo_update(engine, items, None, batches, rl, UpdateStats())  # noqa: B023 - timed at once

        rows.append(timed_row(name, update, lengths, groups, batches, budget, settings.repeats))
    return rows


def run_proximal_bench(engine: TrainEngine, settings: TrainerBenchSettings) -> list[BenchRow]:
    """Time ``repeats`` decoupled steps of one mini-batch (packed) per way of getting log
    pi_prox (after one warm-up step each): ``separate`` (:func:`compute_proximal`, then the
    update) and ``reused`` (the update's own forward pass)."""
    from asyncrl.tasks.trainer.batch import build_micro_batches
    from asyncrl.tasks.trainer.step import compute_proximal, ppo_update
    from asyncrl.tasks.trainer.step_figures import UpdateStats
    from asyncrl.tasks.trainer.rl_settings import RLSettings

    items = _items(settings, engine.vocab_size)
    sequences = [item.sequence for item in items]
    lengths = [len(s) for s in sequences]
    groups = get_packer("ffd")(lengths, settings.budget)
    batches = build_micro_batches(sequences, groups, "packed")
    rl = RLSettings(objective="decoupled", micro_batch_tokens=settings.budget)
    indices = list(range(len(items)))

    def separate() -> None:
        ppo_update(engine, items, compute_proximal(engine, items, indices, rl), batches, rl, UpdateStats())

    def reused() -> None:
        ppo_update(engine, items, None, batches, rl, UpdateStats(), proximal_from_forward={})

    return [
        timed_row(name, step, lengths, groups, batches, settings.budget, settings.repeats)
        for name, step in (("separate", separate), ("reused", reused))
    ]


def format_table(rows: list[BenchRow]) -> str:
    header = f"{'variant':<8} {'micro':>6} {'tokens':>8} {'computed':>9} {'pack eff':>9} {'s/update':>9} {'tokens/s':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.variant:<8} {r.micro_batches:>6} {r.real_tokens:>8} {r.computed_positions:>9} "
            f"{r.packing_efficiency:>9.3f} {r.seconds_per_update:>9.3f} {r.tokens_per_s:>10.0f}"
        )
    return "\n".join(lines)


def cmd_bench_trainer(args: argparse.Namespace) -> int:
    from asyncrl.configs.trainer import OptimizerConfig
    from asyncrl.tasks.model.tiny import write_tiny_model
    from asyncrl.tasks.trainer.engine import EngineSettings, build_engine

    settings = TrainerBenchSettings(
        sequences=args.sequences,
        min_len=args.min_len,
        max_len=args.max_len,
        budget=args.budget,
        fixed_count=args.fixed_count,
        repeats=args.repeats,
        seed=args.seed,
    )
    # A generated tiny model lives only until the engine has loaded it.
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-trainer-") as scratch:
        model_dir = Path(args.model) if args.model else write_tiny_model(Path(scratch) / "tiny")
        engine = build_engine(model_dir, EngineSettings(optimizer=OptimizerConfig(lr=1e-5), zero_stage=args.zero_stage))
    rows = run_trainer_bench(engine, settings)
    print(format_table(rows))
    packed, fixed = rows
    speedup = packed.tokens_per_s / fixed.tokens_per_s
    print(f"dynamic micro-batching: {speedup:.2f}x the tokens/s of fixed-count micro-batches")
    print("\ndecoupled PPO step, one mini-batch, log pi_prox from:")
    proximal_rows = run_proximal_bench(engine, settings)
    print(format_table(proximal_rows).replace("s/update", "  s/step"))
    separate, reused = proximal_rows
    print(f"the update's own forward pass: {separate.seconds_per_update / reused.seconds_per_update:.2f}x the steps/s "
          "of a separate proximal pass")
    result = {"settings": asdict(settings), "model": args.model or "tiny (generated)", "rows": [asdict(r) for r in rows], "speedup": speedup,
              "proximal_rows": [asdict(r) for r in proximal_rows]}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
