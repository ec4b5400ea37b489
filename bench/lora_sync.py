"""``asyncrl bench weight-sync --lora RANK``: what one weight update of a LoRA run moves and
costs, against the full model it adapts.

On the bench's base model (:func:`~asyncrl.bench.weight_sync_settings.write_bench_model`, a Qwen2.5
shape of ``--size``), ``repeats`` fresh adapters of rank ``RANK`` on Qwen2's seven linear
layers per block (random A and B, PEFT's file format) are written, published to a local
weight store and loaded into a rollout server started with LoRA
(:func:`~asyncrl.tasks.inference.adapter_sync.update_server_adapter`: fetch, vLLM's
``/v1/load_lora_adapter``, the fingerprint check). Reported: the adapter's bytes against the
full version's, and the seconds of write, publish and load (fetch + vLLM's load +
fingerprint + the version label); the server is idle, so the load is the whole stall a
paused update would see.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.configs.trainer import LORA_TARGETS_QWEN2

if TYPE_CHECKING:
    from asyncrl.bench.weight_sync_settings import WeightSyncBenchSettings
    from asyncrl.tasks.model.tiny import TinyModelSpec

ADAPTER_PREFIX = "base_model.model.model.layers"


def lora_module_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, int]]:
    """``{module: (d_in, d_out)}`` of the seven linear layers of one Qwen2 block:

        q: (H, heads * d_h)   k, v: (H, kv_heads * d_h)   o: (heads * d_h, H)
        gate, up: (H, I)      down: (I, H)

    with H the hidden size, d_h = H / heads and I the intermediate size."""
    head_dim = spec.hidden_size // spec.num_heads
    hidden, inner = spec.hidden_size, spec.intermediate_size
    attention, kv = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    return {
        "self_attn.q_proj": (hidden, attention), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (attention, hidden), "mlp.gate_proj": (hidden, inner), "mlp.up_proj": (hidden, inner),
        "mlp.down_proj": (inner, hidden),
    }  # fmt: skip


def adapter_parameters(spec: TinyModelSpec, rank: int) -> int:
    """Parameters of a rank-r adapter on every block: L * sum over modules of r (d_in + d_out)."""
    return spec.num_layers * sum(rank * (d_in + d_out) for d_in, d_out in lora_module_shapes(spec).values())


def write_adapter_version(base: Path, spec: TinyModelSpec, out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of ``base`` at ``out_dir`` (alpha = 2 rank), A and B drawn from
    N(0, 0.02^2) by a generator seeded with ``seed``, float32, with the base's ``config.json``
    beside it (the weight store asks every version for one)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for module, (d_in, d_out) in lora_module_shapes(spec).items():
            name = f"{ADAPTER_PREFIX}.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.02 * torch.randn(rank, d_in, generator=generator)
            tensors[f"{name}.lora_B.weight"] = 0.02 * torch.randn(d_out, rank, generator=generator)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(LORA_TARGETS_QWEN2), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "inference_mode": True, "base_model_name_or_path": str(base)}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    shutil.copyfile(base / "config.json", out_dir / "config.json")
    return out_dir


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(values), "best_s": min(values)}


def run_lora_sync_bench(settings: WeightSyncBenchSettings, rank: int, work_dir: Path) -> dict[str, Any]:
    """The bench (module docstring) under ``work_dir``; the JSON-ready result."""
    from asyncrl.bench.weight_sync_settings import dir_bytes, model_spec, write_bench_model
    from asyncrl.storage.fs import open_root
    from asyncrl.storage.weights import WeightStore
    from asyncrl.tasks.inference.adapter_sync import update_server_adapter
    from asyncrl.tasks.inference.server import RolloutServer
    from asyncrl.tasks.inference.server_config import RolloutServerConfig

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--lora: the adapter rank must be an int >= 1, got {rank!r}")
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = model_spec(settings.size)
    base = write_bench_model(work_dir / "model", settings)
    root = open_root(str(work_dir / "lora-store"))
    store = WeightStore(root)
    config = RolloutServerConfig(
        model_dir=base, kv_cache_gib=settings.kv_cache_gib, max_model_len=settings.max_model_len,
        served_model_name="lora-sync-bench", start_timeout_s=settings.server_start_timeout_s,
        log_path=work_dir / "lora-server.log", dtype=settings.server_dtype, max_lora_rank=rank,
    )  # fmt: skip
    seconds: dict[str, list[float]] = {"write": [], "publish": [], "load": [], "vllm load": []}
    adapter_bytes: list[int] = []
    verified: list[bool] = []
    started = time.perf_counter()
    with RolloutServer(config) as server:
        server_start_s = time.perf_counter() - started
        for version in range(1, settings.repeats + 1):
            mark = time.perf_counter()
            local = write_adapter_version(base, spec, work_dir / f"adapter-v{version}", rank, settings.seed + version)
            seconds["write"].append(time.perf_counter() - mark)
            mark = time.perf_counter()
            store.publish(version, local)
            seconds["publish"].append(time.perf_counter() - mark)
            report = update_server_adapter(server.handle, root.uri, {}, version, cache_dir=str(work_dir / "cache"))
            seconds["load"].append(report.seconds)
            seconds["vllm load"].append(report.load_s)
            adapter_bytes.append(report.bytes)
            verified.append(all(w.model_sha256 == w.file_sha256 for w in report.workers))
    full_bytes = dir_bytes(base)
    return {
        "settings": {"size": settings.size, "rank": rank, "repeats": settings.repeats, "server_dtype": settings.server_dtype},
        "model": {"parameters": spec.num_parameters(), "version_bytes": full_bytes},
        "adapter": {"parameters": adapter_parameters(spec, rank), "bytes": max(adapter_bytes),
                    "share_of_full": max(adapter_bytes) / full_bytes},  # fmt: skip
        "phases": {phase: _stats(values) for phase, values in seconds.items()},
        "fingerprints_verified": all(verified),
        "server_start_s": server_start_s,
    }


def format_lora_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table."""
    adapter, model = result["adapter"], result["model"]
    lines = [
        f"LoRA rank {result['settings']['rank']} on {result['settings']['size']} "
        f"({model['parameters']:,} parameters): adapter {adapter['parameters']:,} parameters, "
        f"{adapter['bytes'] / 1e6:.1f} MB per version against {model['version_bytes'] / 1e9:.2f} GB for the full model "
        f"({100 * adapter['share_of_full']:.2f}%)",
        "",
        "| phase | mean (s) | best (s) |",
        "| --- | --- | --- |",
    ]
    for phase, figures in result["phases"].items():
        lines.append(f"| {phase} | {figures['mean_s']:.3f} | {figures['best_s']:.3f} |")
    lines.append(f"\nfingerprints verified: {result['fingerprints_verified']}; server start {result['server_start_s']:.1f} s")
    return "\n".join(lines)

