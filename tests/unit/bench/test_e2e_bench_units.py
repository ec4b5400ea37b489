"""The figures of `asyncrl bench e2e` on hand-made inputs, its settings, its run config and its
report (the measurement itself runs in tests/e2e/bench/test_e2e_bench.py and `asyncrl bench e2e`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from asyncrl.bench.bench_config import config_and_overrides, gpu_overrides, is_placed, split_cores
from asyncrl.bench.e2e import config_from_args, settings_from_args, standalone_gen_s, standalone_tokens_per_s
from asyncrl.bench.e2e_report import format_tables
from asyncrl.bench.e2e_figures import (
    compare_runs,
    first_batch_wait_s,
    mean_packing_efficiency,
    overlap_bound,
    run_limit_s,
    rl_wall_s,
    run_figures,
    solution_budgets,
    staleness_counts,
    trained_tokens,
    trainer_idle_s,
    training_only_s,
)
from asyncrl.bench.e2e_settings import DEFAULT_CONFIG, E2EBenchSettings, Workload, concurrency
from asyncrl.cli.main import build_parser, main, parse_command_line
from asyncrl.configs.loading import ConfigError
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.system.process_group import usable_cpus
from asyncrl.configs.cpus import machine_cpus

READY = 1_000.0


def step(time_s: float, tokens: float, step_time: float, packing: float, counts: dict[int, int],
         dropped: int = 0) -> dict[str, float]:
    """One step's metrics as the trainer writes them (only the fields the figures read, plus noise)."""
    metrics = {"time": READY + time_s, "sequence_tokens": tokens, "step_time_s": step_time,
               "packing_efficiency": packing, "dropped_stale": float(dropped), "loss": 0.0,
               "staleness_max": float(max(counts))}
    metrics.update({f"staleness/count_{s}": float(c) for s, c in counts.items()})
    return metrics


STEPS = {
    1: step(10.0, 1000, 4.0, 0.9, {0: 8}),
    2: step(25.0, 1500, 5.0, 0.8, {0: 4, 1: 4}),
    3: step(40.0, 500, 3.0, 0.7, {1: 6, 2: 2}, dropped=2),
}


def test_wall_time_is_ready_to_last_step() -> None:
    assert rl_wall_s(STEPS, READY) == pytest.approx(40.0)
    assert rl_wall_s({2: STEPS[2], 1: STEPS[1]}, READY) == pytest.approx(25.0)  # the latest, whatever the order
    with pytest.raises(ValueError, match="no step"):
        rl_wall_s({}, READY)


def test_tokens_step_times_packing_and_staleness_sum_over_steps() -> None:
    assert trained_tokens(STEPS) == 3000
    assert training_only_s(STEPS) == pytest.approx(12.0)
    assert mean_packing_efficiency(STEPS) == pytest.approx(0.8)
    assert staleness_counts(STEPS) == {0: 12, 1: 10, 2: 2}
    assert list(staleness_counts({1: STEPS[3], 2: STEPS[1]})) == [0, 1, 2]  # sorted by staleness


def test_wall_splits_into_fill_steps_and_idle() -> None:
    # step 1 ended at 10 s after 4 s of work: the trainer began at 6 s; 40 s = 6 + 12 + 22
    assert first_batch_wait_s(STEPS, READY) == pytest.approx(6.0)
    assert trainer_idle_s(STEPS, READY) == pytest.approx(22.0)
    assert first_batch_wait_s({3: STEPS[3], 2: STEPS[2]}, READY) == pytest.approx(20.0)  # the lowest step number
    no_waits = {1: step(4.0, 10, 4.0, 1.0, {0: 1}), 2: step(9.0, 10, 5.0, 1.0, {0: 1})}
    assert (first_batch_wait_s(no_waits, READY), trainer_idle_s(no_waits, READY)) == pytest.approx((0.0, 0.0))
    with pytest.raises(ValueError, match="no step"):
        first_batch_wait_s({}, READY)


def test_overlap_bound() -> None:
    assert overlap_bound(10.0, 10.0) == pytest.approx(2.0)
    assert overlap_bound(30.0, 10.0) == pytest.approx(4 / 3)
    assert overlap_bound(10.0, 30.0) == pytest.approx(4 / 3)
    assert overlap_bound(5.0, 0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="T_gen"):
        overlap_bound(0.0, 0.0)
    with pytest.raises(ValueError, match="T_gen"):
        overlap_bound(-1.0, 2.0)


def test_run_figures() -> None:
    scheduler = {"gen_tokens_per_s": 300.0, "streamed_tokens_per_s": 360.0, "weight_sync_stall_fraction": 0.05,
                 "weight_updates": 3}
    figures = run_figures(2, "keep", STEPS, scheduler, READY, standalone_tokens_per_s=600.0)
    assert figures["wall_s"] == pytest.approx(40.0)
    assert (figures["first_batch_wait_s"], figures["trainer_idle_s"]) == pytest.approx((6.0, 22.0))
    assert figures["trained_tokens_per_s"] == pytest.approx(3000 / 40)
    assert figures["rollout_utilisation"] == pytest.approx(0.6)  # streamed (server work), not only finished
    assert figures["gen_tokens_per_s"] == pytest.approx(300.0)
    assert figures["weight_sync_stall_fraction"] == pytest.approx(0.05)
    assert figures["packing_efficiency"] == pytest.approx(0.8)
    assert figures["staleness_max"] == 2
    assert figures["staleness_counts"] == {0: 12, 1: 10, 2: 2}
    assert figures["dropped_stale"] == 2
    assert (figures["eta"], figures["mode"], figures["steps"], figures["weight_updates"]) == (2, "keep", 3, 3)


def test_run_figures_refuse_a_scheduler_that_recorded_nothing() -> None:
    with pytest.raises(ValueError, match="recorded no controller cycle"):
        run_figures(2, "keep", STEPS, {}, READY, standalone_tokens_per_s=600.0)


def run_row(eta: int, wall: float, training: float = 12.0, **extra: Any) -> dict[str, Any]:
    return {"eta": eta, "mode": "recompute", "wall_s": wall, "training_only_s": training, **extra}


def test_speedup_and_efficiency_against_each_runs_own_limit() -> None:
    runs = [run_row(0, 60.0, training=20.0), run_row(2, 40.0), run_row(4, 30.0)]
    compared = compare_runs(runs, t_gen=30.0)
    assert compared["t_train_s"] == pytest.approx(20.0)  # eta = 0's training time, not the others'
    assert compared["ideal_sync_s"] == pytest.approx(50.0)
    assert compared["overlap_bound"] == pytest.approx(50.0 / 30.0)
    rows = compared["runs"]
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.5, 2.0])
    assert [r["speedup_over_ideal_sync"] for r in rows] == pytest.approx([50 / 60, 50 / 40, 50 / 30])
    # sync: limit T_gen + T_train; async: max(T_gen, the run's own T_train = 12)
    assert [r["limit_s"] for r in rows] == pytest.approx([50.0, 30.0, 30.0])
    assert [r["efficiency"] for r in rows] == pytest.approx([50 / 60, 30 / 40, 1.0])
    slow_trainer = compare_runs([run_row(0, 60.0, training=20.0), run_row(2, 40.0, training=35.0)], t_gen=30.0)
    assert slow_trainer["runs"][1]["limit_s"] == pytest.approx(35.0)  # its own training time, not eta 0's
    assert "speedup" not in runs[1]  # the inputs are not modified


def test_an_async_runs_limit_uses_generation_at_its_own_concurrency() -> None:
    runs = [run_row(0, 60.0, training=20.0), run_row(2, 25.0, t_gen_s=24.0)]
    rows = compare_runs(runs, t_gen=30.0)["runs"]
    assert rows[0]["limit_s"] == pytest.approx(50.0)  # batch by batch: T_gen = 30
    assert rows[1]["limit_s"] == pytest.approx(24.0) and rows[1]["efficiency"] == pytest.approx(24 / 25)
    assert rows[1]["speedup_over_ideal_sync"] == pytest.approx(50 / 25)  # against batch-by-batch T_gen + T_train


def test_standalone_generation_time_per_configuration() -> None:
    standalone = {"t_gen_s": 30.0, "throughput": [{"concurrency": 16, "tokens_per_s": 500.0, "seconds": 26.0},
                                                   {"concurrency": 48, "tokens_per_s": 800.0, "seconds": 16.0}]}
    assert standalone_gen_s(standalone, 0, 16) == 30.0
    assert standalone_gen_s(standalone, 2, 48) == 16.0
    assert standalone_gen_s(standalone, 8, 144) == 16.0  # the largest measured concurrency <= c


def test_run_limit() -> None:
    assert run_limit_s(0, 30.0, 20.0) == pytest.approx(50.0)
    assert run_limit_s(1, 30.0, 20.0) == pytest.approx(30.0)
    assert run_limit_s(4, 10.0, 20.0) == pytest.approx(20.0)


def test_no_speedup_without_a_successful_synchronous_run() -> None:
    failed = {"eta": 0, "mode": "recompute", "error": "ComponentFailed: trainer failed"}
    compared = compare_runs([failed, run_row(2, 40.0)], t_gen=30.0)
    assert compared["t_train_s"] is None and compared["overlap_bound"] is None and compared["ideal_sync_s"] is None
    assert all("speedup" not in r and "efficiency" not in r for r in compared["runs"])
    compared = compare_runs([run_row(0, 60.0), {"eta": 1, "mode": "keep", "error": "boom"}], t_gen=30.0)
    assert "speedup" not in compared["runs"][1]


def test_budgets_follow_the_solution_lengths() -> None:
    assert solution_budgets([10, 20, 40, 5], 256) == [64, 128, 256, 32]
    assert solution_budgets([1, 1000], 16) == [1, 16]  # never below 1 token
    assert solution_budgets([], 16) == []


def test_standalone_throughput_is_taken_at_the_runs_concurrency() -> None:
    standalone = {"throughput": [{"concurrency": c, "tokens_per_s": float(c)} for c in (48, 16, 32)]}
    assert standalone_tokens_per_s(standalone, 16) == 16.0
    assert standalone_tokens_per_s(standalone, 40) == 32.0
    assert standalone_tokens_per_s(standalone, 500) == 48.0
    assert standalone_tokens_per_s(standalone, 4) == 16.0  # below every measured one: the smallest


def parse(*argv: str) -> tuple[E2EBenchSettings, RunConfig]:
    """The settings and the base run config of ``asyncrl bench e2e ARGV``."""
    args = parse_command_line(build_parser(), ["bench", "e2e", *argv])  # KEY=VALUE after options too, as main
    settings = settings_from_args(args)
    return settings, config_from_args(args, settings)


def test_settings_sweep_and_concurrency() -> None:
    settings, config = parse("--etas", "0,1,2,4,8", "--modes", "recompute,keep")
    sweep = settings.sweep()
    assert sweep[0] == (0, "recompute") and len(sweep) == 9  # eta = 0 once, then 4 etas x 2 modes
    assert sweep[1:3] == [(1, "recompute"), (1, "keep")]
    assert (config.trainer.batch_groups, config.rollout.n_samples) == (4, 4)
    assert concurrency(config, 0) == 16 and concurrency(config, 2) == 48
    _, capped = parse("rollout.max_groups_in_flight=8")
    assert concurrency(capped, 0) == 16 and concurrency(capped, 4) == 32  # min((eta + 1) * B, 8) groups of 4


def test_no_argument_runs_the_bundled_config_with_todays_defaults() -> None:
    settings, config = parse()
    assert (settings.workload, settings.etas, settings.modes, settings.n_prompts) == ("balanced", (0, 1, 2, 4, 8), ("recompute", "keep"), 256)
    assert DEFAULT_CONFIG.name == "bench-e2e.yaml" and DEFAULT_CONFIG.is_file()
    assert (config.name, config.seed, config.trainer.max_steps, config.trainer.batch_groups) == ("bench-e2e", 0, 16, 4)
    assert (config.rollout.n_samples, config.rollout.max_new_tokens, config.data.max_prompt_tokens) == (4, 384, 64)
    assert (config.trainer.micro_batch_tokens, config.inference.kv_cache_gib, config.rollout.max_groups_in_flight) == (1024, 1.0, None)
    assert config.rollout.ignore_eos and config.reward.code.extract == "whole"


def test_config_file_and_overrides_from_the_command_line(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(DEFAULT_CONFIG.read_text().replace("max_steps: 16", "max_steps: 5"))
    assert config_and_overrides(None, [], DEFAULT_CONFIG) == (DEFAULT_CONFIG, [])
    assert config_and_overrides(None, [str(mine), "a.b=1"], DEFAULT_CONFIG) == (mine, ["a.b=1"])
    assert config_and_overrides(str(mine), ["a.b=1"], DEFAULT_CONFIG) == (mine, ["a.b=1"])
    with pytest.raises(ValueError, match="give it once"):
        config_and_overrides(str(mine), [str(mine)], DEFAULT_CONFIG)
    # CONFIG positional or --config; KEY=VALUE before or after the options
    for argv in ([str(mine), "rollout.n_samples=2", "--etas", "0,2"], ["--config", str(mine), "--etas", "0,2", "rollout.n_samples=2"]):
        settings, config = parse(*argv)
        assert (config.trainer.max_steps, config.rollout.n_samples, settings.etas) == (5, 2, (0, 2))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--steps", "3"], "--steps is now the run config key trainer.max_steps: pass trainer.max_steps=3"),
        (["--n-samples", "4"], "--n-samples is now the run config key rollout.n_samples: pass rollout.n_samples=4"),
        (["--batch-groups", "2"], "pass trainer.batch_groups=2"),
        (["--max-new-tokens", "96"], "pass rollout.max_new_tokens=96"),
        (["--seed", "1"], "--seed is now the run config key seed: pass seed=1"),
        (["--max-groups-in-flight", "8"], "pass rollout.max_groups_in_flight=8"),
        (["--rollout-cores", "0,1"], "--rollout-cores is now the run config key inference.cpu_cores: pass inference.cpu_cores=[0,1]"),
        (["--trainer-cores", "none"], "pass trainer.cpu_cores=null"),
    ],
)
def test_former_options_name_their_run_config_key(option: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "e2e", "--etas", "0,2", *option])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bad_overrides_name_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    for override, message in (("rollout.n_samples=0", "rollout.n_samples: Input should be greater than or equal to 1"),
                              ("trainer.bogus=1", "trainer.bogus: unknown key"),
                              ("rollout.max_new_tokens=2000", "trainer.micro_batch_tokens: 1024 is smaller")):  # fmt: skip
        assert main(["bench", "e2e", "--etas", "0,2", override]) == 2
        err = capsys.readouterr().err
        assert "bench-e2e.yaml: " in err and message in err, err
    assert main(["bench", "e2e", "--etas", "0,2", "rollout.eta=4"]) == 2
    assert "rollout.eta: the sweep sets it in every run; use --etas instead of 'rollout.eta=4'" in capsys.readouterr().err


def test_the_cap_on_groups_in_flight_reaches_every_run(tmp_path: Path) -> None:
    from asyncrl.bench.e2e import bench_run_config

    workload = Workload(tmp_path / "model", tmp_path / "train.parquet", ((1, 2),), (4,))
    _, capped = parse("rollout.max_groups_in_flight=8")
    assert bench_run_config(capped, workload, tmp_path, eta=4, mode="keep").rollout.max_groups_in_flight == 8
    _, default = parse()
    assert bench_run_config(default, workload, tmp_path, eta=4, mode="keep").rollout.max_groups_in_flight is None


def test_a_run_changes_only_eta_mode_names_and_paths(tmp_path: Path) -> None:
    from asyncrl.bench.e2e import bench_run_config

    workload = Workload(tmp_path / "model", tmp_path / "train.parquet", ((1, 2),), (4,))
    _, base = parse("trainer.max_steps=3", "seed=7")
    run = bench_run_config(base, workload, tmp_path, eta=2, mode="keep")
    assert (run.name, run.rollout.eta, run.rollout.interrupt_mode) == ("bench-e2e-eta2-keep", 2, "keep")
    assert (run.work_dir, run.storage.root) == (str(tmp_path / "runs"), str(tmp_path / "runs" / run.name / "store"))
    assert (run.model.path, run.data.train_path) == (str(workload.model_dir), str(workload.train_path))
    assert run.trainer.checkpoint_every == 4 and run.seed == 7  # no checkpoint inside the timed phase
    assert run.tracking.mlflow_uri == f"sqlite:///{tmp_path / 'mlflow.db'}" and run.tracking.experiment == "bench-e2e"
    assert run.trainer.model_dump(exclude={"checkpoint_every"}) == base.trainer.model_dump(exclude={"checkpoint_every"})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"workload": "huge"}, "workload"),
        ({"etas": (1, 2)}, "etas"),
        ({"etas": (0, -1)}, "etas"),
        ({"etas": (0, 2, 2)}, "etas"),
        ({"modes": ("recompute", "pause")}, "modes"),
        ({"modes": ()}, "modes"),
        ({"n_prompts": 0}, "n_prompts"),
        ({"gpus": ()}, "--gpus"),
        ({"gpus": (0, 1, 2)}, "--gpus"),
        ({"gpus": (-1,)}, "--gpus"),
    ],
)
def test_bad_settings_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        E2EBenchSettings(**overrides)


@pytest.mark.parametrize(("gpus", "devices", "shared"), [("0", (0, 0), True), ("2,3", (2, 3), False)])
def test_on_gpus_the_runs_and_the_standalone_server_get_the_same_devices(
    gpus: str, devices: tuple[int, int], shared: bool, tmp_path: Path
) -> None:
    from asyncrl.bench.e2e import bench_run_config, standalone_server_config
    from asyncrl.tasks.placement.devices import Machine

    settings, base = parse("--gpus", gpus)
    assert settings.gpus == tuple(map(int, gpus.split(","))) and is_placed(base)
    workload = Workload(tmp_path / "model", tmp_path / "train.parquet", ((1, 2),), (4,))
    run = bench_run_config(base, workload, tmp_path, eta=4, mode="keep")
    assert (run.inference.devices, run.trainer.devices) == ([(devices[0],)], (devices[1],))
    assert run.placement.share_devices is shared
    assert run.inference.cpu_cores is None and run.trainer.cpu_cores is None  # on GPUs no CPU is pinned
    # GPU ids are those this process sees: here CUDA_VISIBLE_DEVICES=4,5,6,7.
    gpu_machine = Machine(gpus=("4", "5", "6", "7"), gpu_source="fake: 4 GPUs")
    server = standalone_server_config(bench_run_config(base, workload, tmp_path, 0, "keep"), tmp_path, gpu_machine)
    assert server.cuda_visible_devices == str(4 + devices[0]) and server.cpu_cores is None
    # Launched as a run's server on a GPU machine: CUDA graphs, and the memory share when shared.
    assert server.enforce_eager is False
    assert server.gpu_memory_utilization == (0.45 if shared else None)
    assert (server.port, server.log_path) == (0, tmp_path / "standalone" / "server.log")
    _, on_cpus = parse("inference.cpu_cores=[0]", "trainer.cpu_cores=null")
    cpu_run = bench_run_config(on_cpus, workload, tmp_path, eta=0, mode="keep")
    cpu_server = standalone_server_config(cpu_run, tmp_path, Machine(gpus=(), cpus=machine_cpus()))
    assert (cpu_server.cpu_cores, cpu_server.cuda_visible_devices, cpu_server.enforce_eager) == ((0,), None, True)
    assert (cpu_run.inference.cpu_cores, cpu_run.inference.devices, cpu_run.trainer.devices) == ((0,), None, None)


def test_gpu_overrides() -> None:
    assert gpu_overrides(None) == []
    assert gpu_overrides((1,)) == ["inference.devices=[[1]]", "trainer.devices=[1]", "placement.share_devices=true"]
    assert gpu_overrides((0, 1))[-1] == "placement.share_devices=false"


def test_default_cores_split_the_usable_cpus() -> None:
    rollout, trainer = split_cores()
    cpus = sorted(usable_cpus())
    if len(cpus) < 2:
        assert (rollout, trainer) == (None, None)
    else:
        assert rollout is not None and trainer is not None
        assert sorted(rollout + trainer) == cpus and not set(rollout) & set(trainer)
        assert max(rollout) < min(trainer)


def test_the_cpus_are_split_unless_the_config_places_the_components() -> None:
    _, split = parse()
    rollout, trainer = split_cores()
    assert (split.inference.cpu_cores, split.trainer.cpu_cores) == (rollout, trainer)
    _, unpinned = parse("inference.cpu_cores=null")
    assert unpinned.inference.cpu_cores is None and unpinned.trainer.cpu_cores is None
    _, one = parse("trainer.cpu_cores=[0]")
    assert (one.inference.cpu_cores, one.trainer.cpu_cores) == (None, (0,))


def test_cli_options() -> None:
    args = build_parser().parse_args(["bench", "e2e", "--etas", "0,2", "--modes", "recompute", "--json", "out.json", "trainer.max_steps=3"])
    assert (args.etas, args.modes, args.json, args.overrides, args.config) == ((0, 2), ("recompute",), "out.json", ["trainer.max_steps=3"], None)
    defaults = build_parser().parse_args(["bench", "e2e"])
    assert defaults.etas == (0, 1, 2, 4, 8) and defaults.modes == ("recompute", "keep")
    assert defaults.workload == "balanced" and defaults.overrides == []
    assert build_parser().parse_args(["bench", "e2e", "--workload", "generation-bound"]).workload == "generation-bound"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "e2e", "--workload", "huge"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "e2e", "--etas", "0,x"])


def test_the_workloads_are_overrides_under_the_users() -> None:
    balanced, bound = parse()[1], parse("--workload", "generation-bound")[1]
    assert (balanced.rollout.max_new_tokens, balanced.trainer.micro_batch_tokens) == (384, 1024)
    assert (bound.rollout.max_new_tokens, bound.trainer.micro_batch_tokens) == (1536, 2048)
    longer = parse("--workload", "generation-bound", "rollout.max_new_tokens=2000", "trainer.micro_batch_tokens=2064")[1]
    assert (longer.rollout.max_new_tokens, longer.trainer.micro_batch_tokens) == (2000, 2064)  # the user's win
    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens: 2048 is smaller"):
        parse("--workload", "generation-bound", "rollout.max_new_tokens=2000")
    mixed_settings, mixed = parse("--workload", "mixed")
    assert (mixed_settings.code_share, mixed.data.max_prompt_tokens, mixed.trainer.micro_batch_tokens) == (0.5, 96, 1024)


def report_config(**rollout: Any) -> dict[str, Any]:
    """The parts of a result's run config (a public dict) the report reads."""
    return {"rollout": {"n_samples": 4, "max_groups_in_flight": None, **rollout},
            "trainer": {"max_steps": 8, "batch_groups": 4, "cpu_cores": [1], "devices": None},
            "inference": {"cpu_cores": [0], "devices": None}, "placement": {"share_devices": False}}  # fmt: skip


def test_report_has_every_run_and_the_bound() -> None:
    runs = [
        run_row(0, 60.0, training=20.0, trained_tokens_per_s=100.0, rollout_utilisation=0.31,
                weight_sync_stall_fraction=0.02, packing_efficiency=0.91, staleness_max=0, staleness_counts={0: 128},
                reward_wait_per_step_s=1.25, first_batch_wait_s=2.5, trainer_idle_s=37.5),
        run_row(2, 40.0, mode="keep", trained_tokens_per_s=150.0, rollout_utilisation=0.6,
                weight_sync_stall_fraction=0.04, packing_efficiency=0.9, staleness_max=2,
                staleness_counts={"0": 90, "1": 30, "2": 8}),  # keys as JSON gives them back
        {"eta": 4, "mode": "recompute", "error": "ComponentFailed: trainer failed: boom\nlog tail"},
    ]
    result = {
        "settings": {"workload": "balanced"},
        "config": report_config(),
        "workload": {"groups": 32, "budget_mean": 70.2, "budget_p50": 52, "budget_p90": 140, "budget_max": 256},
        "standalone": {"t_gen_s": 30.0, "throughput": [{"concurrency": 16, "tokens_per_s": 900.0}]},
        **compare_runs(runs, t_gen=30.0),
    }
    table = format_tables(json.loads(json.dumps(result)))
    assert "ideal overlap bound 1.67x" in table and "T_gen 30.0 s" in table and "T_train 20.0 s" in table
    assert "ideal synchronous 50.0 s" in table
    # wall, limit, efficiency, first batch, trainer idle, speed-up vs eta 0, vs ideal sync, tok/s, util., stall,
    # reward wait, packing, staleness
    assert ("| 0 | sync | 60.0 | 50.0 | 0.83 | 2.5 | 37.5 | 1.00 | 0.83 | 100 | 0.31 | 0.020 | 1.25 | 0.910 | 0 "
            "| 0:128 |") in table
    assert ("| 2 | keep | 40.0 | 30.0 | 0.75 | n/a | n/a | 1.50 | 1.25 | 150 | 0.60 | 0.040 | n/a | 0.900 | 2 "
            "| 0:90 1:30 2:8 |") in table
    header, rule = [line for line in table.splitlines() if line.startswith("| eta") or line.startswith("| ---")]
    assert header.count("|") == rule.count("|") == next(line for line in table.splitlines()
                                                         if line.startswith("| 4 | recompute")).count("|")
    assert "| 4 | recompute | failed: ComponentFailed: trainer failed: boom |" in table
    assert "groups in flight" not in table
    assert "workload balanced: 32 groups x 4 samples" in table and "8 steps of 4 groups" in table
    capped = format_tables(json.loads(json.dumps({**result, "config": report_config(max_groups_in_flight=8)})))
    assert "; at most 8 groups in flight" in capped
    assert "rollout server on CPUs [0], trainer on CPUs [1]" in table
    on_gpu = {**result["config"], "inference": {"cpu_cores": None, "devices": [[0]]},
              "trainer": {**result["config"]["trainer"], "cpu_cores": None, "devices": [0]}, "placement": {"share_devices": True}}
    assert "rollout server on devices [[0]], trainer on devices [0] (shared)" in format_tables({**result, "config": on_gpu})
    assert not math.isnan(result["overlap_bound"])


def test_the_mixed_workload_draws_code_and_math_from_one_mixture(tmp_path) -> None:
    from asyncrl.bench.e2e import bench_run_config, prepare_workload
    from asyncrl.tasks.data.loader import load_prompts

    settings, base = parse("--workload", "mixed", "trainer.max_steps=8")
    workload = prepare_workload(tmp_path, base, settings.n_prompts, settings.code_share)
    assert workload.train_path.suffix == ".yaml"
    records = load_prompts(workload.train_path)
    assert {r.task for r in records} == {"math", "code"} and len(records) == settings.n_prompts
    assert 0 < workload.code_groups < len(workload.prompts) == 8 * base.trainer.batch_groups
    assert max(workload.budgets) <= base.rollout.max_new_tokens and all(len(p) <= 96 for p in workload.prompts)
    with pytest.raises(ValueError, match=r"code_share: must be in \[0, 1\)"):
        prepare_workload(tmp_path, base, 8, code_share=1.0)
    config = bench_run_config(base, workload, tmp_path, eta=0, mode="recompute")
    assert config.reward.code.extract == "whole" and config.data.train_path == str(workload.train_path)
