"""``asyncrl compare RUN_A RUN_B``: two runs lined up by step (a run and its replay or fork, or
two recipes): the first step whose weights differ, and per step the weight distance
||w_A - w_B||_2, both runs' training figures (from each version's lineage) and held-out
pass@1 where either was evaluated. Weights are matched by step through the lineage
(:func:`~asyncrl.tasks.pipeline.replay.step_versions`), so a run whose labels ran ahead of its
steps after a restart still lines up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.storage.errors import UnknownWeightVersionError
from asyncrl.storage.evaluations import EvaluationStore
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weight_lineage import read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.pipeline.replay import ReplayError, step_versions, tensor_difference_of

FIGURES = ("loss", "reward_mean", "approx_kl", "grad_norm")
"""The training figures set side by side (each version's lineage holds its step's)."""


def _figures(root: RunRoot, version: int) -> dict[str, float]:
    metrics = (read_lineage(root, version) or {}).get("metrics") or {}
    return {key: float(metrics[key]) for key in FIGURES if isinstance(metrics.get(key), (int, float))}


def _pass_at_1(root: RunRoot) -> dict[int, float]:
    records = EvaluationStore(root)
    found = {}
    for version in records.versions():
        record = records.read(version) or {}
        if isinstance(record.get("pass_at_1"), (int, float)):
            found[version] = float(record["pass_at_1"])
    return found


def compare_runs(a_uri: str, b_uri: str, scratch: Path) -> dict[str, Any]:
    """The comparison of the module docstring, over the steps both runs have weights for."""
    a, b = open_root(a_uri), open_root(b_uri)
    stores = WeightStore(a), WeightStore(b)
    at_a, at_b = step_versions(stores[0]), step_versions(stores[1])
    steps = sorted(set(at_a) & set(at_b))
    if not steps:
        raise ReplayError(f"{a.uri} and {b.uri}: no step with weights in both (steps {sorted(at_a)} and {sorted(at_b)})")
    evaluated = _pass_at_1(a), _pass_at_1(b)
    rows, first = [], None
    for step in steps:
        va, vb = at_a[step], at_b[step]
        row: dict[str, Any] = {"step": step, "version_a": va, "version_b": vb}
        try:
            identical = stores[0].weight_digests(va) == stores[1].weight_digests(vb)
        except UnknownWeightVersionError:
            identical = None
        row["identical"] = identical
        if identical is False:
            found = tensor_difference_of(stores[0], va, stores[1], vb, scratch)
            if found is None:
                row["weight_distance"] = None  # pruned: digests only
            else:
                row.update(weight_distance=found.l2_distance, max_abs_diff=found.max_abs_diff, first_tensor=found.first_tensor)
        elif identical:
            row["weight_distance"] = 0.0
        if identical is False and first is None:
            first = row
        row["a"], row["b"] = _figures(a, va), _figures(b, vb)
        for side, found_pass, version in (("a", evaluated[0], va), ("b", evaluated[1], vb)):
            if version in found_pass:
                row[side]["pass_at_1"] = found_pass[version]
        rows.append(row)
    return {"run_a": a.uri, "run_b": b.uri, "steps": steps, "first_difference": first, "rows": rows}


def plot_comparison(result: dict[str, Any], path: Path) -> Path:
    """Weight distance by step, and each figure of :data:`FIGURES` both runs have, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shown = [key for key in ("loss", "reward_mean") if any(key in row["a"] or key in row["b"] for row in rows)]
    figure, axes = plt.subplots(1, 1 + len(shown), figsize=(5 * (1 + len(shown)), 3.6), squeeze=False)
    distance = [(row["step"], row["weight_distance"]) for row in rows if row.get("weight_distance") is not None]
    axes[0][0].plot([s for s, _ in distance], [d for _, d in distance], marker=".")
    axes[0][0].set(title="||w_A - w_B||_2", xlabel="step")
    for axis, key in zip(axes[0][1:], shown, strict=True):
        for side, label in (("a", "A"), ("b", "B")):
            points = [(row["step"], row[side][key]) for row in rows if key in row[side]]
            axis.plot([s for s, _ in points], [v for _, v in points], label=label)
        axis.set(title=key, xlabel="step")
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_comparison(result: dict[str, Any], json_path: Path | None, png_path: Path | None) -> None:
    """The JSON and PNG, where asked for."""
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    if png_path is not None:
        plot_comparison(result, png_path)
