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
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.bench.e2e_figures import compare_runs, run_figures, solution_budgets
from asyncrl.bench.e2e_report import format_tables
from asyncrl.bench.e2e_settings import E2EBenchSettings, WORKLOADS, Workload
from asyncrl.bench.sweep_checks import parse_int_list

if TYPE_CHECKING:
    from asyncrl.configs.run_config import RunConfig
    from asyncrl.tasks.inference.server_config import RolloutServerConfig
    from asyncrl.tasks.placement.devices import Machine


# ----- the workload, the standalone measurement, the runs -----


def _write_with_budgets(path: Path, solution_tokens: Sequence[int], max_new_tokens: int) -> None:
    """Add the column ``max_new_tokens`` (:func:`solution_budgets`) to the Parquet at ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.tasks.data.formats import BUDGET_FIELD

    budgets = solution_budgets(solution_tokens, max_new_tokens)
    table = pq.read_table(path).append_column(BUDGET_FIELD, pa.array(budgets, pa.int32()))
    pq.write_table(table, path)


def prepare_workload(work: Path, settings: E2EBenchSettings) -> Workload:
    """The tiny model, the synthetic prompts with their budgets (column ``max_new_tokens``),
    and group k's prompt and budget exactly as the scheduler will draw them. With
    ``code_share`` > 0 the prompt file is a mixture (weights 1 - code_share and code_share)
    of the arithmetic file and a synthetic code file; budgets follow the reference programs."""
    import yaml

    from asyncrl.tasks.data.records import sample_budget
    from asyncrl.tasks.scheduler.group_schedule import PromptSchedule
    from asyncrl.tasks.model.codec import load_codec
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
    this one; :func:`~asyncrl.tasks.placement.launch_settings.server_config`: its CPUs, or its GPU
    with CUDA graphs and its share of a shared GPU's memory), on a free port, with its log in
    ``standalone/server.log``."""
    from asyncrl.tasks.placement.launch_settings import server_config
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
    from asyncrl.tasks.inference.server_ports import free_port

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
                "n_samples": settings.n_samples,
                "max_new_tokens": settings.max_new_tokens,
                "eta": eta,
                "interrupt_mode": mode,
                "ignore_eos": True,
                "shard_groups": 1,  # every finished group is written at once: no batching delay
                "shard_seconds": 1.0,
                "max_groups_in_flight": settings.max_groups_in_flight,
            },
            "inference": {
                "base_port": free_port("127.0.0.1"),
                "kv_cache_gib": settings.kv_cache_gib,
                **placement["inference"],
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


# ----- the command line -----


def _cores(text: str) -> tuple[int, ...] | None:
    return None if text.strip().lower() == "none" else parse_int_list(text)


def auto_cores(text: str, default: tuple[int, ...] | None, gpus: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """CPU ids of ``--rollout-cores`` / ``--trainer-cores``: 'auto' is ``default`` (half the
    CPUs each) without ``--gpus`` and no pinning with it."""
    if text == "auto":
        return default if gpus is None else None
    return _cores(text)


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
