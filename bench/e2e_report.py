"""The end-to-end benchmark's result as text: the workload, the standalone measurement, the
bound, and one Markdown table row per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    pass


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_staleness(counts: Mapping[Any, int]) -> str:
    """``{0: 40, 1: 8}`` -> ``0:40 1:8`` (staleness value: samples)."""
    return " ".join(f"{s}:{c}" for s, c in sorted(counts.items(), key=lambda item: int(item[0])))


def placement_line(config: Mapping[str, Any]) -> str:
    """Where the rollout server and the trainer ran (the run config's ``devices``, else its
    ``cpu_cores``) and the cap on groups in flight, if any."""

    def where(section: Mapping[str, Any]) -> str:
        if section.get("devices") is not None:
            return f"devices {section['devices']}"
        return "no pinning" if section.get("cpu_cores") is None else f"CPUs {section['cpu_cores']}"

    cap = config["rollout"].get("max_groups_in_flight")
    shared = " (shared)" if config.get("placement", {}).get("share_devices") else ""
    return (f"rollout server on {where(config['inference'])}, trainer on {where(config['trainer'])}{shared}"
            + (f"; at most {cap} groups in flight" if cap else ""))


def format_tables(result: Mapping[str, Any]) -> str:
    """The workload, the standalone measurement, the bound, and one table row per run."""
    w, s, config = result["workload"], result["standalone"], result["config"]
    lines = [
        f"workload {result['settings'].get('workload', 'balanced')}: {w['groups']} groups x "
        f"{config['rollout']['n_samples']} samples, output budget mean "
        f"{w['budget_mean']:.0f}, p50 {w['budget_p50']}, p90 {w['budget_p90']}, max {w['budget_max']} tokens "
        f"(long-tailed, EOS ignored); {config['trainer']['max_steps']} steps of {config['trainer']['batch_groups']} groups"
        + (f"; {w['code_groups']} code groups" if w.get("code_groups") else ""),
        placement_line(config),
        "standalone server: " + ", ".join(f"{r['tokens_per_s']:.0f} tokens/s at c={r['concurrency']}" for r in s["throughput"]),
        f"T_gen {s['t_gen_s']:.1f} s (batch by batch), T_train {_fmt(result.get('t_train_s'), '.1f')} s "
        f"(eta=0 step times): ideal synchronous {_fmt(result.get('ideal_sync_s'), '.1f')} s, "
        f"ideal overlap bound {_fmt(result.get('overlap_bound'), '.2f')}x",
        "limit: T_gen + T_train at eta 0, max(T_gen at the run's concurrency, the run's T_train) at eta > 0; "
        "efficiency = limit / wall; wall = first batch (the pipeline's fill) + the run's step times + trainer idle",
        "dropped: samples over the staleness bound; wasted tok.: their tokens; cut tok.: tokens generated but "
        "never written (groups cut by a stop or the end of the run)",
        "",
        "| eta | mode | wall (s) | limit (s) | efficiency | first batch (s) | trainer idle (s) "
        "| speed-up vs eta 0 | speed-up vs ideal sync | trained tok/s | rollout util. | stall frac. | reward wait/step (s) | packing eff. | staleness max "
        "| staleness (value:samples) | dropped | wasted tok. | cut tok. | filtered groups |",
        "|" + " --- |" * 20,
    ]
    for r in result.get("runs", []):
        mode = "sync" if r["eta"] == 0 else r["mode"]
        if "error" in r:
            lines.append(f"| {r['eta']} | {mode} | failed: {r['error'].splitlines()[0][:80]} |" + " |" * 17)
            continue
        lines.append(
            f"| {r['eta']} | {mode} | {r['wall_s']:.1f} | {_fmt(r.get('limit_s'), '.1f')} | "
            f"{_fmt(r.get('efficiency'), '.2f')} | {_fmt(r.get('first_batch_wait_s'), '.1f')} | "
            f"{_fmt(r.get('trainer_idle_s'), '.1f')} | {_fmt(r.get('speedup'), '.2f')} | "
            f"{_fmt(r.get('speedup_over_ideal_sync'), '.2f')} | {r['trained_tokens_per_s']:.0f} | "
            f"{r['rollout_utilisation']:.2f} | {r['weight_sync_stall_fraction']:.3f} | "
            f"{_fmt(r.get('reward_wait_per_step_s'), '.2f')} | {r['packing_efficiency']:.3f} | "
            f"{r['staleness_max']} | {format_staleness(r['staleness_counts'])} | {_fmt(r.get('dropped_stale'), 'd')} | "
            f"{_fmt(r.get('wasted_tokens'), 'd')} | {_fmt(r.get('cut_tokens'), 'd')} | "
            f"{_fmt(r.get('filtered_groups'), 'd')} |"
        )
    return "\n".join(lines)
