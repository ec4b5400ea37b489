"""`asyncrl bench weight-sync`: its figures, settings and links (fast), the whole bench at the tiny
size on local disk with a real vLLM server (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncrl.bench.weight_sync import (
    LINK_NAMES,
    PHASE_LINKS,
    cmd_bench_weight_sync,
    format_tables,
    fraction_of_link,
    gb_per_s,
    measure_links,
    phase_figures,
    slowest_link,
    phase_links,
    streaming_estimate,
    write_version,
)
from asyncrl.bench.weight_sync_settings import WeightSyncBenchSettings, model_spec
from asyncrl.cli.main import build_parser
from asyncrl.storage import paths
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore


def test_gb_per_s_is_bytes_over_seconds() -> None:
    assert gb_per_s(2_000_000_000, 4.0) == 0.5
    assert gb_per_s(0, 1.0) == 0.0
    with pytest.raises(ValueError, match="seconds > 0"):
        gb_per_s(1, 0.0)
    with pytest.raises(ValueError, match="bytes >= 0"):
        gb_per_s(-1, 1.0)


def test_fraction_of_link_is_phase_over_link() -> None:
    assert fraction_of_link(0.5, 2.0) == 0.25
    with pytest.raises(ValueError, match="link GB/s > 0"):
        fraction_of_link(1.0, 0.0)


def test_slowest_link_is_the_minimum_of_the_measured_links_crossed() -> None:
    links = {"disk_write": 0.8, "page_cache_read": 5.0, "memory_copy": 10.0, "disk_read_direct": None}
    assert slowest_link(links, ("page_cache_read", "memory_copy")) == ("page_cache_read", 5.0)
    assert slowest_link(links, ("page_cache_read", "disk_write", "disk_read_direct")) == ("disk_write", 0.8)
    with pytest.raises(ValueError, match="disk_read_direct"):
        slowest_link(links, ("disk_read_direct",))


def test_phase_figures_mean_and_best() -> None:
    figures = phase_figures([2.0, 1.0, 3.0], 1_000_000_000, ("disk_write", 1.0))
    assert figures["mean_s"] == 2.0 and figures["best_s"] == 1.0
    assert figures["mean_gb_s"] == 0.5 and figures["best_gb_s"] == 1.0
    assert figures["fraction_mean"] == 0.5 and figures["fraction_best"] == 1.0
    assert (figures["link"], figures["link_gb_s"], figures["bytes"]) == ("disk_write", 1.0, 1_000_000_000)
    with pytest.raises(ValueError, match="at least one"):
        phase_figures([], 1, ("disk_write", 1.0))


def test_every_phase_crosses_known_links() -> None:
    for phase, crossed in PHASE_LINKS.items():
        assert crossed and set(crossed) <= set(LINK_NAMES) - {"sha256"}, phase
    # A zero-copy fetch (hard links) writes no data; a publish and a copy always do.
    assert phase_links("fetch", zero_copy=True) == ("page_cache_read",)
    assert phase_links("load", zero_copy=True) == ("page_cache_read", "memory_copy")
    assert phase_links("publish", zero_copy=True) == phase_links("fetch by copy", zero_copy=True) == (
        "page_cache_read", "disk_write")
    assert phase_links("fetch", zero_copy=False) == ("page_cache_read", "disk_write")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("size", "7b", "WeightSyncBenchSettings.size must be one of"),
        ("repeats", 0, "WeightSyncBenchSettings.repeats must be an int >= 1, got 0"),
        ("repeats", True, "WeightSyncBenchSettings.repeats"),
        ("probe_mib", 4, "WeightSyncBenchSettings.probe_mib must be an int >= 8"),
        ("probe_mib", 12, "WeightSyncBenchSettings.probe_mib must be a multiple of 8, got 12"),
        ("max_model_len", 0, "WeightSyncBenchSettings.max_model_len"),
        ("kv_cache_gib", 0.0, "WeightSyncBenchSettings.kv_cache_gib must be > 0, got 0.0"),
        ("server_start_timeout_s", -1, "WeightSyncBenchSettings.server_start_timeout_s"),
        ("server_dtype", "float16", "WeightSyncBenchSettings.server_dtype must be one of .'float32', 'bfloat16'., got 'float16'"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        WeightSyncBenchSettings(**{field: value})


def test_the_0_5b_preset_is_qwen2_5_0_5b() -> None:
    spec = model_spec("0.5b")
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (896, 24, 14, 2)
    assert (spec.intermediate_size, spec.vocab_size) == (4864, 151936)
    assert spec.num_parameters() == 494_032_768
    assert model_spec("tiny").num_parameters() < 5_000_000


def test_links_are_measured_and_positive(tmp_path: Path) -> None:
    links = measure_links(tmp_path, 16 * 2**20)
    assert set(links) == set(LINK_NAMES)
    for name, link in links.items():
        if name != "disk_read_direct":  # None where the filesystem refuses O_DIRECT
            assert link["gb_s"] > 0 and link["bytes"] == 16 * 2**20 and link["what"], name
    assert not list(tmp_path.iterdir())  # the probe file is deleted


def test_versions_differ_in_bytes_and_hashes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from asyncrl.tasks.model.tiny import TinyModelSpec, write_qwen2_model

    base = write_qwen2_model(tmp_path / "base", TinyModelSpec(), seed=0, dtype="bfloat16")
    one, two = write_version(base, tmp_path / "v1", seed=1), write_version(base, tmp_path / "v2", seed=2)
    assert one.file_sha256 != two.file_sha256 and one.model_sha256 != one.file_sha256  # bf16 vs fp32 bytes
    first, second = load_file(str(tmp_path / "v1" / "model.safetensors")), load_file(str(base / "model.safetensors"))
    assert first.keys() == second.keys()  # tied embeddings: no lm_head.weight in either
    assert all(first[name].dtype == torch.bfloat16 for name in first)
    assert all(torch.equal(first[name], second[name]) for name in first if name != "model.embed_tokens.weight")
    assert (tmp_path / "v1" / "tokenizer.json").is_file()
    # What a bfloat16 server holds after loading it: the file's bytes as they are.
    same = write_version(base, tmp_path / "v3", seed=1, server_dtype="bfloat16")
    assert same.file_sha256 == same.model_sha256 == one.file_sha256


def test_streaming_estimate_and_tables() -> None:
    link = ("disk_write", 1.0)
    phases = [
        {"backend": "local", "phase": phase, **phase_figures([seconds], 1_000_000_000, link)}
        for phase, seconds in (("publish", 2.0), ("fetch", 0.5), ("fetch by copy", 2.0), ("load", 4.0),
                               ("worker fetch", 2.0), ("worker reload", 1.5))
    ]  # fmt: skip
    estimate = streaming_estimate(phases, "local")
    assert estimate is not None
    assert (estimate["staged_s"], estimate["zero_copy_s"]) == (3.5, 2.0)
    assert estimate["saving_fraction"] == pytest.approx(1.5 / 3.5)
    assert streaming_estimate(phases, "s3") is None
    links = {name: {"gb_s": 1.0, "seconds": 1.0, "bytes": 10**9, "what": "x"} for name in LINK_NAMES}
    result = {
        "model": {"size": "tiny", "parameters": 3, "dtype": "bfloat16", "server_dtype": "float32",
                  "safetensors_bytes": 10**9, "version_bytes": 10**9},
        "settings": {"repeats": 1}, "hashes_verified": True, "phases": phases, "links": links,
        "streaming": estimate,
    }  # fmt: skip
    tables = format_tables(result)
    assert "| backend | phase | seconds | GB/s | link | link GB/s | fraction of link |" in tables
    assert "| local | publish | 2.000 (2.000) | 0.500 (0.500) | disk write (sequential, fsync) | 1.000 | 0.50 (0.50) |" in tables


def test_cli_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "weight-sync", "--repeats", "0"])
    assert cmd_bench_weight_sync(args) == 2
    assert "WeightSyncBenchSettings.repeats" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "weight-sync", "--server-dtype", "bfloat16"]).server_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "weight-sync", "--server-dtype", "float16"])


def test_s3_needs_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from asyncrl.bench.weight_sync import s3_backend

    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID"):
        s3_backend("http://127.0.0.1:1", "bucket")


@pytest.mark.slow
def test_the_whole_bench_at_the_tiny_size_on_local_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["bench", "weight-sync", "--size", "tiny", "--repeats", "2", "--probe-mib", "32",
         "--work-dir", str(tmp_path / "work"), "--json", str(tmp_path / "report.json")]
    )  # fmt: skip
    assert cmd_bench_weight_sync(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "| backend | phase | seconds | GB/s | link | link GB/s | fraction of link |" in out
    result = json.loads(out[-1])  # the last line: the JSON
    assert result == json.loads((tmp_path / "report.json").read_text())
    assert result["hashes_verified"] is True
    assert [b["name"] for b in result["backends"]] == ["local"]
    assert [p["phase"] for p in result["phases"]] == list(PHASE_LINKS)
    for phase in result["phases"]:
        assert len(phase["seconds"]) == 2 and phase["bytes"] > 0, phase
        assert phase["mean_s"] > 0 and phase["mean_gb_s"] > 0 and phase["fraction_best"] > 0, phase
    assert [load["version"] for load in result["loads"]] == [1, 2]
    for load in result["loads"]:
        assert not load["cached"] and load["file_sha256"] != load["model_sha256"]  # bf16 file, fp32 model
    assert result["backends"][0]["zero_copy_fetch"] is True  # store and caches share the work dir's disk
    assert result["streaming"]["staged_s"] > 0
    assert result["links"]["disk_write"]["gb_s"] > 0 and result["links"]["memory_copy"]["gb_s"] > 0


def test_a_local_fetch_links_the_store_files_and_verifies_them(tmp_path: Path) -> None:
    """The zero-copy fetch the bench measured: a local store's files are hard-linked into the
    cache (same inode, no copy), each verified against the manifest; a corrupt one is refused."""
    from asyncrl.storage.weights import WeightIntegrityError
    from asyncrl.tasks.model.tiny import TinyModelSpec, write_qwen2_model
    from asyncrl.tasks.model.weight_fetch import fetch_weight_version

    base = write_qwen2_model(tmp_path / "base", TinyModelSpec(), seed=0, dtype="bfloat16")
    root_uri = f"file://{tmp_path / 'store'}"
    store = WeightStore(open_root(root_uri))
    store.publish(1, base)
    store.publish(2, base)
    model_dir, cached = fetch_weight_version(root_uri, {}, 1, tmp_path / "cache")
    published = Path(store.root.full_path(paths.weights_file(1, "model.safetensors")))
    assert not cached and (model_dir / "model.safetensors").stat().st_ino == published.stat().st_ino
    assert fetch_weight_version(root_uri, {}, 1, tmp_path / "cache") == (model_dir, True)
    store.prune(keep_latest=1)  # the store drops version 1: the cached links keep its bytes
    assert (model_dir / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    corrupt = Path(store.root.full_path(paths.weights_file(2, "model.safetensors")))
    corrupt.write_bytes(corrupt.read_bytes()[:-1] + b"\0")
    with pytest.raises(WeightIntegrityError, match="model.safetensors: downloaded SHA-256"):
        fetch_weight_version(root_uri, {}, 2, tmp_path / "cache")
    assert [p.name for p in model_dir.parent.iterdir() if not p.name.endswith(".lock")] == ["v000001"]


def test_a_lora_adapter_written_by_the_bench_is_what_peft_builds_and_loads(tmp_path: Path) -> None:
    """The bench's adapter files (written without PEFT): PEFT's parameter count for the same
    rank and targets, and PEFT loads them onto the base with every adapter tensor used."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncrl.bench.lora_sync import adapter_parameters, write_adapter_version
    from asyncrl.configs.trainer import LORA_TARGETS_QWEN2
    from asyncrl.tasks.model.tiny import write_tiny_model

    spec = model_spec("tiny")
    base = write_tiny_model(tmp_path / "base", spec=spec)
    built = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=list(LORA_TARGETS_QWEN2)))
    assert sum(p.numel() for p in built.parameters() if p.requires_grad) == adapter_parameters(spec, 4)
    adapter = write_adapter_version(base, spec, tmp_path / "adapter", rank=4, seed=1)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base)(tokens).logits
        adapted = loaded(tokens).logits
    assert float((adapted - plain).abs().max()) > 1e-3


def test_the_lora_bench_at_the_tiny_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--lora 8``: adapters published and loaded into a LoRA server, their bytes a small
    share of the full version's, every load's fingerprint matching the published file."""
    args = build_parser().parse_args(
        ["bench", "weight-sync", "--size", "tiny", "--repeats", "2", "--lora", "8",
         "--work-dir", str(tmp_path / "work"), "--json", str(tmp_path / "report.json")]
    )  # fmt: skip
    assert cmd_bench_weight_sync(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result == json.loads((tmp_path / "report.json").read_text())
    assert result["fingerprints_verified"] is True
    assert 0 < result["adapter"]["bytes"] < result["model"]["version_bytes"] / 2
    assert set(result["phases"]) == {"write", "publish", "load", "vllm load"}
    assert all(figures["mean_s"] > 0 for figures in result["phases"].values())
    assert any(line.startswith("LoRA rank 8 on tiny") for line in out)
    bad = build_parser().parse_args(["bench", "weight-sync", "--size", "tiny", "--lora", "0"])
    assert cmd_bench_weight_sync(bad) == 2
    assert "--lora: the adapter rank must be >= 1, got 0" in capsys.readouterr().err
