"""`asyncrl bench rollout`: standalone generation throughput of one vLLM server on a
long-tailed length workload, and the stall per weight update in both interrupt modes.

    tokens/s (concurrency c) = output tokens of all requests / wall seconds,
    with c requests in flight and request lengths (ignore_eos) from a truncated power law;
    stall per update = first /pause sent -> last /resume answered (UpdateStats.stall_s),
    measured while generating and split into pause, load, set version, resume;
    stall / load = mean stall / mean load (the weight loader's own time).

Also reported: the fetch before the pause (:meth:`ServerWeightLoader.prefetch`, not stall)
and the server start time (``--worker-in-own-process``, ``--spawn-engine-core``: vLLM's CPU
defaults beside ours). Details: ``docs/internals/inference.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.inference.samples import INTERRUPT_MODES


@dataclass(frozen=True)
class RolloutBenchSettings:
    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    requests: int = 64
    min_tokens: int = 16
    max_tokens: int = 512
    length_exponent: float = 1.2
    updates_per_mode: int = 5
    seed: int = 0
    worker_in_engine_process: bool = True
    """``RolloutServerConfig.worker_in_engine_process`` of the measured server."""
    fork_engine_core: bool = True
    """``RolloutServerConfig.fork_engine_core`` of the measured server."""


@dataclass(frozen=True)
class ThroughputRow:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float


@dataclass(frozen=True)
class StallRow:
    mode: str
    updates: int
    stall_s_mean: float
    stall_s_p50: float
    stall_s_max: float
    pause_s_mean: float
    load_s_mean: float
    resume_s_mean: float
    """Setting the version and resuming."""
    stall_over_load: float
    """stall_s_mean / load_s_mean."""
    interrupted_mean: float
    prefetch_s_mean: float = 0.0
    """Fetching the version before the pause (generation running), mean."""


def long_tailed_lengths(n: int, settings: RolloutBenchSettings) -> list[int]:
    """L ~ P(L) proportional to L^-a on [min_tokens, max_tokens] (a = length_exponent)."""
    rng = random.Random(settings.seed)
    support = range(settings.min_tokens, settings.max_tokens + 1)
    weights = [length ** -settings.length_exponent for length in support]
    return rng.choices(list(support), weights=weights, k=n)


async def measure_throughput(client: Any, prompt: list[int], lengths: list[int], concurrency: int) -> ThroughputRow:
    limit = asyncio.Semaphore(concurrency)
    produced = 0

    async def one(length: int) -> None:
        nonlocal produced
        async with limit:
            outputs = await client.generate_group(prompt, 1, length, 1.0, ignore_eos=True)
        produced += sum(len(o.output_token_ids) for o in outputs)

    started = time.perf_counter()
    await asyncio.gather(*(one(length) for length in lengths))
    seconds = time.perf_counter() - started
    return ThroughputRow(concurrency, len(lengths), produced, seconds, produced / seconds)


async def measure_stalls(
    handle: Any, prompt: list[int], mode: str, store_uri: str, versions: list[int], cache_dir: str
) -> StallRow:
    """Updates while 8 long generations run; each update loads the next published version."""
    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
    from asyncrl.tasks.inference.weight_sync import server_weight_version

    stats = []
    prefetch_s = []
    initial = server_weight_version(handle) or 0
    with ServerWeightLoader(store_uri, {}, cache_dir) as loader:
        async with RolloutClient([handle], interrupt_mode=mode, initial_version=initial) as client:
            for version in versions:
                if version <= client.current_version:
                    continue
                generation = asyncio.gather(
                    *(client.generate_group(prompt, 1, 256, 1.0, ignore_eos=True) for _ in range(8))
                )
                await asyncio.sleep(1.0)  # let the generations get going
                begun = time.perf_counter()
                await asyncio.to_thread(loader.prefetch, version, [handle])  # as the scheduler does
                prefetch_s.append(time.perf_counter() - begun)
                stats.append(await client.update_weights(version, loader.for_version(version)))
                await generation
    return stall_row(mode, stats, prefetch_s)


def stall_row(mode: str, stats: list[Any], prefetch_s: list[float] | None = None) -> StallRow:
    """Means over the updates' :class:`~asyncrl.tasks.inference.samples.UpdateStats`; the load is
    the loader's own time (mean over servers), so stall / load says what the update adds to
    it; ``prefetch_s``: each update's fetch before its pause."""
    stall_mean = statistics.fmean(s.stall_s for s in stats)
    load_mean = statistics.fmean(statistics.fmean(s.load_s.values()) for s in stats)
    return StallRow(
        mode=mode,
        updates=len(stats),
        stall_s_mean=stall_mean,
        stall_s_p50=statistics.median(s.stall_s for s in stats),
        stall_s_max=max(s.stall_s for s in stats),
        pause_s_mean=statistics.fmean(s.phase_s["pause"] for s in stats),
        load_s_mean=load_mean,
        resume_s_mean=statistics.fmean(s.phase_s["set_version"] + s.phase_s["resume"] for s in stats),
        stall_over_load=stall_mean / load_mean,
        interrupted_mean=statistics.fmean(s.interrupted_segments for s in stats),
        prefetch_s_mean=statistics.fmean(prefetch_s) if prefetch_s else 0.0,
    )


def perturbed_versions(model_dir: Path, store_uri: str, count: int, seed: int, work: Path) -> list[int]:
    """Publish version 0 (the model) and 1..count: the model with seeded noise (std 0.02)."""
    from asyncrl.storage.fs import open_root
    from asyncrl.storage.weights import WeightStore
    from asyncrl.tasks.model.variants import perturbed_copy

    store = WeightStore(open_root(store_uri))
    store.publish(0, model_dir)
    for version in range(1, count + 1):
        store.publish(version, perturbed_copy(model_dir, work / f"v{version}", seed=seed + version, std=0.02))
    return list(range(1, count + 1))


def run_rollout_bench(model_dir: Path | None, settings: RolloutBenchSettings, work_dir: Path | None = None) -> dict[str, Any]:
    """Throughput by concurrency, then the stall of each interrupt mode's updates, on one
    server. Its model, weight versions and log go to ``work_dir`` (kept), else to a temporary
    directory removed afterwards (two copies of the model per weight version: ~250 MB for the
    tiny model's default 10 updates)."""
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="asyncrl-bench-rollout-") as scratch:
            return _measure_rollout(model_dir, settings, Path(scratch))
    work_dir.mkdir(parents=True, exist_ok=True)
    return _measure_rollout(model_dir, settings, work_dir)


def _measure_rollout(model_dir: Path | None, settings: RolloutBenchSettings, work: Path) -> dict[str, Any]:
    from asyncrl.tasks.model.tiny import write_tiny_model
    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.inference.server import RolloutServer, server_env
    from asyncrl.tasks.inference.server_config import RolloutServerConfig
    from asyncrl.tasks.inference.vllm_platform import FORK_ENGINE_CORE_ENV

    model_dir = model_dir or write_tiny_model(work / "model", seed=settings.seed)
    store_uri = f"file://{work / 'store'}"
    n_updates = settings.updates_per_mode * len(INTERRUPT_MODES)
    versions = perturbed_versions(model_dir, store_uri, n_updates, settings.seed, work)
    lengths = long_tailed_lengths(settings.requests, settings)
    prompt = list(range(10, 42))
    config = RolloutServerConfig(model_dir=model_dir, kv_cache_gib=2.0, log_path=work / "server.log",
                                 max_model_len=len(prompt) + settings.max_tokens + 8,
                                 worker_in_engine_process=settings.worker_in_engine_process,
                                 fork_engine_core=settings.fork_engine_core)

    async def measure(server: RolloutServer) -> tuple[list[ThroughputRow], list[StallRow]]:
        async with RolloutClient([server.handle]) as client:
            await client.generate_group(prompt, 4, 32, 1.0, ignore_eos=True)  # warm-up
            throughput = [await measure_throughput(client, prompt, lengths, c) for c in settings.concurrencies]
        stalls = []
        for index, mode in enumerate(INTERRUPT_MODES):
            chunk = versions[index * settings.updates_per_mode : (index + 1) * settings.updates_per_mode]
            stalls.append(await measure_stalls(server.handle, prompt, mode, store_uri, chunk, str(work / "cache")))
        return throughput, stalls

    started = time.perf_counter()
    with RolloutServer(config) as server:
        start_s = time.perf_counter() - started
        throughput, stalls = asyncio.run(measure(server))
    return {
        "settings": asdict(settings),
        "server_start_s": start_s,
        "engine_core_forked": FORK_ENGINE_CORE_ENV in server_env(config),
        "length_mean": statistics.fmean(lengths),
        "length_p90": sorted(lengths)[int(0.9 * (len(lengths) - 1))],
        "throughput": [asdict(row) for row in throughput],
        "update_stall": [asdict(row) for row in stalls],
    }


def format_tables(result: dict[str, Any]) -> str:
    settings = result["settings"]
    where = "in the engine-core process" if settings["worker_in_engine_process"] else "in its own process"
    started = "forked" if result["engine_core_forked"] else "spawned"
    lines = [
        f"server start: {result['server_start_s']:.1f} s (model worker {where}, engine core {started})",
        f"workload: {settings['requests']} requests, output length mean {result['length_mean']:.0f}, "
        f"p90 {result['length_p90']} (long-tailed, ignore_eos)",
        "",
        "| concurrency | output tokens | seconds | tokens/s |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['concurrency']} | {r['output_tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} |"
              for r in result["throughput"]]
    lines += ["", "| interrupt mode | updates | fetch before pause (s) | stall mean (s) | stall p50 (s) | stall max (s) "
              "| pause (s) | load (s) | version + resume (s) | stall / load | interrupted |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['updates']} | {r['prefetch_s_mean']:.3f} | {r['stall_s_mean']:.3f} | "
              f"{r['stall_s_p50']:.3f} | {r['stall_s_max']:.3f} | {r['pause_s_mean']:.3f} | {r['load_s_mean']:.3f} | "
              f"{r['resume_s_mean']:.3f} | {r['stall_over_load']:.2f} | {r['interrupted_mean']:.1f} |"
              for r in result["update_stall"]]
    return "\n".join(lines)


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    settings = RolloutBenchSettings(
        concurrencies=tuple(args.concurrency), requests=args.requests, max_tokens=args.max_tokens,
        updates_per_mode=args.updates, seed=args.seed, worker_in_engine_process=not args.worker_in_own_process,
        fork_engine_core=not args.spawn_engine_core,
    )
    result = run_rollout_bench(Path(args.model) if args.model else None, settings,
                               Path(args.work_dir) if args.work_dir else None)
    print(format_tables(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
