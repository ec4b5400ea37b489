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
from asyncrl.bench.ablation import relocated
from asyncrl.bench.bench_config import config_and_overrides, load_bench_config
from asyncrl.bench.e2e_settings import DEFAULT_CONFIG, E2EBenchSettings, Workload, check_not_swept, concurrency

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


def prepare_workload(work: Path, config: RunConfig, n_prompts: int, code_share: float = 0.0) -> Workload:
    """The tiny model, ``n_prompts`` synthetic prompts with their budgets (column
    ``max_new_tokens``, the longest ``rollout.max_new_tokens``), and group k's prompt and budget
    exactly as the scheduler will draw them (k < ``trainer.max_steps`` * ``trainer.batch_groups``,
    seeded by ``seed``). With ``code_share`` > 0 the prompt file is a mixture (weights
    1 - code_share and code_share) of the arithmetic file and a synthetic code file; budgets
    follow the reference programs."""
    import yaml

    from asyncrl.tasks.data.records import sample_budget
    from asyncrl.tasks.scheduler.group_schedule import PromptSchedule
    from asyncrl.tasks.model.codec import load_codec
    from asyncrl.tasks.data.loader import load_prompts
    from asyncrl.tasks.data.prompting import render_prompt
    from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, write_problems
    from asyncrl.tasks.data.synthetic_code import make_code_dataset, write_code_problems
    from asyncrl.tasks.model.tiny import write_tiny_model

    if not 0.0 <= code_share < 1.0:
        raise ValueError(f"code_share: must be in [0, 1), got {code_share}")
    seed, max_new_tokens, max_prompt_tokens = config.seed, config.rollout.max_new_tokens, config.data.max_prompt_tokens
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, seed=seed, overwrite=True)
    codec, _ = load_codec(str(model_dir))
    n_code = round(n_prompts * code_share)
    problems = make_arithmetic_dataset(n_prompts - n_code, seed)
    train_path = write_problems(work / "data" / "train.parquet", problems)
    _write_with_budgets(train_path, [len(codec.encode(p.solution)) for p in problems], max_new_tokens)
    if n_code:
        programs = make_code_dataset(n_code, seed)
        code_path = write_code_problems(work / "data" / "code.parquet", programs)
        _write_with_budgets(code_path, [len(codec.encode(p.solution)) for p in programs], max_new_tokens)
        mixture = {
            "seed": seed,
            "sources": [
                {"path": train_path.name, "weight": 1.0 - code_share},
                {"path": code_path.name, "weight": code_share},
            ],
        }
        train_path = work / "data" / "mixture.yaml"
        train_path.write_text(yaml.safe_dump(mixture))

    schedule = PromptSchedule(load_prompts(train_path), seed=seed)
    records = [schedule.record(k) for k in range(config.trainer.max_steps * config.trainer.batch_groups)]
    prompts = tuple(tuple(codec.encode(render_prompt(r.prompt, "plain"))) for r in records)
    too_long = [len(p) for p in prompts if len(p) > max_prompt_tokens]
    if too_long:
        raise ValueError(f"data.max_prompt_tokens: a prompt has {max(too_long)} tokens, over {max_prompt_tokens}")
    return Workload(
        model_dir=model_dir,
        train_path=train_path,
        prompts=prompts,
        budgets=tuple(sample_budget(r, max_new_tokens) for r in records),
        code_groups=sum(r.task == "code" for r in records),
    )


def measure_standalone(workload: Workload, settings: E2EBenchSettings, base: RunConfig, work: Path) -> dict[str, Any]:
    """The rollout server alone (launched as the eta = 0 run's, :func:`standalone_server_config`):

        T_gen = seconds to generate the ``steps`` batches one after the other, each batch's
                B * n samples in flight together (what a synchronous system waits for)
        tokens/s at concurrency c = all steps * B * n samples with at most c in flight
                (``measure_throughput`` of ``asyncrl bench rollout``), for each run's c
                (:func:`~asyncrl.bench.e2e_settings.concurrency`)

    Each batch's requests use the prompt of its first group (prefill is a few dozen tokens;
    decoding the budgets dominates); EOS is ignored, as in the runs."""
    from asyncrl.bench.rollout import measure_throughput
    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.inference.server import RolloutServer

    config = standalone_server_config(bench_run_config(base, workload, work, 0, settings.modes[0]), work)
    n = base.rollout.n_samples
    batches = workload.batches(base.trainer.batch_groups)
    all_lengths = [workload.budgets[k] for k in range(len(workload.budgets)) for _ in range(n)]
    concurrencies = sorted({min(concurrency(base, eta), len(all_lengths)) for eta in settings.etas})

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


def standalone_server_config(run: RunConfig, work: Path, machine: Machine | None = None) -> RolloutServerConfig:
    """A server alone: launched as ``run``'s server is on ``machine`` (default: this one;
    :func:`~asyncrl.tasks.placement.launch_settings.server_config`: its CPUs, or its GPU with
    CUDA graphs and its share of a shared GPU's memory), on a free port, with its log in
    ``work/standalone/server.log``."""
    from asyncrl.tasks.placement.launch_settings import server_config
    from asyncrl.tasks.system.run_paths import run_paths

    launch = server_config(run, run_paths(run), Path(run.model.path), 0, machine)
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


def workload_run(base: RunConfig, workload: Workload, work: Path, name: str) -> dict[str, Any]:
    """``base`` as a dict, renamed ``name``, under ``work/runs`` (``relocated``), on the
    workload's model and prompts, on a free port, with MLflow in ``work``: what every bench run
    of the workload sets."""
    from asyncrl.tasks.inference.server_ports import free_port

    raw = relocated(base, work, name)
    raw["model"]["path"] = str(workload.model_dir)
    raw["data"]["train_path"] = str(workload.train_path)
    raw["inference"]["base_port"] = free_port(base.inference.host)
    raw["tracking"]["mlflow_uri"] = f"sqlite:///{work / 'mlflow.db'}"
    return raw


def bench_run_config(base: RunConfig, workload: Workload, work: Path, eta: int, mode: str) -> RunConfig:
    """One configuration's run (:func:`workload_run`, named ``<name>-eta<eta>-<mode>``): ``base``
    with only eta and the interrupt mode changed, and no checkpoint inside the timed phase
    (``trainer.checkpoint_every`` = ``trainer.max_steps`` + 1)."""
    from asyncrl.configs.loading import config_from_dict

    name = f"{base.name}-eta{eta}-{mode}"
    raw = workload_run(base, workload, work, name)
    raw["rollout"].update(eta=eta, interrupt_mode=mode)
    raw["trainer"]["checkpoint_every"] = base.trainer.max_steps + 1
    return config_from_dict(raw, source=f"bench e2e ({name})")


def workload_summary(workload: Workload, n_samples: int) -> dict[str, Any]:
    """Groups, samples (``n_samples`` per group), output tokens and the budgets' spread."""
    budgets = sorted(workload.budgets)
    return {
        "groups": len(budgets),
        "samples": len(budgets) * n_samples,
        "output_tokens": sum(budgets) * n_samples,
        "budget_mean": statistics.fmean(budgets),
        "budget_p50": budgets[len(budgets) // 2],
        "budget_p90": budgets[int(0.9 * (len(budgets) - 1))],
        "budget_max": budgets[-1],
        "code_groups": workload.code_groups,
    }


def run_e2e_bench(
    settings: E2EBenchSettings, base: RunConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Standalone measurement, then every configuration of ``settings.sweep()``, each a run of
    ``base`` (:func:`bench_run_config`); returns the result (see :func:`format_tables`), with
    ``base`` as ``config``. A configuration that fails is recorded with its ``error`` and the
    sweep goes on."""
    from asyncrl.configs.loading import public_dict
    from asyncrl.tasks.launch.rl import train_run
    from asyncrl.tasks.trainer.jit_ops import ensure_jit_ops_built

    say = progress or (lambda line: None)
    work = settings.work_dir or Path(tempfile.mkdtemp(prefix="asyncrl-bench-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    # A fresh environment compiles DeepSpeed's CPU collective op in its first trainer start
    # (a long wait): built here, it stays out of the first run's wall.
    say(ensure_jit_ops_built())
    workload = prepare_workload(work, base, settings.n_prompts, settings.code_share)
    say(f"workload ready in {work}; measuring the standalone server")
    standalone = measure_standalone(workload, settings, base, work)
    say(f"standalone: T_gen {standalone['t_gen_s']:.1f} s")
    result: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "config": public_dict(base),
        "work_dir": str(work),
        "workload": workload_summary(workload, base.rollout.n_samples),
        "standalone": standalone,
    }
    runs: list[dict[str, Any]] = []
    sweep = settings.sweep()
    for index, (eta, mode) in enumerate(sweep, start=1):
        config = bench_run_config(base, workload, work, eta, mode)
        in_flight = concurrency(base, eta)
        try:
            train = train_run(config)
            run = run_figures(
                eta, mode, train.step_metrics, train.scheduler, train.ready_at,
                standalone_tokens_per_s(standalone, in_flight),
            )  # fmt: skip
            run["train_run_wall_s"] = train.wall_s
            run["t_gen_s"] = standalone_gen_s(standalone, eta, in_flight)
        except Exception as exc:  # noqa: BLE001 - recorded; the other configurations still run
            run = {"eta": eta, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:4000]}
        runs.append(run)
        result.update(compare_runs(runs, standalone["t_gen_s"]))
        if settings.json_path is not None:
            settings.json_path.write_text(json.dumps(result, indent=1))
        say(f"[{index}/{len(sweep)}] eta={eta} {mode}: " + (run.get("error") or f"wall {run['wall_s']:.1f} s"))
    return result


# ----- the command line -----


def settings_from_args(args: argparse.Namespace) -> E2EBenchSettings:
    """The bench's own settings of ``asyncrl bench e2e`` (its parser: ``cli/bench.py``)."""
    return E2EBenchSettings(
        workload=args.workload,
        etas=args.etas,
        modes=args.modes,  # type: ignore[arg-type]  # checked by the settings
        gpus=args.gpus,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        json_path=Path(args.json) if args.json else None,
    )


def config_from_args(args: argparse.Namespace, settings: E2EBenchSettings) -> RunConfig:
    """The run config every run starts from: CONFIG or ``--config`` (default
    :data:`~asyncrl.bench.e2e_settings.DEFAULT_CONFIG`), the workload's and ``--gpus``'
    overrides, then the user's KEY=VALUE overrides."""
    path, overrides = config_and_overrides(args.config, args.overrides, DEFAULT_CONFIG)
    check_not_swept(overrides)
    return load_bench_config(path, settings.presets(), overrides)


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    base = config_from_args(args, settings)
    result = run_e2e_bench(settings, base, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_tables(result))
    print(json.dumps(result))
    return 1 if any("error" in r for r in result["runs"]) else 0
