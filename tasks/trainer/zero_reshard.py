"""Re-partition the optimizer state of a ZeRO stage 1/2 checkpoint for another world size.

DeepSpeed saves ZeRO stage 1/2 optimizer state as one file per data-parallel rank and
refuses to load it at another ``dp_world_size`` (its universal-checkpoint route needs an
offline conversion). The state is world-size free underneath: per parameter group g the
parameters are flattened into F_g elements, padded to W * P_g, and rank r owns
[r * P_g, (r + 1) * P_g). Re-partitioning concatenates the old ranks' elements without
padding and gives new rank r' elements [r' P'_g, (r' + 1) P'_g), zero-padded to P'_g;
scalars such as ``step`` are copied and the model-states file's ``dp_world_size`` is
rewritten. Exact: every element is copied, none is recomputed. The file layout:
``docs/internals/trainer.md``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ZERO_FILE = re.compile(r"^(?P<prefix>(?:bf16_)?zero_pp_rank_)(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
MODEL_STATES_FILE = re.compile(r"^mp_rank_\d+_model_states\.pt$")
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
REQUIRED_KEYS = (BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS, GROUP_PADDINGS, PARTITION_COUNT)


class ReshardError(ValueError):
    """The checkpoint's optimizer state cannot be re-partitioned; the message says why."""


def zero_world_size(file_names: Sequence[str]) -> int | None:
    """Data-parallel ranks that saved the ZeRO files among ``file_names`` (names relative
    to the tag directory), or None when there are none (ZeRO stage 0: the optimizer state
    is whole in the model-states file and loads at any world size)."""
    ranks = {int(m.group("rank")) for name in file_names if (m := ZERO_FILE.match(Path(name).name))}
    return len(ranks) if ranks else None


def engine_partition_sizes(ds_engine: Any) -> list[int]:
    """P'_g: elements of each parameter group's partition in a ZeRO stage 1/2 engine (of
    each fp32 sub-group, ``fp32_partitioned_groups_flat``, in a stage 3 one)."""
    groups = getattr(ds_engine.optimizer, SINGLE_PARTITION_OF_FP32_GROUPS, None)
    if groups is None:
        groups = getattr(ds_engine.optimizer, "fp32_partitioned_groups_flat", None)
    if groups is None:
        raise ReshardError(f"the engine's optimizer ({type(ds_engine.optimizer).__name__}) is not a ZeRO optimizer")
    return [int(group.numel()) for group in groups]


def reshard_for(states: Sequence[dict[str, Any]], world: int, partition_sizes: Sequence[int]) -> list[dict[str, Any]]:
    """The ``optimizer_state_dict`` of each of ``world`` new ranks, from ``states`` (old
    rank r's at index r), with ``partition_sizes`` P'_g per group (see the module
    docstring). :class:`ReshardError` for a state this cannot re-partition."""
    import torch

    if not states:
        raise ReshardError("no ZeRO partition states")
    if world < 1:
        raise ReshardError(f"world size must be >= 1, got {world}")
    for rank, state in enumerate(states):
        missing = [key for key in REQUIRED_KEYS if key not in state]
        if missing:
            raise ReshardError(f"rank {rank}'s ZeRO state lacks {missing} (not a ZeRO stage 1/2 optimizer state)")
        if not isinstance(state[BASE_OPTIMIZER_STATE], dict):
            raise ReshardError("elastic ZeRO checkpoints (zero_optimization.elastic_checkpoint) are not supported")
    first = states[0]
    n_groups = len(first[SINGLE_PARTITION_OF_FP32_GROUPS])
    if len(partition_sizes) != n_groups:
        raise ReshardError(f"the checkpoint has {n_groups} parameter groups, the engine {len(partition_sizes)}")
    old_world = len(states)
    for state in states:
        if list(state[PARTITION_COUNT]) != [old_world] * n_groups:
            raise ReshardError(f"partition_count {state[PARTITION_COUNT]} does not match the {old_world} rank files")

    new_states = [_copy_scalars(first) for _ in range(world)]
    for g in range(n_groups):
        size = int(partition_sizes[g])
        fp32 = torch.cat([_lean(s[SINGLE_PARTITION_OF_FP32_GROUPS][g], None) for s in states])  # (F_g,)
        total = fp32.numel()
        if size * world < total:
            raise ReshardError(f"group {g}: {world} partitions of {size} elements cannot hold its {total} elements")
        for r, new in enumerate(new_states):
            lean = fp32[r * size : min((r + 1) * size, total)].clone()
            new[SINGLE_PARTITION_OF_FP32_GROUPS].append(lean)
            new[GROUP_PADDINGS].append(size - lean.numel())
            new[PARTITION_COUNT].append(world)
        _reshard_optimizer_group(states, new_states, g, size, total)
        if all(PARAM_SLICE_MAPPINGS in s for s in states):
            _reshard_slice_mappings(states, new_states, g, size)
    return new_states


def _lean(tensor: torch.Tensor, padding: int | None) -> torch.Tensor:
    """``tensor`` (1-D) without its last ``padding`` elements (all of it for None)."""
    flat = tensor.reshape(-1)
    return flat if not padding else flat[: flat.numel() - padding]


def _copy_scalars(state: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's entries that are the same on every rank; per-group lists start empty."""
    base = state[BASE_OPTIMIZER_STATE]
    copied = {key: value for key, value in state.items() if key not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS)}
    copied.update({SINGLE_PARTITION_OF_FP32_GROUPS: [], GROUP_PADDINGS: [], PARTITION_COUNT: []})
    copied[BASE_OPTIMIZER_STATE] = {"state": {}, "param_groups": [dict(group) for group in base["param_groups"]]}
    if PARAM_SLICE_MAPPINGS in state:
        copied[PARAM_SLICE_MAPPINGS] = []
    return copied


def _reshard_optimizer_group(
    states: Sequence[dict[str, Any]], new_states: Sequence[dict[str, Any]], g: int, size: int, total: int
) -> None:
    """The base optimizer's per-element state of group g (e.g. exp_avg) re-partitioned;
    scalars (e.g. step) copied after checking every old rank holds the same."""
    import torch

    key = states[0][BASE_OPTIMIZER_STATE]["param_groups"][g]["params"][0]
    per_rank = [s[BASE_OPTIMIZER_STATE]["state"].get(key) for s in states]
    if all(entry is None for entry in per_rank):
        return  # no update yet: the optimizer creates its state at the first step
    if any(entry is None for entry in per_rank):
        raise ReshardError(f"group {g}: some ranks hold optimizer state, others none")
    new_entries: list[dict[str, Any]] = [{} for _ in new_states]
    old_sizes = [s[SINGLE_PARTITION_OF_FP32_GROUPS][g].numel() + s[GROUP_PADDINGS][g] for s in states]  # P_g per rank
    for name, value in per_rank[0].items():
        values = [entry[name] for entry in per_rank]
        partition_shaped = all(
            torch.is_tensor(v) and v.dim() == 1 and v.numel() == old_size for v, old_size in zip(values, old_sizes)
        )
        if partition_shaped:
            flat = torch.cat([_lean(v, s[GROUP_PADDINGS][g]) for v, s in zip(values, states)])  # (F_g,)
            if flat.numel() != total:
                raise ReshardError(f"group {g}: optimizer state {name!r} holds {flat.numel()} elements, the group {total}")
            for r, entry in enumerate(new_entries):
                part = flat.new_zeros(size)  # (P'_g,), tail padding zero as DeepSpeed pads
                piece = flat[r * size : min((r + 1) * size, total)]
                part[: piece.numel()] = piece
                entry[name] = part
        else:
            if not all(same_value(v, value) for v in values):
                raise ReshardError(f"group {g}: optimizer state {name!r} differs between ranks and is not per element")
            for entry in new_entries:
                entry[name] = value.clone() if torch.is_tensor(value) else value
    for new, entry in zip(new_states, new_entries):
        new[BASE_OPTIMIZER_STATE]["state"][key] = entry


def same_value(a: Any, b: Any) -> bool:
    """Whether two state entries are equal (tensors: same shape and values)."""
    import torch

    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _reshard_slice_mappings(
    states: Sequence[dict[str, Any]], new_states: Sequence[dict[str, Any]], g: int, size: int
) -> None:
    """Parameter name -> (numel, start) of its fragment in each new partition, from the old
    fragments' flat ranges (old rank r's fragment at start s is flat element r * P_g + s)."""
    ranges: OrderedDict[str, list[int]] = OrderedDict()  # name -> [flat start, numel]
    address_type = None
    for rank, s in enumerate(states):
        old_size = s[SINGLE_PARTITION_OF_FP32_GROUPS][g].numel() + s[GROUP_PADDINGS][g]
        for name, address in s[PARAM_SLICE_MAPPINGS][g].items():
            address_type = type(address)
            start = rank * old_size + int(address.start)
            if name not in ranges:
                ranges[name] = [start, int(address.numel)]
            elif ranges[name][0] + ranges[name][1] == start:
                ranges[name][1] += int(address.numel)
            else:
                raise ReshardError(f"group {g}: fragments of {name!r} are not contiguous")
    for r, new in enumerate(new_states):
        low, high = r * size, (r + 1) * size
        mapping: OrderedDict[str, Any] = OrderedDict()
        for name, (start, numel) in ranges.items():
            begin, end = max(start, low), min(start + numel, high)
            if begin < end and address_type is not None:
                mapping[name] = address_type(numel=end - begin, start=begin - low)
        new[PARAM_SLICE_MAPPINGS].append(mapping)


def reshard_checkpoint_dir(tag_dir: Path, world: int, partition_sizes: Sequence[int]) -> int:
    """Rewrite the ZeRO files of one checkpoint tag in ``tag_dir`` for ``world`` ranks
    (:func:`reshard_for`) and set ``dp_world_size`` in its model-states files; return the
    old world size. Files of old ranks beyond the new world size are deleted. Reads the
    whole optimizer state into memory."""
    import torch

    tag_dir = Path(tag_dir)
    by_series: dict[tuple[str, str], dict[int, Path]] = {}
    for path in sorted(tag_dir.iterdir()):
        match = ZERO_FILE.match(path.name)
        if match:
            by_series.setdefault((match.group("prefix"), match.group("mp")), {})[int(match.group("rank"))] = path
    if not by_series:
        raise ReshardError(f"{tag_dir}: no ZeRO optimizer files")
    old_world = 0
    for (prefix, mp), files in by_series.items():
        old_world = len(files)
        if sorted(files) != list(range(old_world)):
            raise ReshardError(f"{tag_dir}: {prefix}*_mp_rank_{mp} files for ranks {sorted(files)}, not 0..{old_world - 1}")
        loaded = [torch.load(files[r], map_location="cpu", weights_only=False) for r in range(old_world)]
        new_states = reshard_for([item[OPTIMIZER_STATE_DICT] for item in loaded], world, partition_sizes)
        for path in files.values():
            path.unlink()
        for r, state in enumerate(new_states):
            target = tag_dir / f"{prefix}{r}_mp_rank_{mp}_optim_states.pt"
            torch.save({**loaded[0], OPTIMIZER_STATE_DICT: state}, target)
    for path in sorted(tag_dir.iterdir()):
        if MODEL_STATES_FILE.match(path.name):
            model_states = torch.load(path, map_location="cpu", weights_only=False)
            model_states["dp_world_size"] = world
            torch.save(model_states, path)
    return old_world
