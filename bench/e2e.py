"""``asyncrl bench e2e``: the speed-up of asynchronous RL, end to end.

The same workload runs through the real RL run (:func:`~asyncrl.tasks.launch.rl.train_run`)
once synchronously (eta = 0) and with every eta > 0 in every interrupt mode, the rollout
server and the trainer pinned to separate CPUs or placed on GPUs. Per configuration it
reports the RL-phase wall time, trained tokens/s, the speed-up over eta = 0, rollout
utilisation, weight-sync stall and staleness, and compares the speed-up with the ideal
overlap bound of T_gen and T_train (formulas in the functions that compute them).
The workload is made reproducible: each prompt's budget follows its reference solution and
samples are generated to it with EOS ignored, so every run sees the same long-tailed
lengths and the same prompts in the same order. Details: ``docs/internals/bench.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.system.process_group import usable_cpus
from asyncrl.configs.cpus import check_cpu_cores
from asyncrl.tasks.inference.samples import INTERRUPT_MODES, InterruptMode

if TYPE_CHECKING:
    from asyncrl.configs.run_config import RunConfig
    from asyncrl.tasks.inference.server import RolloutServerConfig
    from asyncrl.tasks.launch.devices import Machine

STALENESS_COUNT_PREFIX = "staleness/count_"


def split_cores() -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(rollout CPUs, trainer CPUs): the first half of this process's usable CPUs (rounded
    down) and the rest, e.g. ((0,), (1,)) on 2 CPUs; (None, None), no pinning, on 1 CPU."""
    cpus = sorted(usable_cpus())
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return tuple(cpus[:half]), tuple(cpus[half:])


WORKLOADS: dict[str, dict[str, float]] = {
    "balanced": {},
    "generation-bound": {"max_new_tokens": 1536, "micro_batch_tokens": 2048},
    "mixed": {"code_share": 0.5, "max_prompt_tokens": 96},
}
"""Named workloads: settings they change from the defaults. ``balanced`` (the default):
generation and training take about as long;
``generation-bound``: four times longer outputs, so generation is the bottleneck and the
rollout server's utilisation can be judged; ``mixed``: half the prompts are synthetic code
problems (a weighted mixture file of the two tasks), every code answer run against its tests
in the sandbox (``reward.code.extract: whole``), so the reward wait per step can be judged.
Explicit options override a workload's values."""


@dataclass(frozen=True)
class E2EBenchSettings:
    """The sweep and its workload. The defaults: 9 runs of 16 steps; each run's start-up and
    shutdown are outside its RL-phase wall (:func:`rl_wall_s`)."""

    workload: str = "balanced"
    """Name of the workload (:data:`WORKLOADS`); recorded with the result."""
    etas: tuple[int, ...] = (0, 1, 2, 4, 8)
    """Staleness bounds; must include 0 (the synchronous baseline, run once)."""
    modes: tuple[InterruptMode, ...] = INTERRUPT_MODES
    """Interrupt modes of every eta > 0 (eta = 0 interrupts nothing: it runs with the first)."""
    steps: int = 16
    batch_groups: int = 4
    n_samples: int = 4
    max_new_tokens: int = 384
    """Budget of the longest reference solution; shorter ones get proportionally less."""
    max_prompt_tokens: int = 64
    micro_batch_tokens: int = 1024
    n_prompts: int = 256
    code_share: float = 0.0
    """Weight of the synthetic code task in the prompt mixture (0: arithmetic only)."""
    seed: int = 0
    rollout_cores: tuple[int, ...] | None = field(default_factory=lambda: split_cores()[0])
    trainer_cores: tuple[int, ...] | None = field(default_factory=lambda: split_cores()[1])
    gpus: tuple[int, ...] | None = None
    """GPU ids (as this process sees them) of the rollout server and the trainer: one id, which
    they share (``placement.share_devices``, the server taking its share of the memory, as in
    ``configs/gpu-check.yaml``), or two, (server, trainer). None: CPUs only. With GPUs no CPU
    is pinned: ``rollout_cores`` and ``trainer_cores`` must be None."""
    kv_cache_gib: float = 1.0
    max_groups_in_flight: int | None = None
    """``rollout.max_groups_in_flight`` of every run (None: the staleness gate alone)."""
    work_dir: Path | None = None
    """Model, prompt file, run roots and logs; None = a new temporary directory."""
    json_path: Path | None = None
    """Write the result here as JSON (after every configuration, so a long sweep keeps what it measured)."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: must be one of {list(WORKLOADS)}, got {self.workload!r}")
        if not self.etas or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in self.etas):
            raise ValueError(f"etas: must be ints >= 0, got {self.etas!r}")
        if 0 not in self.etas:
            raise ValueError(f"etas: must include 0, the synchronous baseline of every speed-up; got {self.etas}")
        if len(set(self.etas)) != len(self.etas):
            raise ValueError(f"etas: a value repeats: {self.etas}")
        if not self.modes or any(m not in INTERRUPT_MODES for m in self.modes) or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes: must be distinct values of {list(INTERRUPT_MODES)}, got {self.modes!r}")
        if self.max_groups_in_flight is not None and self.max_groups_in_flight < 1:
            raise ValueError(f"max_groups_in_flight: must be >= 1 or None, got {self.max_groups_in_flight}")
        for name in ("steps", "batch_groups", "n_samples", "max_new_tokens", "max_prompt_tokens", "n_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.code_share < 1.0:
            raise ValueError(f"code_share: must be in [0, 1), got {self.code_share}")
        if self.micro_batch_tokens < self.max_prompt_tokens + self.max_new_tokens:
            raise ValueError(
                f"micro_batch_tokens: {self.micro_batch_tokens} is below max_prompt_tokens + "
                f"max_new_tokens = {self.max_prompt_tokens + self.max_new_tokens}"
            )
        if self.gpus is not None:
            ids_ok = all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in self.gpus)
            if not (1 <= len(self.gpus) <= 2 and ids_ok):
                raise ValueError(f"gpus: one GPU id (shared) or two (server, trainer), ints >= 0; got {self.gpus!r}")
            if self.rollout_cores is not None or self.trainer_cores is not None:
                raise ValueError(
                    "gpus: the rollout server and the trainer run on GPUs; give no rollout_cores or trainer_cores "
                    f"(CPU pinning) with them, got {self.rollout_cores!r} and {self.trainer_cores!r}"
                )
        rollout = check_cpu_cores(self.rollout_cores, "rollout_cores")
        trainer = check_cpu_cores(self.trainer_cores, "trainer_cores")
        shared = sorted(set(rollout or ()) & set(trainer or ()))
        if shared:
            raise ValueError(
                f"rollout_cores, trainer_cores: both hold CPU {', '.join(map(str, shared))}; "
                "pin them to separate CPUs (or pin neither)"
            )
        object.__setattr__(self, "rollout_cores", rollout)
        object.__setattr__(self, "trainer_cores", trainer)

    def placement(self) -> dict[str, dict[str, Any]]:
        """The run config's placement of the rollout server and the trainer (sections
        ``rollout``, ``trainer``, ``placement``): GPU device ids with ``gpus``, else CPU pinning."""
        if self.gpus is None:
            return {
                "rollout": {"cpu_cores": None if self.rollout_cores is None else list(self.rollout_cores)},
                "trainer": {"cpu_cores": None if self.trainer_cores is None else list(self.trainer_cores)},
                "placement": {},
            }
        server, trainer = self.gpus[0], self.gpus[-1]
        return {
            "rollout": {"devices": [[server]]},
            "trainer": {"devices": [trainer]},
            "placement": {"share_devices": server == trainer},
        }

    def sweep(self) -> list[tuple[int, InterruptMode]]:
        """(eta, mode) of every run: eta = 0 once, first; then each eta > 0 in each mode."""
        return [(0, self.modes[0])] + [(eta, mode) for eta in sorted(self.etas) if eta > 0 for mode in self.modes]

    def concurrency(self, eta: int) -> int:
        """Most samples a run keeps in flight: c = min((eta + 1) * B, G) * n (the staleness gate
        admits at most (i + eta + 1) * B groups while the servers hold version i; G =
        ``max_groups_in_flight``, no cap when None)."""
        groups = (eta + 1) * self.batch_groups
        if self.max_groups_in_flight is not None:
            groups = min(groups, self.max_groups_in_flight)
        return groups * self.n_samples


@dataclass(frozen=True)
class Workload:
    """What every run generates: group k's prompt token ids and budget, k < steps * B."""

    model_dir: Path
    train_path: Path
    prompts: tuple[tuple[int, ...], ...]
    budgets: tuple[int, ...]
    code_groups: int = 0
    """Groups of the run whose prompt is a code problem (the ``mixed`` workload)."""

    def batches(self, batch_groups: int) -> list[range]:
        """Group indices of each training step's batch, in admission order."""
        return [range(start, start + batch_groups) for start in range(0, len(self.prompts), batch_groups)]


# ----- the figures (plain functions of measured numbers) -----


def solution_budgets(solution_tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """Per-prompt output budgets that follow the reference solutions' lengths L_i:

        budget_i = max(1, ceil(max_new_tokens * L_i / max_j L_j))

    so the longest solution gets ``max_new_tokens`` and the budgets keep the task's tail."""
    if not solution_tokens:
        return []
    longest = max(max(solution_tokens), 1)
    return [max(1, math.ceil(max_new_tokens * length / longest)) for length in solution_tokens]


def rl_wall_s(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """W = max over steps of the step's metrics ``time`` (Unix, written once the step's
    weights are published) - ``ready_at`` (every rollout server healthy, scheduler started)."""
    if not step_metrics:
        raise ValueError("rl_wall_s: no step was trained")
    return max(float(m["time"]) for m in step_metrics.values()) - ready_at


def trained_tokens(step_metrics: Mapping[int, Mapping[str, float]]) -> int:
    """Sum over steps of ``sequence_tokens``: prompt + output tokens of every trained sample."""
    return int(sum(m["sequence_tokens"] for m in step_metrics.values()))


def training_only_s(step_metrics: Mapping[int, Mapping[str, float]]) -> float:
    """Sum over steps of ``step_time_s`` (ledger record, RL step, weight publish): the time
    the trainer computed, without its waits for data."""
    return float(sum(m["step_time_s"] for m in step_metrics.values()))


def first_batch_wait_s(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """The pipeline's fill: how long the trainer waited for its first batch,

        first_batch_wait_s = (time - step_time_s of the lowest-numbered step) - ready_at

    (a step's ``time`` is recorded when it ends, so ``time - step_time_s`` is when it began).
    At eta = 0 it is the first batch's generation; at eta > 0 the first batch is generated
    beside every group the staleness rule admitted with it."""
    if not step_metrics:
        raise ValueError("first_batch_wait_s: no step was trained")
    first = step_metrics[min(step_metrics)]
    return float(first["time"]) - float(first["step_time_s"]) - ready_at


def trainer_idle_s(step_metrics: Mapping[int, Mapping[str, float]], ready_at: float) -> float:
    """The trainer's waits for data after its first batch, so that wall = fill + steps + idle:

        trainer_idle_s = rl_wall_s - first_batch_wait_s - training_only_s

    At eta = 0 it is the generation of every later batch; at eta > 0 the time the rollout
    did not keep up with the trainer."""
    return rl_wall_s(step_metrics, ready_at) - first_batch_wait_s(step_metrics, ready_at) - training_only_s(step_metrics)


def staleness_counts(step_metrics: Mapping[int, Mapping[str, float]]) -> dict[int, int]:
    """Samples per staleness value s (trainer version - oldest token version) over all steps:
    the sum of each step's ``staleness/count_<s>`` (samples dropped as too stale included)."""
    counts: Counter[int] = Counter()
    for metrics in step_metrics.values():
        for key, value in metrics.items():
            if key.startswith(STALENESS_COUNT_PREFIX):
                counts[int(key[len(STALENESS_COUNT_PREFIX) :])] += int(value)
    return dict(sorted(counts.items()))


def wasted_tokens(step_metrics: Mapping[int, Mapping[str, float]]) -> int:
    """Tokens generated, written and then thrown away by the trainer: its ``wasted_tokens``
    (samples dropped as staler than ``trainer.max_staleness``) summed over steps; 0 when every
    sample stays within the bound. What the scheduler generated but never wrote (groups cut
    or left unwritten by a stop, the end of the run included) is its own ``wasted_tokens``,
    reported as ``cut_tokens``; groups left out by dynamic filtering are a choice, counted
    apart (``filtered_groups``)."""
    return int(sum(float(m.get("wasted_tokens", 0.0)) for m in step_metrics.values()))


def mean_packing_efficiency(step_metrics: Mapping[int, Mapping[str, float]]) -> float:
    """Mean over steps of the step's packing efficiency (real tokens / token budget of its micro-batches)."""
    return statistics.fmean(m["packing_efficiency"] for m in step_metrics.values())


def overlap_bound(t_gen: float, t_train: float) -> float:
    """Ideal speed-up of perfect overlap: (T_gen + T_train) / max(T_gen, T_train), between
    1 (one side takes no time) and 2 (both take the same)."""
    if t_gen < 0 or t_train < 0 or max(t_gen, t_train) == 0:
        raise ValueError(f"overlap_bound: need times >= 0, not both 0; got T_gen={t_gen}, T_train={t_train}")
    return (t_gen + t_train) / max(t_gen, t_train)


def run_figures(
    eta: int,
    mode: str,
    step_metrics: Mapping[int, Mapping[str, float]],
    scheduler: Mapping[str, float],
    ready_at: float,
    standalone_tokens_per_s: float,
) -> dict[str, Any]:
    """One configuration's own figures:

        wall_s                     = W (:func:`rl_wall_s`)
        first_batch_wait_s         = :func:`first_batch_wait_s` (the pipeline's fill)
        trainer_idle_s             = :func:`trainer_idle_s` (W = fill + T_train + idle)
        trained_tokens_per_s       = trained tokens (:func:`trained_tokens`) / W
        gen_tokens_per_s           = output tokens of the samples the scheduler finished /
                                     the scheduler's lifetime (ControllerStats.summary)
        streamed_tokens_per_s      = output tokens the servers streamed (groups cut by the
                                     end of the run included) / the scheduler's lifetime
        rollout_utilisation        = streamed_tokens_per_s / the standalone tokens/s at the
                                     run's concurrency: how busy the run kept the server
        weight_sync_stall_fraction = seconds generation was paused for weight updates / scheduler lifetime
        packing_efficiency         = :func:`mean_packing_efficiency`
        reward_wait_per_step_s     = seconds groups waited for their rewards (summed over
                                     groups, ``reward_wait_s``) / steps; they overlap with
                                     generation, so this is the reward service's load, not a stall
        staleness_max, staleness_counts (:func:`staleness_counts`), dropped_stale = sum of ``dropped_stale``
        wasted_tokens              = :func:`wasted_tokens`; cut_tokens = the scheduler's
                                     ``wasted_tokens``; filtered_groups = the scheduler's
                                     ``filtered_groups`` (dynamic filtering)
    """
    missing = sorted({"gen_tokens_per_s", "weight_sync_stall_fraction", "weight_updates"} - set(scheduler))
    if missing:  # a scheduler that recorded nothing must not read as one that generated nothing
        raise ValueError(f"the scheduler's figures lack {missing}: it recorded no controller cycle (see its log)")
    wall = rl_wall_s(step_metrics, ready_at)
    tokens = trained_tokens(step_metrics)
    counts = staleness_counts(step_metrics)
    gen = float(scheduler["gen_tokens_per_s"])
    streamed = float(scheduler.get("streamed_tokens_per_s", gen))
    return {
        "eta": eta,
        "mode": mode,
        "steps": len(step_metrics),
        "wall_s": wall,
        "first_batch_wait_s": first_batch_wait_s(step_metrics, ready_at),
        "trainer_idle_s": trainer_idle_s(step_metrics, ready_at),
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens / wall,
        "gen_tokens_per_s": gen,
        "streamed_tokens_per_s": streamed,
        "standalone_tokens_per_s": standalone_tokens_per_s,
        "rollout_utilisation": streamed / standalone_tokens_per_s,
        "weight_sync_stall_fraction": float(scheduler["weight_sync_stall_fraction"]),
        "weight_updates": int(scheduler["weight_updates"]),
        "packing_efficiency": mean_packing_efficiency(step_metrics),
        "staleness_max": max(counts, default=0),
        "staleness_counts": counts,
        "dropped_stale": int(sum(m.get("dropped_stale", 0.0) for m in step_metrics.values())),
        "wasted_tokens": wasted_tokens(step_metrics),
        "cut_tokens": int(scheduler.get("wasted_tokens", 0.0)),
        "filtered_groups": int(scheduler.get("filtered_groups", 0.0)),
        "training_only_s": training_only_s(step_metrics),
        "reward_wait_per_step_s": float(scheduler.get("reward_wait_s", 0.0)) / max(len(step_metrics), 1),
    }


def run_limit_s(eta: int, t_gen: float, t_train: float) -> float:
    """The shortest wall time a configuration can reach, its own limit:

        synchronous (eta = 0): T_gen + T_train (generation and training take turns)
        asynchronous (eta > 0): max(T_gen(c), T_train) (perfect overlap)

    with T_gen the server alone generating the workload as the configuration does: batch
    by batch at eta = 0, with up to c = (eta + 1) * B * n samples in flight at eta > 0
    (more in flight, more tokens/s: a limit taken at eta 0's concurrency would not be one)."""
    return t_gen + t_train if eta == 0 else max(t_gen, t_train)


def compare_runs(runs: Sequence[Mapping[str, Any]], t_gen: float) -> dict[str, Any]:
    """Figures across runs, against the eta = 0 run (the first without ``error``):

        T_train                  = training_only_s of the eta = 0 run
        ideal_sync_s             = T_gen + T_train (T_gen batch by batch)
        bound                    = overlap_bound(T_gen, T_train) (the most overlap can gain)
        limit_s                  = run_limit_s(eta, T_gen of the run, T_train of the run):
                                   the run's ``t_gen_s`` (standalone at its concurrency) if
                                   set, and its own step times (an asynchronous run may train
                                   fewer tokens: samples over the staleness bound are dropped)
        efficiency               = limit_s / W (1 = the run reaches its own limit)
        speedup                  = W(eta = 0) / W (over this sweep's synchronous run)
        speedup_over_ideal_sync  = ideal_sync_s / W (over a synchronous run without idle time)

    Returns {"t_train_s", "ideal_sync_s", "overlap_bound", "runs": copies of ``runs`` with
    those figures added}; all None while no eta = 0 run succeeded."""
    baseline = next((r for r in runs if r["eta"] == 0 and "error" not in r), None)
    t_train = None if baseline is None else float(baseline["training_only_s"])
    bound = None if t_train is None else overlap_bound(t_gen, t_train)
    compared = []
    for run in runs:
        row = dict(run)
        if baseline is not None and t_train is not None and "error" not in run:
            row["limit_s"] = run_limit_s(int(run["eta"]), float(run.get("t_gen_s", t_gen)), float(run["training_only_s"]))
            row["efficiency"] = row["limit_s"] / run["wall_s"]
            row["speedup"] = baseline["wall_s"] / run["wall_s"]
            row["speedup_over_ideal_sync"] = (t_gen + t_train) / run["wall_s"]
        compared.append(row)
    return {
        "t_train_s": t_train,
        "ideal_sync_s": None if t_train is None else t_gen + t_train,
        "overlap_bound": bound,
        "runs": compared,
    }


# ----- the workload, the standalone measurement, the runs -----


def _write_with_budgets(path: Path, solution_tokens: Sequence[int], max_new_tokens: int) -> None:
    """Add the column ``max_new_tokens`` (:func:`solution_budgets`) to the Parquet at ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.tasks.data.loader import BUDGET_FIELD

    budgets = solution_budgets(solution_tokens, max_new_tokens)
    table = pq.read_table(path).append_column(BUDGET_FIELD, pa.array(budgets, pa.int32()))
    pq.write_table(table, path)


def prepare_workload(work: Path, settings: E2EBenchSettings) -> Workload:
    """The tiny model, the synthetic prompts with their budgets (column ``max_new_tokens``),
    and group k's prompt and budget exactly as the scheduler will draw them. With
    ``code_share`` > 0 the prompt file is a mixture (weights 1 - code_share and code_share)
    of the arithmetic file and a synthetic code file; budgets follow the reference programs."""
    import yaml

    from asyncrl.tasks.scheduler.controller import PromptSchedule, sample_budget
    from asyncrl.tasks.scheduler.setup import load_codec
    from asyncrl.tasks.data.loader import load_prompts
    from asyncrl.tasks.data.prompting import render_prompt
    from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, write_problems
    from asyncrl.tasks.data.synthetic_code import make_code_dataset, write_code_problems
    from asyncrl.tasks.model.tiny import write_tiny_model

    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, seed=settings.seed, overwrite=True)
    codec, _ = load_codec(str(model_dir))
    n_code = round(settings.n_prompts * settings.code_share)
    problems = make_arithmetic_dataset(settings.n_prompts - n_code, settings.seed)
    train_path = write_problems(work / "data" / "train.parquet", problems)
    _write_with_budgets(train_path, [len(codec.encode(p.solution)) for p in problems], settings.max_new_tokens)
    if n_code:
        programs = make_code_dataset(n_code, settings.seed)
        code_path = write_code_problems(work / "data" / "code.parquet", programs)
        _write_with_budgets(code_path, [len(codec.encode(p.solution)) for p in programs], settings.max_new_tokens)
        mixture = {
            "seed": settings.seed,
            "sources": [
                {"path": train_path.name, "weight": 1.0 - settings.code_share},
                {"path": code_path.name, "weight": settings.code_share},
            ],
        }
        train_path = work / "data" / "mixture.yaml"
        train_path.write_text(yaml.safe_dump(mixture))

    schedule = PromptSchedule(load_prompts(train_path), seed=settings.seed)
    records = [schedule.record(k) for k in range(settings.steps * settings.batch_groups)]
    prompts = tuple(tuple(codec.encode(render_prompt(r.prompt, "plain"))) for r in records)
    too_long = [len(p) for p in prompts if len(p) > settings.max_prompt_tokens]
    if too_long:
        raise ValueError(f"max_prompt_tokens: a prompt has {max(too_long)} tokens, over {settings.max_prompt_tokens}")
    return Workload(
        model_dir=model_dir,
        train_path=train_path,
        prompts=prompts,
        budgets=tuple(sample_budget(r, settings.max_new_tokens) for r in records),
        code_groups=sum(r.task == "code" for r in records),
    )


def measure_standalone(workload: Workload, settings: E2EBenchSettings, work: Path) -> dict[str, Any]:
    """The rollout server alone (same launch settings and CPUs as in the runs):

        T_gen = seconds to generate the ``steps`` batches one after the other, each batch's
                B * n samples in flight together (what a synchronous system waits for)
        tokens/s at concurrency c = all steps * B * n samples with at most c in flight
                (``measure_throughput`` of ``asyncrl bench rollout``), for each run's c

    Each batch's requests use the prompt of its first group (prefill is a few dozen tokens;
    decoding the budgets dominates); EOS is ignored, as in the runs."""
    from asyncrl.bench.rollout import measure_throughput
    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.inference.server import RolloutServer

    config = standalone_server_config(settings, workload, work)
    n = settings.n_samples
    batches = workload.batches(settings.batch_groups)
    all_lengths = [workload.budgets[k] for k in range(len(workload.budgets)) for _ in range(n)]
    concurrencies = sorted({min(settings.concurrency(eta), len(all_lengths)) for eta in settings.etas})

    async def measure(server: RolloutServer) -> dict[str, Any]:
        async with RolloutClient([server.handle]) as client:
            await client.generate_group(list(workload.prompts[0]), 4, 32, 1.0, ignore_eos=True)  # warm-up
            per_batch = []
            for batch in batches:
                lengths = [workload.budgets[k] for k in batch for _ in range(n)]
                row = await measure_throughput(client, list(workload.prompts[batch[0]]), lengths, len(lengths))
                per_batch.append(row.seconds)
            throughput = [
                await measure_throughput(client, list(workload.prompts[0]), all_lengths, c) for c in concurrencies
            ]
        return {
            "t_gen_s": sum(per_batch),
            "batch_seconds": per_batch,
            "gen_tokens": sum(all_lengths),
            "throughput": [asdict(row) for row in throughput],
        }

    with RolloutServer(config) as server:
        return asyncio.run(measure(server))


def standalone_server_config(
    settings: E2EBenchSettings, workload: Workload, work: Path, machine: Machine | None = None
) -> RolloutServerConfig:
    """The standalone server: launched as the eta = 0 run's server is on ``machine`` (default:
    this one; :func:`~asyncrl.tasks.launch.components_setup.server_config`: its CPUs, or its GPU
    with CUDA graphs and its share of a shared GPU's memory), on a free port, with its log in
    ``standalone/server.log``."""
    from asyncrl.tasks.launch.components_setup import server_config
    from asyncrl.tasks.system.run_paths import run_paths

    run = bench_run_config(settings, workload, work, 0, settings.modes[0])
    launch = server_config(run, run_paths(run), workload.model_dir, 0, machine)
    return replace(launch, port=0, log_path=work / "standalone" / "server.log")


def _standalone_row(standalone: Mapping[str, Any], concurrency: int) -> Mapping[str, Any]:
    rows = sorted(standalone["throughput"], key=lambda r: r["concurrency"])
    fitting = [r for r in rows if r["concurrency"] <= concurrency]
    return fitting[-1] if fitting else rows[0]


def standalone_tokens_per_s(standalone: Mapping[str, Any], concurrency: int) -> float:
    """The standalone tokens/s measured at the largest concurrency <= ``concurrency``
    (the smallest measured one if none is)."""
    return float(_standalone_row(standalone, concurrency)["tokens_per_s"])


def standalone_gen_s(standalone: Mapping[str, Any], eta: int, concurrency: int) -> float:
    """T_gen of a configuration (:func:`run_limit_s`): at eta = 0 the batch-by-batch time,
    else the seconds the standalone server took for every step's samples with at most
    ``concurrency`` in flight (same measurement as :func:`standalone_tokens_per_s`)."""
    if eta == 0:
        return float(standalone["t_gen_s"])
    return float(_standalone_row(standalone, concurrency)["seconds"])


def bench_run_config(settings: E2EBenchSettings, workload: Workload, work: Path, eta: int, mode: str) -> RunConfig:
    """The run config of one configuration: only eta and the interrupt mode differ between runs."""
    from asyncrl.configs.loading import config_from_dict
    from asyncrl.tasks.inference.server import free_port

    name = f"bench-e2e-eta{eta}-{mode}"
    placement = settings.placement()
    return config_from_dict(
        {
            "name": name,
            "seed": settings.seed,
            "work_dir": str(work / "runs"),
            "model": {"path": str(workload.model_dir)},
            "data": {"train_path": str(workload.train_path), "max_prompt_tokens": settings.max_prompt_tokens},
            "rollout": {
                "base_port": free_port("127.0.0.1"),
                "n_samples": settings.n_samples,
                "max_new_tokens": settings.max_new_tokens,
                "eta": eta,
                "interrupt_mode": mode,
                "ignore_eos": True,
                "kv_cache_gib": settings.kv_cache_gib,
                "shard_groups": 1,  # every finished group is written at once: no batching delay
                "shard_seconds": 1.0,
                "max_groups_in_flight": settings.max_groups_in_flight,
                **placement["rollout"],
            },
            "trainer": {
                "batch_groups": settings.batch_groups,
                "max_steps": settings.steps,
                "micro_batch_tokens": settings.micro_batch_tokens,
                "checkpoint_every": settings.steps + 1,  # no checkpoint inside the timed phase
                "optimizer": {"lr": 1.0e-5},
                **placement["trainer"],
            },
            "placement": placement["placement"],
            # every code answer is run as a program: the sandbox's full load on the reward service
            "reward": {"pool": {"workers": 1}, "code": {"extract": "whole"}},
            "storage": {"root": str(work / "runs" / name / "store")},
            "tracking": {"mlflow_uri": f"sqlite:///{work / 'mlflow.db'}", "experiment": "bench-e2e"},
        },
        source=f"bench e2e ({name})",
    )


def workload_summary(workload: Workload, settings: E2EBenchSettings) -> dict[str, Any]:
    budgets = sorted(workload.budgets)
    return {
        "groups": len(budgets),
        "samples": len(budgets) * settings.n_samples,
        "output_tokens": sum(budgets) * settings.n_samples,
        "budget_mean": statistics.fmean(budgets),
        "budget_p50": budgets[len(budgets) // 2],
        "budget_p90": budgets[int(0.9 * (len(budgets) - 1))],
        "budget_max": budgets[-1],
        "code_groups": workload.code_groups,
    }


def run_e2e_bench(settings: E2EBenchSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Standalone measurement, then every configuration of ``settings.sweep()``; returns the
    result (see :func:`format_tables`). A configuration that fails is recorded with its
    ``error`` and the sweep goes on."""
    from asyncrl.tasks.launch.rl import train_run
    from asyncrl.tasks.trainer.jit_ops import ensure_jit_ops_built

    say = progress or (lambda line: None)
    work = settings.work_dir or Path(tempfile.mkdtemp(prefix="asyncrl-bench-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    # A fresh environment compiles DeepSpeed's CPU collective op in its first trainer start
    # (a long wait): built here, it stays out of the first run's wall.
    say(ensure_jit_ops_built())
    workload = prepare_workload(work, settings)
    say(f"workload ready in {work}; measuring the standalone server")
    standalone = measure_standalone(workload, settings, work)
    say(f"standalone: T_gen {standalone['t_gen_s']:.1f} s")
    result: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "work_dir": str(work),
        "workload": workload_summary(workload, settings),
        "standalone": standalone,
    }
    runs: list[dict[str, Any]] = []
    sweep = settings.sweep()
    for index, (eta, mode) in enumerate(sweep, start=1):
        config = bench_run_config(settings, workload, work, eta, mode)
        try:
            train = train_run(config)
            run = run_figures(
                eta, mode, train.step_metrics, train.scheduler, train.ready_at,
                standalone_tokens_per_s(standalone, settings.concurrency(eta)),
            )  # fmt: skip
            run["train_run_wall_s"] = train.wall_s
            run["t_gen_s"] = standalone_gen_s(standalone, eta, settings.concurrency(eta))
        except Exception as exc:  # noqa: BLE001 - recorded; the other configurations still run
            run = {"eta": eta, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:4000]}
        runs.append(run)
        result.update(compare_runs(runs, standalone["t_gen_s"]))
        if settings.json_path is not None:
            settings.json_path.write_text(json.dumps(result, indent=1))
        say(f"[{index}/{len(sweep)}] eta={eta} {mode}: " + (run.get("error") or f"wall {run['wall_s']:.1f} s"))
    return result


# ----- output -----


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_staleness(counts: Mapping[Any, int]) -> str:
    """``{0: 40, 1: 8}`` -> ``0:40 1:8`` (staleness value: samples)."""
    return " ".join(f"{s}:{c}" for s, c in sorted(counts.items(), key=lambda item: int(item[0])))


def format_tables(result: Mapping[str, Any]) -> str:
    """The workload, the standalone measurement, the bound, and one table row per run."""
    w, s = result["workload"], result["standalone"]
    lines = [
        f"workload {result['settings'].get('workload', 'balanced')}: {w['groups']} groups x {result['settings']['n_samples']} samples, output budget mean "
        f"{w['budget_mean']:.0f}, p50 {w['budget_p50']}, p90 {w['budget_p90']}, max {w['budget_max']} tokens "
        f"(long-tailed, EOS ignored); {result['settings']['steps']} steps of {result['settings']['batch_groups']} groups"
        + (f"; {w['code_groups']} code groups" if w.get("code_groups") else ""),
        (f"GPUs: rollout {gpus[0]}, trainer {gpus[-1]}" if (gpus := result["settings"].get("gpus"))
         else f"CPUs: rollout {result['settings']['rollout_cores']}, trainer {result['settings']['trainer_cores']}")
        + (f"; at most {cap} groups in flight" if (cap := result["settings"].get("max_groups_in_flight")) else ""),
        "standalone server: " + ", ".join(f"{r['tokens_per_s']:.0f} tokens/s at c={r['concurrency']}" for r in s["throughput"]),
        f"T_gen {s['t_gen_s']:.1f} s (batch by batch), T_train {_fmt(result.get('t_train_s'), '.1f')} s "
        f"(eta=0 step times): ideal synchronous {_fmt(result.get('ideal_sync_s'), '.1f')} s, "
        f"ideal overlap bound {_fmt(result.get('overlap_bound'), '.2f')}x",
        "limit: T_gen + T_train at eta 0, max(T_gen at the run's concurrency, the run's T_train) at eta > 0; "
        "efficiency = limit / wall; wall = first batch (the pipeline's fill) + the run's step times + trainer idle",
        "dropped: samples over the staleness bound; wasted tok.: their tokens; cut tok.: tokens generated but "
        "never written (groups cut by a stop or the end of the run)",
        "",
        "| eta | mode | wall (s) | limit (s) | efficiency | first batch (s) | trainer idle (s) "
        "| speed-up vs eta 0 | speed-up vs ideal sync | trained tok/s | rollout util. | stall frac. | reward wait/step (s) | packing eff. | staleness max "
        "| staleness (value:samples) | dropped | wasted tok. | cut tok. | filtered groups |",
        "|" + " --- |" * 20,
    ]
    for r in result.get("runs", []):
        mode = "sync" if r["eta"] == 0 else r["mode"]
        if "error" in r:
            lines.append(f"| {r['eta']} | {mode} | failed: {r['error'].splitlines()[0][:80]} |" + " |" * 17)
            continue
        lines.append(
            f"| {r['eta']} | {mode} | {r['wall_s']:.1f} | {_fmt(r.get('limit_s'), '.1f')} | "
            f"{_fmt(r.get('efficiency'), '.2f')} | {_fmt(r.get('first_batch_wait_s'), '.1f')} | "
            f"{_fmt(r.get('trainer_idle_s'), '.1f')} | {_fmt(r.get('speedup'), '.2f')} | "
            f"{_fmt(r.get('speedup_over_ideal_sync'), '.2f')} | {r['trained_tokens_per_s']:.0f} | "
            f"{r['rollout_utilisation']:.2f} | {r['weight_sync_stall_fraction']:.3f} | "
            f"{_fmt(r.get('reward_wait_per_step_s'), '.2f')} | {r['packing_efficiency']:.3f} | "
            f"{r['staleness_max']} | {format_staleness(r['staleness_counts'])} | {_fmt(r.get('dropped_stale'), 'd')} | "
            f"{_fmt(r.get('wasted_tokens'), 'd')} | {_fmt(r.get('cut_tokens'), 'd')} | "
            f"{_fmt(r.get('filtered_groups'), 'd')} |"
        )
    return "\n".join(lines)


def parse_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _cores(text: str) -> tuple[int, ...] | None:
    return None if text.strip().lower() == "none" else parse_int_list(text)


def auto_cores(text: str, default: tuple[int, ...] | None, gpus: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """CPU ids of ``--rollout-cores`` / ``--trainer-cores``: 'auto' is ``default`` (half the
    CPUs each) without ``--gpus`` and no pinning with it."""
    if text == "auto":
        return default if gpus is None else None
    return _cores(text)


def _modes(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def settings_from_args(args: argparse.Namespace) -> E2EBenchSettings:
    """The settings of ``asyncrl bench e2e``: the workload's values (:data:`WORKLOADS`) under
    explicit options; the micro-batch budget fits the longest sequence."""
    defaults = E2EBenchSettings()
    if args.workload not in WORKLOADS:
        raise ValueError(f"--workload: must be one of {list(WORKLOADS)}, got {args.workload!r}")
    preset = WORKLOADS[args.workload]
    max_new_tokens = int(args.max_new_tokens or preset.get("max_new_tokens", defaults.max_new_tokens))
    return E2EBenchSettings(
        workload=args.workload,
        etas=args.etas,
        modes=args.modes,  # type: ignore[arg-type]  # checked by the settings
        steps=args.steps,
        batch_groups=args.batch_groups,
        n_samples=args.n_samples,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=int(preset.get("max_prompt_tokens", defaults.max_prompt_tokens)),
        micro_batch_tokens=int(max(
            preset.get("micro_batch_tokens", defaults.micro_batch_tokens),
            preset.get("max_prompt_tokens", defaults.max_prompt_tokens) + max_new_tokens,
        )),
        code_share=float(preset.get("code_share", defaults.code_share)),
        seed=args.seed,
        max_groups_in_flight=args.max_groups_in_flight,
        # With GPUs, 'auto' pins no CPU.
        rollout_cores=auto_cores(args.rollout_cores, defaults.rollout_cores, args.gpus),
        trainer_cores=auto_cores(args.trainer_cores, defaults.trainer_cores, args.gpus),
        gpus=args.gpus,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        json_path=Path(args.json) if args.json else None,
    )


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    result = run_e2e_bench(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_tables(result))
    print(json.dumps(result))
    return 1 if any("error" in r for r in result["runs"]) else 0


def add_e2e_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``e2e`` on the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "e2e", help="async speed-up end to end: eta = 0 vs eta > 0 in both interrupt modes, and the ideal overlap bound"
    )
    defaults = E2EBenchSettings()
    parser.add_argument("--etas", type=parse_int_list, default=defaults.etas, help="comma-separated, must include 0 (default 0,1,2,4,8)")
    parser.add_argument("--modes", type=_modes, default=defaults.modes, help="comma-separated interrupt modes (default recompute,keep)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run")
    parser.add_argument("--batch-groups", type=int, default=defaults.batch_groups, help="prompt groups per step (B)")
    parser.add_argument("--n-samples", type=int, default=defaults.n_samples, help="samples per prompt (n)")
    parser.add_argument("--workload", choices=list(WORKLOADS), default=defaults.workload,
                        help="balanced (default), generation-bound (4x longer outputs) or mixed (half code, scored in the sandbox)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"budget of the longest reference solution (default {defaults.max_new_tokens}, or the workload's)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-groups-in-flight", type=int, default=None,
                        help="rollout.max_groups_in_flight of every run (default: none, the staleness gate alone)")  # fmt: skip
    parser.add_argument("--rollout-cores", default="auto", help="comma-separated CPU ids, 'auto' (first half) or 'none'")
    parser.add_argument("--trainer-cores", default="auto", help="comma-separated CPU ids, 'auto' (second half) or 'none'")
    parser.add_argument("--gpus", type=parse_int_list, default=None,
                        help="GPU ids: one, shared by the rollout server and the trainer, or server,trainer "
                             "(default: none, CPUs; with GPUs 'auto' cores pin nothing)")  # fmt: skip
    parser.add_argument("--work-dir", default=None, help="keep the model, prompts, run roots and logs here")
    parser.add_argument("--json", default=None, help="also write the result as JSON here (updated after every run)")
    parser.set_defaults(handler=cmd_bench_e2e)
    return parser
