"""The result of ``asyncrl bench scale`` as text (the sizes, a time table, a memory table and
the fitted exponents, Markdown) and as a PNG of each cost against parameters (log-log).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.bench.scale_figures import COSTS
from asyncrl.bench.weight_sync import GB

TIME_COSTS = ("step_s", "trainer_publish_s", "publish_s", "fetch_s", "load_s", "stall_s")
BYTE_COSTS = ("trainer_rss_bytes", "server_rss_bytes", "checkpoint_bytes", "model_state_bytes")
"""The plot's two panels: seconds, and bytes (model states: the reference the trainer's RSS is judged by)."""


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GB:,.3f}"


def shape_line(entry: Mapping[str, Any]) -> str:
    """``5m: hidden 32, 2 layers, 1 heads (1 KV), intermediate 176: 4,904,288 parameters``."""
    s = entry["shape"]
    return (
        f"- {entry['size']}: hidden {s['hidden_size']}, {s['num_layers']} layers, {s['num_heads']} heads "
        f"({s['num_kv_heads']} KV), intermediate {s['intermediate_size']}: {entry['parameters']:,} parameters"
    )


def _failed(entry: Mapping[str, Any], columns: int) -> str:
    return f"| {entry['size']} | failed: {entry['error'].splitlines()[0][:100]} |" + " |" * (columns - 2)


def time_table(sizes: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        ("| size | parameters | step (s) | tokens/s | trainer publish (s) | publish (s) | fetch (s) | load (s) "
         "| publish / fetch / load GB/s | update stall (s) |"),
        "|" + " --- |" * 10,
    ]
    for e in sizes:
        if "error" in e:
            lines.append(_failed(e, 10))
            continue
        f = e["figures"]
        lines.append(
            f"| {e['size']} | {e['parameters']:,} | {_num(f['step_s'], 3)} | {_num(f['tokens_per_s'], 0)} "
            f"| {_num(f['trainer_publish_s'], 3)} | {_num(f['publish_s'], 3)} | {_num(f['fetch_s'], 3)} "
            f"| {_num(f['load_s'], 3)} | {_num(f['publish_gb_s'], 3)} / {_num(f['fetch_gb_s'], 3)} / "
            f"{_num(f['load_gb_s'], 3)} | {_num(f['stall_s'], 3)} |"
        )
    return lines


def memory_table(sizes: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        ("| size | model states (GB) | peak RSS trainer (GB) | trainer / states | trainer bytes per micro-batch token "
         "| micro-batch tokens | peak RSS server (GB) | reward (GB) | scheduler (GB) | version (GB) | checkpoint (GB) |"),
        "|" + " --- |" * 11,
    ]
    for e in sizes:
        if "error" in e:
            lines.append(_failed(e, 11))
            continue
        f = e["figures"]
        lines.append(
            f"| {e['size']} | {_gb(f['model_state_bytes'])} | {_gb(f['trainer_rss_bytes'])} "
            f"| {_num(f['trainer_rss_over_states'])} | {_num(f['trainer_bytes_per_token'], 0)} "
            f"| {_num(f['micro_batch_tokens'], 0)} | {_gb(f['server_rss_bytes'])} | {_gb(f['reward_rss_bytes'])} "
            f"| {_gb(f['scheduler_rss_bytes'])} | {_gb(f['version_bytes'])} | {_gb(f.get('checkpoint_bytes'))} |"
        )
    return lines


def exponent_table(result: Mapping[str, Any]) -> list[str]:
    """One row per cost: k between consecutive sizes and over all of them."""
    measured = [e["size"] for e in result["sizes"] if "error" not in e]
    pairs = list(itertools.pairwise(measured))
    header = ["cost", *(f"{a} → {b}" for a, b in pairs), "all sizes"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for cost, label in COSTS.items():
        fitted = result["exponents"].get(cost, {"pairs": [], "overall": None})
        by_pair = {(p["from"], p["to"]): p["k"] for p in fitted["pairs"]}
        cells = [label, *(_num(by_pair.get(pair)) for pair in pairs), _num(fitted["overall"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_tables(result: Mapping[str, Any]) -> str:
    """The sizes and workload, then the time, memory and exponent tables."""
    rollout, trainer = result["config"]["rollout"], result["config"]["trainer"]
    lines = [
        f"Qwen2 sizes, vocabulary 151,936, tied embeddings, {result['dtype']}:",
        *(shape_line(e) for e in result["sizes"]),
        (f"workload: {trainer['max_steps']} RL steps of {trainer['batch_groups']} groups x {rollout['n_samples']} "
         f"samples, outputs up to {rollout['max_new_tokens']} tokens (EOS ignored), eta {rollout['eta']}; figures: "
         f"mean of the steps after the first; then {result['settings']['repeats']} fresh versions published, "
         "fetched and loaded into a rollout server per size"),
        "",
        *time_table(result["sizes"]),
        "",
        ("step: forward, backward and optimizer step; trainer publish: gather, write and publish a version in the "
         "run; publish / fetch / load: `asyncrl bench weight-sync`'s phases; update stall: generation paused per update"),
        "",
        *memory_table(result["sizes"]),
        "",
        ("peak RSS: the largest process of each component (VmHWM); model states: weights + gradients + Adam at the "
         "trainer's precision; bytes per micro-batch token: (trainer peak - model states) / tokens of its largest "
         "micro-batch"),
        "",
        "exponent k of cost ~ params^k:",
        "",
        *exponent_table(result),
    ]
    return "\n".join(lines)


def plot_curves(result: Mapping[str, Any], path: Path) -> Path:
    """Two log-log panels against parameters: the seconds of :data:`TIME_COSTS` and the bytes
    of :data:`BYTE_COSTS`, each labelled with its overall exponent k (model states, dashed,
    proportional to parameters by definition: the line the trainer's RSS is judged against)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [e for e in result["sizes"] if "error" not in e]
    figure, (times, memory) = plt.subplots(1, 2, figsize=(11, 4.4))
    for axis, costs in ((times, TIME_COSTS), (memory, BYTE_COSTS)):
        for cost in costs:
            points = [(e["parameters"], e["figures"].get(cost)) for e in sizes]
            points = [(p, v / GB if axis is memory else v) for p, v in points if v is not None and v > 0]
            if not points:
                continue
            k = result["exponents"].get(cost, {}).get("overall")
            label = COSTS.get(cost, "model states (weights + grads + Adam)")
            label += "" if k is None else f", k = {k:.2f}"
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, marker="o", linestyle="--" if cost == "model_state_bytes" else "-", label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    times.set(xlabel="parameters", ylabel="seconds", title="Time per step / per version")
    memory.set(xlabel="parameters", ylabel="GB", title="Peak memory and checkpoint")
    figure.suptitle("asyncrl bench scale: cost against parameters (cost ~ params^k)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
