"""``asyncrl bench scale``: how the costs of the RL loop grow with the model.

For Qwen2 shapes from ~5 M to 0.5 B parameters (:data:`SIZE_SPECS`, Qwen2.5's real
vocabulary, random weights written locally), each size runs a few real RL steps through the
real run (:func:`~asyncrl.tasks.launch.rl.train_run`: vLLM server, reward service, DeepSpeed
trainer, weight publish and in-place load, built as ``asyncrl bench e2e`` builds its runs)
while every component's memory is sampled, then times ``asyncrl bench weight-sync``'s
publish, fetch and load of fresh versions into a server of the same launch. Reported per
size: parameters, trainer step and tokens/s, publish / fetch / load and GB/s, update stall,
peak RSS of each component, checkpoint bytes; across sizes the exponent k of each cost
(cost ~ params^k). Figures: ``bench/scale_figures.py``; definitions: ``docs/internals/bench.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.bench.bench_config import config_and_overrides, load_bench_config
from asyncrl.bench.e2e import prepare_workload, standalone_server_config, workload_run
from asyncrl.bench.e2e_settings import N_PROMPTS, Workload
from asyncrl.bench.scale_figures import (
    memory_figures,
    scaling_exponents,
    stall_figures,
    trainer_figures,
    weight_sync_figures,
)
from asyncrl.bench.scale_report import format_tables, plot_curves
from asyncrl.bench.scale_settings import DEFAULT_CONFIG, SIZE_SPECS, ScaleBenchSettings, parse_sizes

if TYPE_CHECKING:
    from asyncrl.configs.run_config import RunConfig
    from asyncrl.storage.fs import RunRoot
    from asyncrl.tasks.model.tiny import TinyModelSpec


def ensure_model(model_dir: Path, spec: TinyModelSpec, seed: int, dtype: str) -> Path:
    """The size's checkpoint (:func:`~asyncrl.tasks.model.tiny.write_qwen2_model`, random, in
    ``dtype``, the run's ``model.dtype``, in which the trainer publishes: the base and every
    version have the same bytes): written once; kept when a reused ``--work-dir`` already holds
    one of the same shape and dtype (writing 0.5 B takes minutes), rewritten otherwise."""
    from asyncrl.tasks.model.tiny import write_qwen2_model

    config_file = model_dir / "config.json"
    if config_file.is_file():
        found = json.loads(config_file.read_text())
        wanted = {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
                  "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                  "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size}  # fmt: skip
        if all(found.get(key) == value for key, value in wanted.items()) and found.get("dtype") == dtype:
            return model_dir
    return write_qwen2_model(model_dir, spec, seed=seed, dtype=dtype, overwrite=True)


def scale_run_config(base: RunConfig, workload: Workload, size_dir: Path, size: str) -> RunConfig:
    """The size's run (:func:`~asyncrl.bench.e2e.workload_run` under ``size_dir``, named
    ``<name>-<size>``) with one checkpoint, at the last step (``trainer.checkpoint_every`` =
    ``trainer.max_steps``; its bytes and seconds are reported)."""
    from asyncrl.configs.loading import config_from_dict

    raw = workload_run(base, workload, size_dir, f"{base.name}-{size}")
    raw["trainer"]["checkpoint_every"] = base.trainer.max_steps
    return config_from_dict(raw, source=f"bench scale ({size})")


def checkpoint_bytes(root: RunRoot) -> int | None:
    """Bytes of the newest complete checkpoint (the sizes its manifest lists); None without one."""
    from asyncrl.tasks.trainer.checkpoint import complete_checkpoints, read_manifest

    steps = complete_checkpoints(root)
    return sum(int(size) for size in read_manifest(root, steps[-1])["files"].values()) if steps else None


def measure_weight_sync(config: RunConfig, size_dir: Path, repeats: int) -> dict[str, Any]:
    """``asyncrl bench weight-sync``'s phases (:func:`~asyncrl.bench.weight_sync.bench_backend`)
    for ``repeats`` fresh versions of the size's checkpoint, on a local store, into a rollout
    server launched as the size's run's (``config``) is (:func:`standalone_server_config`)."""
    from asyncrl.bench.weight_sync import bench_backend, local_backend
    from asyncrl.bench.weight_sync_settings import WeightSyncBenchSettings
    from asyncrl.tasks.inference.server import RolloutServer

    work = size_dir / "weight-sync"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = replace(standalone_server_config(config, size_dir), log_path=work / "server.log")
    # bench_backend reads the versions' count, seed and the server's dtype of these settings.
    settings = WeightSyncBenchSettings(repeats=repeats, seed=config.seed, server_dtype=config.model.dtype)
    with RolloutServer(server) as running:
        seconds, loads, version_bytes, zero_copy = bench_backend(
            local_backend(work), running.handle, Path(config.model.path), work, settings, first_version=1
        )
    return {
        "seconds": seconds,
        "version_bytes": version_bytes,
        "zero_copy_fetch": zero_copy,
        "hashes_verified": bool(loads) and all(load["hashes_verified"] for load in loads),
    }


def measure_size(
    size: str, settings: ScaleBenchSettings, base: RunConfig, work: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """One size: its model and workload, the RL run of ``base`` under the memory sampler, then
    the weight-sync phases; the figures (``bench/scale_figures.py``) and what they came from."""
    from asyncrl.bench.process_memory import MemorySampler
    from asyncrl.tasks.launch.rl import PROCESS_GROUPS_FILE, train_run
    from asyncrl.tasks.system.run_paths import run_paths

    spec = SIZE_SPECS[size]
    size_dir = work / size
    started = time.perf_counter()
    ensure_model(size_dir / "model", spec, base.seed, base.model.dtype)
    workload = prepare_workload(size_dir, base, N_PROMPTS)
    timing = {"prepare_s": time.perf_counter() - started}
    say(f"{size}: model and workload ready in {timing['prepare_s']:.0f} s; the RL run")
    config = scale_run_config(base, workload, size_dir, size)
    shutil.rmtree(size_dir / "runs", ignore_errors=True)  # a finished run left here would train nothing
    paths = run_paths(config)
    with MemorySampler(paths.work_dir / PROCESS_GROUPS_FILE, settings.sample_s) as sampler:
        train = train_run(config)
    timing["run_s"] = train.wall_s
    if len(train.step_metrics) < config.trainer.max_steps:
        raise RuntimeError(f"the run trained {len(train.step_metrics)} of {config.trainer.max_steps} steps (see {paths.work_dir})")
    say(f"{size}: RL run done in {train.wall_s:.0f} s; publish, fetch and load of {settings.repeats} versions")
    started = time.perf_counter()
    sync = measure_weight_sync(config, size_dir, settings.repeats)
    timing["weight_sync_s"] = time.perf_counter() - started
    parameters = spec.num_parameters()
    figures: dict[str, float | None] = {
        **trainer_figures(train.step_metrics),
        **stall_figures(train.scheduler),
        **weight_sync_figures(sync["seconds"], sync["version_bytes"]),
    }
    saved = checkpoint_bytes(paths.root)
    figures["checkpoint_bytes"] = None if saved is None else float(saved)
    figures.update(memory_figures(sampler.peaks(), parameters, config.model.dtype, float(figures["micro_batch_tokens"] or 0)))
    return {
        "figures": figures,
        "memory": sampler.peaks(),
        "memory_samples": sampler.samples,
        "logit_chunk_tokens": config.trainer.logit_chunk_tokens,
        "weight_sync": sync,
        "hashes_verified": sync["hashes_verified"],
        "restarts": train.restarts,
        "timing": timing,
        "run_dir": str(paths.work_dir),
    }


def run_scale_bench(
    settings: ScaleBenchSettings, base: RunConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every size of ``settings.sizes``, smallest first, each a run of ``base``
    (:func:`scale_run_config`), then the exponents; returns the result (see
    :func:`format_tables`), with ``base`` as ``config``, written to ``settings.json_path`` after
    each size. A size that fails is recorded with its ``error`` and the others still run."""
    from asyncrl.configs.loading import public_dict
    from asyncrl.tasks.trainer.jit_ops import ensure_jit_ops_built

    say = progress or (lambda line: None)
    work = settings.work_dir or Path(tempfile.mkdtemp(prefix="asyncrl-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    say(ensure_jit_ops_built())
    result: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "config": public_dict(base),
        "work_dir": str(work),
        "dtype": base.model.dtype,
        "sizes": [],
        "exponents": {},
    }
    for index, size in enumerate(settings.sizes, start=1):
        spec = SIZE_SPECS[size]
        entry: dict[str, Any] = {"size": size, "parameters": spec.num_parameters(), "shape": asdict(spec)}
        started = time.perf_counter()
        try:
            entry.update(measure_size(size, settings, base, work, say))
        except Exception as exc:  # noqa: BLE001 - recorded; the other sizes still run
            entry["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        entry["wall_s"] = time.perf_counter() - started
        result["sizes"].append(entry)
        result["exponents"] = scaling_exponents([e for e in result["sizes"] if "error" not in e])
        if settings.json_path is not None:
            settings.json_path.write_text(json.dumps(result, indent=1))
        say(f"[{index}/{len(settings.sizes)}] {size}: " + (entry.get("error") or f"done in {entry['wall_s']:.0f} s"))
    return result


# ----- the command line -----


def settings_from_args(args: argparse.Namespace) -> ScaleBenchSettings:
    """The bench's own settings of ``asyncrl bench scale`` (its parser: ``cli/bench.py``);
    ``ValueError`` naming the option when one is wrong."""
    return ScaleBenchSettings(
        sizes=parse_sizes(args.sizes),
        repeats=args.repeats,
        gpus=args.gpus,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        json_path=Path(args.json) if args.json else None,
        png_path=Path(args.png) if args.png else None,
    )


def config_from_args(args: argparse.Namespace, settings: ScaleBenchSettings) -> RunConfig:
    """The run config every size's run starts from: CONFIG or ``--config`` (default
    :data:`~asyncrl.bench.scale_settings.DEFAULT_CONFIG`), ``--gpus``' overrides, then the
    user's KEY=VALUE overrides."""
    path, overrides = config_and_overrides(args.config, args.overrides, DEFAULT_CONFIG)
    return load_bench_config(path, settings.presets(), overrides)


def cmd_bench_scale(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        base = config_from_args(args, settings)
    except ValueError as exc:  # a ConfigError too: it names the file and the key
        print(f"bench scale: {exc}", file=sys.stderr)
        return 2
    result = run_scale_bench(settings, base, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_tables(result))
    print(json.dumps(result))
    if settings.png_path is not None:
        print(f"curves: {plot_curves(result, settings.png_path)}", file=sys.stderr)
    failed = [e["size"] for e in result["sizes"] if "error" in e or not e.get("hashes_verified")]
    return 1 if failed else 0
