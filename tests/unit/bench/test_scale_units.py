"""Units of `asyncrl bench scale`: the sizes' parameter counts, the exponent fit, the figures
on hand-made inputs, the memory sampler on a hand-made /proc and on a real process, the run
config, the tables and plot, and the options' checks (the measurement itself: `asyncrl bench
scale`, described in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from asyncrl.bench.e2e import bench_run_config
from asyncrl.bench.e2e_settings import DEFAULT_CONFIG as E2E_CONFIG, Workload
from asyncrl.bench.process_memory import (
    MemorySampler,
    component_peak,
    own_memory,
    process_group_of,
    read_group_file,
    read_process_memory,
    reset_own_peak,
)
from asyncrl.bench.bench_config import load_bench_config
from asyncrl.bench.scale import cmd_bench_scale, config_from_args, scale_run_config, settings_from_args
from asyncrl.bench.scale_figures import (
    COSTS,
    fit_exponent,
    measured_steps,
    memory_figures,
    model_state_bytes,
    scaling_exponents,
    stall_figures,
    trainer_figures,
    weight_sync_figures,
)
from asyncrl.bench.scale_report import format_tables, plot_curves
from asyncrl.bench.scale_settings import DEFAULT_CONFIG, SIZE_SPECS, ScaleBenchSettings, parse_sizes
from asyncrl.cli.main import build_parser, main, parse_command_line
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.model.tiny import QWEN25_05B_SPEC, tiny_qwen2_config

PARAMETERS = {"5m": 4_904_288, "30m": 31_927_232, "125m": 127_617_024, "0.5b": 494_032_768, "1.5b": 1_543_714_304}


# ----- the sizes -----


def test_sizes_are_qwen2_5_shaped_and_their_counts_are_exact() -> None:
    assert list(SIZE_SPECS) == list(PARAMETERS)
    assert SIZE_SPECS["0.5b"] == QWEN25_05B_SPEC
    for name, spec in SIZE_SPECS.items():
        assert spec.num_parameters() == PARAMETERS[name], name
        assert spec.vocab_size == 151_936 and spec.max_position_embeddings == QWEN25_05B_SPEC.max_position_embeddings
        assert spec.head_dim in (32, 64, 128), name  # head sizes vLLM's attention takes (Qwen2.5-1.5B's is 128)
        assert spec.num_heads % spec.num_kv_heads == 0, name
    counts = [spec.num_parameters() for spec in SIZE_SPECS.values()]
    assert counts == sorted(counts)


@pytest.mark.parametrize("name", list(SIZE_SPECS))
def test_the_formula_counts_what_transformers_builds(name: str) -> None:
    """The parameters of a transformers Qwen2 model of the shape, built on the meta device
    (no memory): tied embeddings are one tensor, counted once."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(tiny_qwen2_config(SIZE_SPECS[name]))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]


def test_parse_sizes_orders_smallest_first_and_names_the_option() -> None:
    assert parse_sizes("0.5b, 5M") == ("5m", "0.5b")
    assert parse_sizes("125m") == ("125m",)
    with pytest.raises(ValueError, match=r"--sizes: unknown size '3m'; choose from 5m, 30m, 125m, 0.5b"):
        parse_sizes("3m")
    with pytest.raises(ValueError, match="--sizes: name at least one"):
        parse_sizes(" , ")
    with pytest.raises(ValueError, match="--sizes: a size repeats"):
        parse_sizes("5m,5m")


# ----- the settings and the command line -----


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("repeats", 0, "--repeats: must be an int >= 1, got 0"),
        ("repeats", True, "--repeats: must be an int >= 1, got True"),
        ("sample_s", 0, "sample_s: must be > 0, got 0"),
        ("sizes", ("7b",), "--sizes: unknown size '7b'"),
        ("gpus", (0, 1, 2), r"--gpus: one GPU id \(shared\) or two"),
        ("png_path", Path("curves.jpg"), "--png: curves.jpg must end with .png"),
        ("json_path", Path("/no/such/dir/x.json"), "--json: /no/such/dir is not a directory"),
    ],
)
def test_bad_settings_name_the_option(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScaleBenchSettings(**{field: value})


def test_png_without_matplotlib_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ValueError, match="--png: matplotlib is not installed"):
        ScaleBenchSettings(png_path=tmp_path / "curves.png")


def parse(*argv: str) -> tuple[ScaleBenchSettings, RunConfig]:
    """The settings and the base run config of ``asyncrl bench scale ARGV``."""
    args = parse_command_line(build_parser(), ["bench", "scale", *argv])
    settings = settings_from_args(args)
    return settings, config_from_args(args, settings)


def test_the_command_line_builds_the_settings_and_the_run_config(capsys: pytest.CaptureFixture[str]) -> None:
    settings, config = parse()
    assert settings.sizes == ("5m", "30m", "125m", "0.5b") and settings.repeats == 2 and DEFAULT_CONFIG.is_file()
    assert (config.name, config.trainer.max_steps, config.rollout.eta, config.seed) == ("bench-scale", 3, 0, 0)
    assert (config.trainer.batch_groups, config.rollout.n_samples, config.rollout.max_new_tokens) == (4, 4, 256)
    assert (config.trainer.micro_batch_tokens, config.trainer.logit_chunk_tokens, config.data.max_prompt_tokens) == (4096, 1024, 64)
    assert (config.trainer.activation_checkpointing, config.trainer.zero_stage, config.model.dtype) == (False, 0, "float32")
    on_gpus, gpu_config = parse("--sizes", "5m", "--gpus", "0", "trainer.max_steps=2")
    assert on_gpus.sizes == ("5m",) and on_gpus.gpus == (0,) and gpu_config.trainer.max_steps == 2
    assert gpu_config.inference.cpu_cores is gpu_config.trainer.cpu_cores is None  # on GPUs no CPU is pinned
    _, lean = parse("trainer.logit_chunk_tokens=256", "--repeats", "1", "trainer.activation_checkpointing=true")
    assert (lean.trainer.logit_chunk_tokens, lean.trainer.activation_checkpointing) == (256, True)
    for argv, message in (
        (["trainer.max_steps=0"], "bench scale: /"),  # the file, then the key
        (["trainer.max_steps=0"], "bench-scale.yaml: trainer.max_steps: Input should be greater than or equal to 1"),
        (["trainer.micro_batch_tokens=300"], "trainer.micro_batch_tokens: 300 is smaller than one sequence's maximum"),
        (["--sizes", "1b"], "bench scale: --sizes: unknown size '1b'"),
        (["--png", "out.svg"], "bench scale: --png: out.svg must end with .png"),
    ):
        assert cmd_bench_scale(parse_command_line(build_parser(), ["bench", "scale", *argv])) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "scale", "--gpus", "a"])


@pytest.mark.parametrize(
    ("option", "override"),
    [(["--steps", "2"], "trainer.max_steps=2"), (["--eta", "1"], "rollout.eta=1"), (["--zero-stage", "1"], "trainer.zero_stage=1"),
     (["--activation-checkpointing"], "trainer.activation_checkpointing=true"),
     (["--logit-chunk-tokens", "256"], "trainer.logit_chunk_tokens=256"), (["--micro-batch-tokens", "512"], "trainer.micro_batch_tokens=512"),
     (["--batch-groups", "2"], "trainer.batch_groups=2"), (["--n-samples", "2"], "rollout.n_samples=2"),
     (["--max-new-tokens", "64"], "rollout.max_new_tokens=64"), (["--seed", "3"], "seed=3")],
)  # fmt: skip
def test_former_options_name_their_run_config_key(option: list[str], override: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "scale", "--sizes", "5m", *option])
    key = override.split("=")[0]
    assert exit_info.value.code == 2
    assert f"{option[0]} is now the run config key {key}: pass {override}" in capsys.readouterr().err


def test_a_sizes_run_is_the_workload_s_run_named_for_the_size_with_one_checkpoint(tmp_path: Path) -> None:
    _, base = parse("trainer.max_steps=2")
    workload = Workload(tmp_path / "model", tmp_path / "train.parquet", prompts=(), budgets=())
    config = scale_run_config(base, workload, tmp_path / "5m", "5m")
    assert config.name == "bench-scale-5m" and config.storage.root == str(tmp_path / "5m" / "runs" / config.name / "store")
    assert config.trainer.checkpoint_every == config.trainer.max_steps == 2
    assert config.tracking.experiment == "bench-scale"
    assert (config.model.path, config.data.train_path) == (str(workload.model_dir), str(workload.train_path))
    assert config.rollout == base.rollout and config.data.max_prompt_tokens == base.data.max_prompt_tokens
    assert config.trainer.micro_batch_tokens == 4096 and config.model.dtype == "float32"
    assert config.trainer.logit_chunk_tokens == 1024 and not config.trainer.activation_checkpointing
    assert config.trainer.zero_stage == 0 and config.trainer.processes == 1
    # bench e2e's run of the same values: only the name, the checkpoints and the experiment differ
    e2e_base = load_bench_config(E2E_CONFIG, [], [f"{k}={v}" for k, v in (
        ("rollout.max_new_tokens", 256), ("trainer.max_steps", 2), ("trainer.micro_batch_tokens", 4096),
        ("trainer.logit_chunk_tokens", 1024), ("trainer.zero_stage", 0), ("model.dtype", "float32"),
        ("tracking.experiment", "bench-scale"))])  # fmt: skip
    e2e = bench_run_config(e2e_base, workload, tmp_path / "5m", 0, "recompute")
    assert config.rollout == e2e.rollout and config.model == e2e.model and config.inference.model_dump(
        exclude={"base_port"}) == e2e.inference.model_dump(exclude={"base_port"})  # fmt: skip
    assert config.trainer.model_dump(exclude={"checkpoint_every"}) == e2e.trainer.model_dump(exclude={"checkpoint_every"})
    assert config.reward == e2e.reward and config.tracking == e2e.tracking


# ----- the figures -----


def test_model_states_are_16_bytes_per_parameter() -> None:
    assert model_state_bytes(1_000, "float32") == model_state_bytes(1_000, "bfloat16") == 16_000
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got 'int8'"):
        model_state_bytes(1, "int8")


def test_fit_exponent_recovers_known_power_laws() -> None:
    params = [1e6, 3e7, 1.25e8, 5e8]
    for k in (0.5, 1.0, 1.1, 2.0):
        assert fit_exponent(params, [3.0 * p**k for p in params]) == pytest.approx(k)
    assert fit_exponent([10.0, 1000.0], [2.0, 200.0]) == pytest.approx(1.0)
    # Least squares: noise that cancels in log space leaves the slope.
    assert fit_exponent([1.0, 10.0, 100.0], [1.0 * math.e, 10.0 / math.e**2, 100.0 * math.e]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two or more"):
        fit_exponent([1.0], [1.0])
    with pytest.raises(ValueError, match="must be > 0"):
        fit_exponent([1.0, 2.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="all equal"):
        fit_exponent([5.0, 5.0], [1.0, 2.0])


def test_scaling_exponents_per_pair_and_overall() -> None:
    """step_s ~ p^1 below 125m and p^1.5 above it; a cost missing at one size is fitted over the others."""
    names = ["5m", "30m", "125m", "0.5b"]
    sizes = []
    for name in names:
        p = float(PARAMETERS[name])
        step = p if p <= PARAMETERS["125m"] else PARAMETERS["125m"] * (p / PARAMETERS["125m"]) ** 1.5
        figures = {"step_s": step * 1e-6, "load_s": None if name == "30m" else 2e-9 * p**1.1, "stall_s": 0.0}
        sizes.append({"size": name, "parameters": PARAMETERS[name], "figures": figures})
    fitted = scaling_exponents(sizes)
    assert set(fitted) == set(COSTS)
    assert [(p["from"], p["to"]) for p in fitted["step_s"]["pairs"]] == list(itertools.pairwise(names))
    assert [p["k"] for p in fitted["step_s"]["pairs"]] == pytest.approx([1.0, 1.0, 1.5])
    assert 1.0 < fitted["step_s"]["overall"] < 1.5
    assert [(p["from"], p["to"]) for p in fitted["load_s"]["pairs"]] == [("5m", "125m"), ("125m", "0.5b")]
    assert fitted["load_s"]["overall"] == pytest.approx(1.1)
    assert fitted["stall_s"] == {"pairs": [], "overall": None}  # zero stalls: nothing to fit
    assert fitted["fetch_s"] == {"pairs": [], "overall": None}
    assert scaling_exponents(sizes[:1])["step_s"] == {"pairs": [], "overall": None}


def metrics(compute: tuple[float, float], tokens: float, micro: float, publish: float, checkpoint: float = 0.0) -> dict[str, float]:
    """One step's metrics as the trainer writes them (the fields the figures read, plus noise)."""
    return {"proximal_time_s": compute[0], "update_time_s": compute[1], "sequence_tokens": tokens,
            "micro_batches": micro, "publish_time_s": publish, "checkpoint_time_s": checkpoint,
            "step_time_s": sum(compute) + publish + checkpoint + 0.5, "loss": 0.0}  # fmt: skip


def test_trainer_figures_leave_out_the_first_step() -> None:
    steps = {1: metrics((0.0, 9.0), 1000, 1, 3.0), 2: metrics((1.0, 3.0), 1200, 1, 1.0),
             3: metrics((0.0, 6.0), 2400, 2, 2.0, checkpoint=5.0)}  # fmt: skip
    assert measured_steps(steps) == [steps[2], steps[3]]
    assert measured_steps({1: steps[1]}) == [steps[1]]
    figures = trainer_figures(steps)
    assert figures["step_s"] == pytest.approx(5.0)
    assert figures["tokens_per_s"] == pytest.approx(3600 / 10.0)
    assert figures["tokens_per_step"] == pytest.approx(1800)
    assert figures["trainer_publish_s"] == pytest.approx(1.5)
    assert figures["step_wall_s"] == pytest.approx((4.0 + 1.0 + 0.5 + 6.0 + 2.0 + 0.5) / 2)  # checkpoint left out
    assert figures["checkpoint_s"] == 5.0 and figures["micro_batch_tokens"] == 1200  # 1200 / 1 > 2400 / 2 = 1200
    assert trainer_figures({1: steps[1]})["checkpoint_s"] is None
    with pytest.raises(ValueError, match="no step"):
        trainer_figures({})


def test_stall_and_weight_sync_figures() -> None:
    assert stall_figures({"weight_sync_stall_s": 3.0, "weight_updates": 2}) == {"weight_updates": 2.0, "stall_s": 1.5}
    assert stall_figures({"weight_sync_stall_s": 0.0, "weight_updates": 0})["stall_s"] is None
    seconds = {"publish": [2.0, 4.0], "fetch": [1.0], "fetch by copy": [9.0], "load": [4.0], "worker reload": [2.0]}
    figures = weight_sync_figures(seconds, 2_000_000_000)
    assert (figures["publish_s"], figures["publish_gb_s"]) == (3.0, pytest.approx(2 / 3))
    assert (figures["fetch_gb_s"], figures["load_gb_s"], figures["reload_gb_s"]) == (2.0, 0.5, 1.0)
    assert figures["version_bytes"] == 2e9 and "fetch by copy_s" not in figures


def test_memory_figures_set_the_trainer_against_its_model_states() -> None:
    peaks = {"trainer": {"process_peak_bytes": 20_000}, "rollout-server-0": {"process_peak_bytes": 7_000},
             "rollout-server-1": {"process_peak_bytes": 9_000}, "scheduler": {"process_peak_bytes": 3_000}}  # fmt: skip
    figures = memory_figures(peaks, 1_000, "float32", 100.0)
    assert figures["model_state_bytes"] == 16_000 and figures["trainer_rss_bytes"] == 20_000
    assert figures["trainer_rss_over_states"] == pytest.approx(1.25)
    assert figures["trainer_bytes_per_token"] == pytest.approx(40.0)
    assert figures["server_rss_bytes"] == 9_000 and figures["reward_rss_bytes"] is None
    assert memory_figures({}, 1_000, "float32", 100.0)["trainer_bytes_per_token"] is None
    assert component_peak(peaks, "rollout-server") == 9_000 and component_peak(peaks, "evaluator") is None


# ----- the memory sampler -----


def fake_process(proc: Path, pid: int, pgid: int, comm: str, rss_kib: int, hwm_kib: int) -> None:
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    (entry / "stat").write_text(f"{pid} ({comm}) S 1 {pgid} {pgid} 0 -1 4194560 0 0\n")
    (entry / "comm").write_text(comm + "\n")
    (entry / "status").write_text(f"Name:\t{comm}\nVmHWM:\t{hwm_kib} kB\nVmRSS:\t{rss_kib} kB\nThreads:\t1\n")


def test_the_sampler_reads_every_process_of_each_group(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    fake_process(proc, 100, 100, "python", 1_000, 4_000)
    fake_process(proc, 101, 100, "VLLM::Engine) S (x", 3_000, 5_000)  # a name with ") " in it
    fake_process(proc, 200, 200, "python", 2_000, 2_500)
    fake_process(proc, 300, 300, "other", 9_000, 9_000)  # not a component
    (proc / "self").mkdir()
    (proc / "400").mkdir()  # gone between the listing and the read
    groups = tmp_path / "process-groups.json"
    groups.write_text(json.dumps({"rollout-server-0": 100, "trainer": 200, "scheduler": 0}))
    assert read_group_file(groups) == {"rollout-server-0": 100, "trainer": 200}
    assert read_group_file(tmp_path / "missing.json") == {}
    assert process_group_of(101, proc) == 100
    sampler = MemorySampler(groups, proc=proc)
    sampler.sample()
    (proc / "100" / "status").write_text("VmHWM:\t6000 kB\nVmRSS:\t500 kB\n")  # a later, higher peak
    sampler.sample()
    peaks = sampler.peaks()
    assert list(peaks) == ["rollout-server-0", "trainer"]
    server = peaks["rollout-server-0"]
    assert server["process_peak_bytes"] == 6_000 * 1024 and server["process"] == "python[100]"
    assert server["group_peak_bytes"] == 4_000 * 1024 and server["processes"] == 2
    assert peaks["trainer"]["process_peak_bytes"] == 2_500 * 1024 and sampler.samples == 2


def test_own_memory_and_its_peak_reset(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    fake_process(proc, os.getpid(), 1, "python", 1_000, 4_000)
    assert own_memory(proc).hwm_bytes == 4_000 * 1024
    assert reset_own_peak(proc) is True
    assert (proc / str(os.getpid()) / "clear_refs").read_text() == "5"  # the kernel's "reset VmHWM"
    assert reset_own_peak(tmp_path / "nowhere") is False
    with pytest.raises(RuntimeError, match="status is not readable"):
        own_memory(tmp_path / "nowhere")


def test_the_sampler_follows_a_real_process_group(tmp_path: Path) -> None:
    assert read_process_memory(os.getpid()) is not None
    assert process_group_of(os.getpid()) == os.getpgid(0)
    assert read_process_memory(2**22 + 12345) is None  # above any pid_max: no such process
    script = "import sys; x = b'x' * (64 * 2**20); print(flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    try:
        assert child.stdout is not None
        child.stdout.readline()  # its 64 MiB are resident
        groups = tmp_path / "process-groups.json"
        groups.write_text(json.dumps({"trainer": child.pid}))
        with MemorySampler(groups, interval_s=0.01) as sampler:
            time.sleep(0.05)
        peak = sampler.peaks()["trainer"]
        assert peak["process_peak_bytes"] >= 64 * 2**20 and peak["process"].endswith(f"[{child.pid}]")
        assert peak["processes"] == 1 and sampler.samples >= 2  # the thread's and the last one on exit
    finally:
        child.kill()
        child.wait()


# ----- the report -----


def size_entry(name: str, step_s: float, error: str | None = None) -> dict[str, Any]:
    spec = SIZE_SPECS[name]
    entry: dict[str, Any] = {"size": name, "parameters": spec.num_parameters(),
                             "shape": {"hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                                       "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
                                       "intermediate_size": spec.intermediate_size}}  # fmt: skip
    if error:
        return {**entry, "error": error}
    p = spec.num_parameters()
    entry["figures"] = {
        "step_s": step_s, "tokens_per_s": 1000.0 / step_s, "trainer_publish_s": 2e-9 * p, "publish_s": 1e-9 * p,
        "fetch_s": 5e-10 * p, "load_s": 3e-9 * p, "publish_gb_s": 4.0, "fetch_gb_s": 8.0, "load_gb_s": 1.333,
        "stall_s": 3e-9 * p, "model_state_bytes": 16.0 * p, "trainer_rss_bytes": 20.0 * p + 1e9,
        "trainer_rss_over_states": (20.0 * p + 1e9) / (16.0 * p), "trainer_bytes_per_token": 1e6,
        "micro_batch_tokens": 1500.0, "server_rss_bytes": 2e9, "reward_rss_bytes": 3e8, "scheduler_rss_bytes": 4e8,
        "version_bytes": 4.0 * p, "checkpoint_bytes": 12.0 * p,
    }  # fmt: skip
    return entry


def sample_result() -> dict[str, Any]:
    sizes = [size_entry("5m", 0.5), size_entry("30m", 2.0), size_entry("0.5b", 0.0, error="ComponentFailed: trainer\nmore")]
    return {
        "settings": {"sizes": ["5m", "30m", "0.5b"], "repeats": 2},
        "config": {"rollout": {"n_samples": 4, "max_new_tokens": 256, "eta": 0}, "trainer": {"max_steps": 2, "batch_groups": 4}},
        "dtype": "float32",
        "sizes": sizes,
        "exponents": scaling_exponents([s for s in sizes if "error" not in s]),
    }


def test_tables_show_each_size_its_failure_and_the_exponents() -> None:
    tables = format_tables(sample_result())
    assert "workload: 2 RL steps of 4 groups x 4 samples, outputs up to 256 tokens (EOS ignored), eta 0;" in tables
    assert "then 2 fresh versions published" in tables
    assert "- 5m: hidden 32, 2 layers, 1 heads (1 KV), intermediate 176: 4,904,288 parameters" in tables
    assert "| 5m | 4,904,288 | 0.500 | 2,000 | 0.010 | 0.005 | 0.002 | 0.015 | 4.000 / 8.000 / 1.333 | 0.015 |" in tables
    assert "| 0.5b | failed: ComponentFailed: trainer |" in tables
    assert "| 5m | 0.078 | 1.098 | 13.99 | 1,000,000 | 1,500 | 2.000 | 0.300 | 0.400 | 0.020 | 0.059 |" in tables
    assert "| cost | 5m → 30m | all sizes |" in tables
    k = math.log(4.0) / math.log(PARAMETERS["30m"] / PARAMETERS["5m"])
    assert f"| trainer step (s) | {k:.2f} | {k:.2f} |" in tables
    assert "| publish (s) | 1.00 | 1.00 |" in tables
    json.dumps(sample_result())  # the result is JSON as it is


def test_the_plot_is_written(tmp_path: Path) -> None:
    path = plot_curves(sample_result(), tmp_path / "figures" / "scale.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
