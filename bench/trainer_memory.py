"""``asyncrl bench trainer-memory``: the trainer's resident memory phase by phase, with
glibc's own heap and with the heap the trainer sets at its start
(:func:`~asyncrl.tasks.system.host_memory.return_freed_memory_to_os`).

Each heap setting runs in a process of its own (a malloc setting holds for the whole
process), or ``world_size`` processes under ``torchrun`` (gloo on CPU), on the same model,
with the engine the trainer builds (DeepSpeed) and ``steps`` steps of one packed
micro-batch per rank: a no-grad forward (log pi_prox), a forward, a backward and an
optimizer step; then one publish of the weights (``save_hf_weights``: under ZeRO stage 3 the
gathers, one parameter at a time). After each phase every rank reads its ``VmRSS`` and
``VmHWM`` and resets ``VmHWM`` (``/proc/self/clear_refs``), so each phase's peak is its
own. Reported per heap and rank: the peak and its ratio to the rank's model states
(:func:`rank_state_bytes`), what stays resident between steps, the seconds of each step
after the first (the first allocates Adam's states), and what the publish added to the
resident memory against the weights' bytes and the largest parameter's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from asyncrl.bench.process_memory import own_memory, reset_own_peak
from asyncrl.bench.scale_settings import SIZE_SPECS
from asyncrl.configs.trainer import ZERO3_LIVE_ELEMENTS
from asyncrl.tasks.trainer.process import without_process_group_env

WORKER_MODULE = "asyncrl.bench.trainer_memory_worker"
GLIBC_DEFAULT = "glibc"
"""The heap name for glibc's own malloc settings (a threshold that rises with the blocks freed)."""
HEAP_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_")
"""glibc's malloc variables, removed from each measured process so that a heap is what it says."""


def parse_heaps(text: str) -> tuple[str, ...]:
    """``--heaps``: comma-separated ``glibc`` (glibc's own settings) or mmap thresholds in
    MiB (``1``: what the trainer sets); ``ValueError`` naming the option otherwise."""
    heaps = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    if not heaps:
        raise ValueError("--heaps: name at least one heap (glibc, or an mmap threshold in MiB)")
    for heap in heaps:
        if heap != GLIBC_DEFAULT and not (heap.isdigit() and int(heap) >= 1):
            raise ValueError(f"--heaps: {heap!r} is neither {GLIBC_DEFAULT!r} nor a threshold of >= 1 MiB")
    if len(set(heaps)) != len(heaps):
        raise ValueError(f"--heaps: a heap repeats in {text!r}")
    return heaps


@dataclass(frozen=True)
class MemorySettings:
    """One measured process: the model, its micro-batch and the engine's settings."""

    model_dir: Path
    tokens: int = 2136
    """Positions of the one packed micro-batch (8 sequences of ``tokens // 8``)."""
    steps: int = 3
    logit_chunk_tokens: int | None = 256
    activation_checkpointing: bool = True
    zero_stage: int = 0
    world_size: int = 1
    """Ranks (processes) of the engine; above 1 they start under ``torchrun``."""
    zero3_live_elements: int | None = ZERO3_LIVE_ELEMENTS
    """``trainer.zero3_live_elements``; None: DeepSpeed's defaults."""

    def __post_init__(self) -> None:
        if self.tokens < 8 * 33:
            raise ValueError(f"--tokens must be >= {8 * 33} (8 sequences of a 32-token prompt and an output), got {self.tokens}")
        if self.steps < 2:
            raise ValueError(f"--steps must be >= 2 (the first allocates Adam's states), got {self.steps}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if self.zero3_live_elements is not None and self.zero3_live_elements < 1_000_000:
            raise ValueError(f"--zero3-live-elements must be >= 1000000 (or 0: DeepSpeed's defaults), got {self.zero3_live_elements}")


def rank_state_bytes(parameters: int, zero_stage: int, world_size: int) -> float:
    """One rank's share of the float32 model states under ZeRO (the ZeRO paper's partitions):

        weights 4 / (N if stage 3) + gradients 4 / (N if stage >= 2) + Adam 8 / (N if stage >= 1)

    bytes per parameter, N = world size (16 at stage 0 or N = 1: all of
    :func:`~asyncrl.bench.scale_figures.model_state_bytes`)."""
    n = float(world_size)
    per_param = 4 / (n if zero_stage >= 3 else 1) + 4 / (n if zero_stage >= 2 else 1) + 8 / (n if zero_stage >= 1 else 1)
    return parameters * per_param


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rss_bytes: int
    """Resident at the phase's end."""
    peak_bytes: int
    """The most resident during the phase (since the last reset)."""


def measure_phases(settings: MemorySettings, version_dir: Path) -> dict[str, Any]:
    """Build the engine, run the steps and publish to ``version_dir`` (removed after) in this
    process, one rank of ``settings.world_size``; one :class:`Phase` per stage."""
    import torch

    from asyncrl.configs.trainer import OptimizerConfig
    from asyncrl.tasks.trainer.batch import TokenSequence, build_micro_batches
    from asyncrl.tasks.trainer.engine import EngineSettings, build_engine, save_hf_weights
    from asyncrl.tasks.trainer.logprobs import micro_batch_logprobs

    phases: list[Phase] = []
    peaks_per_phase = reset_own_peak()
    started = time.perf_counter()

    def end_phase(name: str) -> None:
        nonlocal started
        memory = own_memory()
        phases.append(Phase(name, time.perf_counter() - started, memory.rss_bytes, memory.hwm_bytes))
        reset_own_peak()
        started = time.perf_counter()

    engine = build_engine(
        settings.model_dir,
        EngineSettings(
            optimizer=OptimizerConfig(lr=1e-6),
            zero_stage=settings.zero_stage,
            logit_chunk_tokens=settings.logit_chunk_tokens,
            activation_checkpointing=settings.activation_checkpointing,
            zero3_live_elements=settings.zero3_live_elements,
        ),
    )
    end_phase("build")
    per_sequence, vocab = settings.tokens // 8, engine.vocab_size
    sequences = [
        TokenSequence(list(range(1, 33)), [(i * 7919 + j * 31) % (vocab - 1) + 1 for j in range(per_sequence - 32)])
        for i in range(8)
    ]
    (batch,) = build_micro_batches(sequences, [list(range(8))], "packed")
    mask = batch.loss_mask.reshape(-1).to(torch.float32)
    for step in range(settings.steps):
        engine.module.eval()
        with torch.no_grad():
            micro_batch_logprobs(engine.ds, batch, settings.logit_chunk_tokens)
        end_phase(f"step {step} proximal forward")
        engine.module.train()
        logprobs = micro_batch_logprobs(engine.ds, batch, settings.logit_chunk_tokens)
        loss = -(logprobs * mask).sum() / mask.sum()
        end_phase(f"step {step} forward")
        engine.ds.backward(loss)
        del logprobs, loss
        end_phase(f"step {step} backward")
        engine.ds.step()
        end_phase(f"step {step} optimizer")
    save_hf_weights(engine, version_dir)
    end_phase("publish")
    if engine.rank == 0:
        shutil.rmtree(version_dir, ignore_errors=True)
    # ZeRO stage 3 leaves each rank an empty tensor per parameter; ds_numel is the whole one's.
    sizes = [getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()]
    return {
        "rank": engine.rank,
        "world_size": engine.world_size,
        "zero_stage": settings.zero_stage,
        "parameters": sum(sizes),
        "largest_parameter": max(sizes),
        "micro_batch_tokens": int(batch.slots),
        "peaks_per_phase": peaks_per_phase,
        "phases": [asdict(phase) for phase in phases],
    }


def heap_figures(measured: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's figures from its phases (float32 training):

        peak           = max over phases of the phase's VmHWM
        between steps  = VmRSS after the last optimizer step
        step s         = mean over steps 1.. of the sum of their four phases' seconds
        publish extra  = the publish's VmHWM - VmRSS before it; / weights = / (4 B x parameters),
                         / largest = / (4 B x the largest parameter's elements)
    """
    phases = measured["phases"]
    parameters = measured["parameters"]
    states = rank_state_bytes(parameters, measured["zero_stage"], measured["world_size"])
    peak = max(p["peak_bytes"] for p in phases)
    optimizer_ends = [index for index, p in enumerate(phases) if p["name"].endswith(" optimizer")]
    publish = next(index for index, p in enumerate(phases) if p["name"] == "publish")
    publish_extra = phases[publish]["peak_bytes"] - phases[publish - 1]["rss_bytes"]
    weight_bytes = 4 * parameters  # float32
    steps: dict[int, float] = {}
    for phase in phases:
        if phase["name"].startswith("step "):
            index = int(phase["name"].split()[1])
            steps[index] = steps.get(index, 0.0) + phase["seconds"]
    later = [seconds for index, seconds in sorted(steps.items()) if index > 0]
    return {
        "model_state_bytes": float(states),
        "peak_bytes": float(peak),
        "peak_over_states": peak / states,
        "between_steps_bytes": float(phases[optimizer_ends[-1]]["rss_bytes"]),
        "first_step_s": steps[0],
        "step_s": sum(later) / len(later),
        "step_s_each": later,
        "publish_s": phases[publish]["seconds"],
        "publish_extra_bytes": float(publish_extra),
        "weight_bytes": float(weight_bytes),
        "publish_extra_over_weights": publish_extra / weight_bytes,
        "publish_extra_over_largest": publish_extra / (4 * measured["largest_parameter"]),
    }


def worker_command(settings: MemorySettings, heap: str, out_dir: Path, python: str = sys.executable) -> list[str]:
    """The measured process(es): :data:`WORKER_MODULE`, under ``torchrun --standalone`` for
    more than one rank; each rank writes ``out_dir/rank<R>.json``."""
    worker = ["-m", WORKER_MODULE, "--settings", json.dumps(asdict(settings), default=str),
              "--heap", heap, "--out-dir", str(out_dir)]  # fmt: skip
    if settings.world_size == 1:
        return [python, *worker]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={settings.world_size}",
                f"--log-dir={out_dir / 'torchrun'}"]  # fmt: skip
    return [*torchrun, *worker]


def run_heap(settings: MemorySettings, heap: str, out_dir: Path, python: str = sys.executable) -> list[dict[str, Any]]:
    """Measure ``heap`` in fresh processes (:func:`worker_command`), glibc's malloc variables and
    this process's own process-group variables (:func:`without_process_group_env`) removed from
    their environment; every rank's phases, or
    ``RuntimeError`` with the output's tail."""
    env = {name: value for name, value in without_process_group_env(os.environ).items() if name not in HEAP_ENV}
    out_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(worker_command(settings, heap, out_dir, python), env=env, capture_output=True, text=True, check=False)
    outs = [out_dir / f"rank{rank}.json" for rank in range(settings.world_size)]
    if done.returncode != 0 or not all(out.is_file() for out in outs):
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"bench trainer-memory: heap {heap!r} failed (exit {done.returncode}):\n{tail}")
    return [json.loads(out.read_text()) for out in outs]


def run_memory_bench(
    settings: MemorySettings, heaps: Sequence[str], progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every heap in turn, each in its own process; the result as :func:`format_table` reads it."""
    say = progress or (lambda line: None)
    result: dict[str, Any] = {"settings": asdict(settings), "heaps": {}}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-trainer-memory-") as scratch:
        for heap in heaps:
            say(f"heap {heap}: building the engine and running {settings.steps} steps")
            ranks = run_heap(settings, heap, Path(scratch) / heap)
            result["heaps"][heap] = {"heap": heap, "ranks": [{**rank, "figures": heap_figures(rank)} for rank in ranks]}
    result["settings"]["model_dir"] = str(settings.model_dir)
    return result


def heap_label(heap: str) -> str:
    return "glibc's own" if heap == GLIBC_DEFAULT else f"mmap threshold {heap} MiB"


def _columns(result: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(label, measured rank) for every heap and rank; the rank is named when there are several."""
    columns = []
    for heap, measured in result["heaps"].items():
        ranks = measured["ranks"]
        for rank in ranks:
            suffix = f", rank {rank['rank']}" if len(ranks) > 1 else ""
            columns.append((heap_label(heap) + suffix, rank))
    return columns


def format_table(result: Mapping[str, Any]) -> str:
    """Two Markdown tables: the figures per heap and rank, then every phase's peak and resident GB."""
    gb = 1e9
    lines = ["| heap | peak RSS (GB) | / model states | between steps (GB) | first step (s) | later steps (s) "
             "| publish (s) | publish: extra RSS (GB) / weights / largest parameter |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    columns = _columns(result)
    for label, rank in columns:
        f = rank["figures"]
        each = ", ".join(f"{s:.1f}" for s in f["step_s_each"])
        lines.append(f"| {label} | {f['peak_bytes'] / gb:.2f} | {f['peak_over_states']:.2f} | "
                     f"{f['between_steps_bytes'] / gb:.2f} | {f['first_step_s']:.1f} | {f['step_s']:.1f} ({each}) | "
                     f"{f['publish_s']:.1f} | {f['publish_extra_bytes'] / gb:.2f} / {f['publish_extra_over_weights']:.2f} / "
                     f"{f['publish_extra_over_largest']:.2f} |")  # fmt: skip
    lines += ["", "| phase | " + " | ".join(f"{label}: peak / after (GB)" for label, _ in columns) + " |",
              "| --- |" + " --- |" * len(columns)]  # fmt: skip
    for index, phase in enumerate(columns[0][1]["phases"]):
        cells = [f"{rank['phases'][index]['peak_bytes'] / gb:.2f} / {rank['phases'][index]['rss_bytes'] / gb:.2f}"
                 for _, rank in columns]  # fmt: skip
        lines.append(f"| {phase['name']} | " + " | ".join(cells) + " |")
    first = columns[0][1]
    lines.append(f"\n{first['parameters']:,} parameters ({first['figures']['weight_bytes'] / gb:.2f} GB of weights); "
                 f"ZeRO stage {first['zero_stage']}, {first['world_size']} rank(s), each's model states "
                 f"{first['figures']['model_state_bytes'] / gb:.2f} GB; one micro-batch of "
                 f"{first['micro_batch_tokens']:,} positions per rank")  # fmt: skip
    return "\n".join(lines)


def cmd_bench_trainer_memory(args: argparse.Namespace) -> int:
    try:
        heaps = parse_heaps(args.heaps)
        if (args.model is None) == (args.size is None):
            raise ValueError("name the model: --model DIR or --size NAME (one of them)")
        if args.size is not None and args.size not in SIZE_SPECS:
            raise ValueError(f"--size: unknown size {args.size!r}; choose from {', '.join(SIZE_SPECS)}")
        if args.model is not None and not (Path(args.model) / "config.json").is_file():
            raise ValueError(f"--model: {args.model} holds no config.json")
        settings = MemorySettings(
            model_dir=Path(args.model or "."), tokens=args.tokens, steps=args.steps,
            logit_chunk_tokens=args.logit_chunk_tokens or None,
            activation_checkpointing=not args.no_activation_checkpointing, zero_stage=args.zero_stage,
            world_size=args.world_size, zero3_live_elements=args.zero3_live_elements or None,
        )  # fmt: skip
    except ValueError as exc:
        print(f"bench trainer-memory: {exc}", file=sys.stderr)
        return 2
    if args.size is not None:
        from asyncrl.bench.scale import ensure_model

        work = Path(args.work_dir or tempfile.mkdtemp(prefix="asyncrl-bench-trainer-memory-"))
        print(f"bench trainer-memory: writing the {args.size} model under {work}", file=sys.stderr, flush=True)
        settings = replace(settings, model_dir=ensure_model(work / args.size / "model", SIZE_SPECS[args.size], seed=args.seed))
    result = run_memory_bench(settings, heaps, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
