"""Re-partition a ZeRO stage 3 checkpoint for another world size.

DeepSpeed 0.19.8 loads a stage 3 checkpoint only at the world size that saved it
(``DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict`` takes the state of its own rank;
its universal-checkpoint route needs an offline conversion). Stage 3 partitions each
parameter on its own: a parameter of n elements is split into W pieces of s = ceil(n / W)
elements, the last zero-padded, and rank r holds piece r. Rank r's fp32 master group g
(``fp32_flat_groups[g]``) and its AdamW ``exp_avg`` / ``exp_avg_sq`` are the
concatenation of its pieces of the group's parameters, in the order the model-states
file's ``param_shapes[g]`` names them. Re-partitioning rebuilds each parameter from its W
pieces (padding dropped) and cuts it into W' pieces of ceil(n / W'); scalars (``step``)
are copied after checking every rank holds the same. Every rank's model-states file
(``zero_pp_rank_{r}_mp_rank_{m}_model_states.pt``: lr scheduler, step counts, the trainer
state; its module entries are empty partitions) is rewritten from rank 0's with the new
``dp_world_size``. Exact: every element is copied, none is recomputed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.trainer.zero_reshard import OPTIMIZER_STATE_DICT, ZERO_FILE, ReshardError, same_value

if TYPE_CHECKING:
    import torch

ZERO3_MODEL_STATES_FILE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "optimizer_state_dict"  # inside the stage 3 optimizer state
PARTITION_COUNT = "partition_count"


def repartition(pieces: Sequence[torch.Tensor], numels: Sequence[int], world: int) -> list[torch.Tensor]:
    """The flat groups of ``world`` new ranks from the old ranks' flat groups ``pieces``
    (rank r's at index r) of parameters of ``numels`` elements, each split as in the module
    docstring."""
    import torch

    old_world = len(pieces)
    old_sizes = [math.ceil(n / old_world) for n in numels]
    for rank, piece in enumerate(pieces):
        if piece.numel() != sum(old_sizes):
            raise ReshardError(
                f"rank {rank}'s flat group holds {piece.numel()} elements, its {len(numels)} parameters "
                f"split {old_world} ways {sum(old_sizes)}"
            )
    new: list[list[torch.Tensor]] = [[] for _ in range(world)]
    offset = 0
    for numel, old_size in zip(numels, old_sizes):
        whole = torch.cat([piece[offset : offset + old_size] for piece in pieces])[:numel]  # (n,)
        offset += old_size
        size = math.ceil(numel / world)
        for rank in range(world):
            part = whole.new_zeros(size)
            chunk = whole[rank * size : (rank + 1) * size]
            part[: chunk.numel()] = chunk
            new[rank].append(part)
    return [torch.cat(parts) if parts else pieces[0].new_zeros(0) for parts in new]


def reshard_zero3_states(
    states: Sequence[dict[str, Any]], numels: Sequence[Sequence[int]], world: int
) -> list[dict[str, Any]]:
    """The stage 3 ``optimizer_state_dict`` of each of ``world`` new ranks from ``states``
    (old rank r's at index r), whose group g holds parameters of ``numels[g]`` elements."""
    old_world = len(states)
    for rank, state in enumerate(states):
        if FP32_FLAT_GROUPS not in state or BASE_OPTIMIZER_STATE not in state:
            raise ReshardError(f"rank {rank}'s optimizer state is not a ZeRO stage 3 state")
        if state.get(PARTITION_COUNT) != old_world:
            raise ReshardError(f"rank {rank}: partition_count {state.get(PARTITION_COUNT)}, files of {old_world} ranks")
        if len(state[FP32_FLAT_GROUPS]) != len(numels):
            raise ReshardError(f"rank {rank}: {len(state[FP32_FLAT_GROUPS])} groups, param_shapes {len(numels)}")
    first = states[0]
    new_states = []
    for _ in range(world):
        copied = {key: value for key, value in first.items() if key not in (FP32_FLAT_GROUPS, BASE_OPTIMIZER_STATE)}
        base = first[BASE_OPTIMIZER_STATE]
        copied.update({PARTITION_COUNT: world, FP32_FLAT_GROUPS: []})
        copied[BASE_OPTIMIZER_STATE] = {"state": {}, "param_groups": [dict(group) for group in base["param_groups"]]}
        new_states.append(copied)
    for g, group_numels in enumerate(numels):
        flats = repartition([s[FP32_FLAT_GROUPS][g] for s in states], group_numels, world)
        for new, flat in zip(new_states, flats):
            new[FP32_FLAT_GROUPS].append(flat)
        _reshard_base_state(states, new_states, g, group_numels, world)
    return new_states


def _reshard_base_state(
    states: Sequence[dict[str, Any]], new_states: Sequence[dict[str, Any]], g: int, numels: Sequence[int], world: int
) -> None:
    """Group g's optimizer state (keyed g, one flat parameter per group): per-element
    tensors re-partitioned like the fp32 group, scalars copied."""
    import torch

    per_rank = [s[BASE_OPTIMIZER_STATE]["state"].get(g) for s in states]
    if all(entry is None for entry in per_rank):
        return  # no update yet
    if any(entry is None for entry in per_rank):
        raise ReshardError(f"group {g}: some ranks hold optimizer state, others none")
    sizes = [s[FP32_FLAT_GROUPS][g].numel() for s in states]
    entries: list[dict[str, Any]] = [{} for _ in range(world)]
    for name, value in per_rank[0].items():
        values = [entry[name] for entry in per_rank]
        if all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == size for v, size in zip(values, sizes)):
            for entry, part in zip(entries, repartition(values, numels, world)):
                entry[name] = part
        elif all(same_value(v, value) for v in values):
            for entry in entries:
                entry[name] = value.clone() if torch.is_tensor(value) else value
        else:
            raise ReshardError(f"group {g}: optimizer state {name!r} differs between ranks and is not per element")
    for new, entry in zip(new_states, entries):
        new[BASE_OPTIMIZER_STATE]["state"][g] = entry


def reshard_zero3_checkpoint_dir(tag_dir: Path, world: int, partition_sizes: Sequence[int]) -> int:
    """Rewrite the ZeRO stage 3 files of one checkpoint tag in ``tag_dir`` for ``world``
    ranks; return the old world size. ``partition_sizes``: the loading engine's flat group
    sizes, checked against the result. Reads the whole optimizer state into memory."""
    import torch

    tag_dir = Path(tag_dir)
    optim: dict[tuple[str, str], dict[int, Path]] = {}
    model: dict[str, dict[int, Path]] = {}
    for path in sorted(tag_dir.iterdir()):
        if match := ZERO_FILE.match(path.name):
            optim.setdefault((match.group("prefix"), match.group("mp")), {})[int(match.group("rank"))] = path
        elif match := ZERO3_MODEL_STATES_FILE.match(path.name):
            model.setdefault(match.group("mp"), {})[int(match.group("rank"))] = path
    if not optim or not model:
        raise ReshardError(f"{tag_dir}: no ZeRO stage 3 optimizer and model-states files")
    old_world = 0
    for mp, files in model.items():
        old_world = len(files)
        if sorted(files) != list(range(old_world)):
            raise ReshardError(f"{tag_dir}: model-states files of ranks {sorted(files)}, not 0..{old_world - 1}")
        states = torch.load(files[0], map_location="cpu", weights_only=False)
        numels = [[math.prod(shape) for shape in group.values()] for group in states["param_shapes"]]
        for (prefix, optim_mp), optim_files in optim.items():
            if optim_mp == mp:
                _reshard_optimizer_files(tag_dir, prefix, mp, optim_files, numels, world, partition_sizes)
        for path in files.values():
            path.unlink()
        for rank in range(world):
            torch.save({**states, "dp_world_size": world}, tag_dir / f"zero_pp_rank_{rank}_mp_rank_{mp}_model_states.pt")
    return old_world


def _reshard_optimizer_files(
    tag_dir: Path,
    prefix: str,
    mp: str,
    files: dict[int, Path],
    numels: list[list[int]],
    world: int,
    partition_sizes: Sequence[int],
) -> None:
    """One series of optimizer files (``{prefix}{r}_mp_rank_{mp}_optim_states.pt``) rewritten for ``world`` ranks."""
    import torch

    if sorted(files) != list(range(len(files))):
        raise ReshardError(f"{tag_dir}: {prefix}*_mp_rank_{mp} files for ranks {sorted(files)}, not 0..{len(files) - 1}")
    loaded = [torch.load(files[r], map_location="cpu", weights_only=False) for r in range(len(files))]
    new_states = reshard_zero3_states([item[OPTIMIZER_STATE_DICT] for item in loaded], numels, world)
    sizes = [int(flat.numel()) for flat in new_states[0][FP32_FLAT_GROUPS]]
    if sizes != list(partition_sizes):
        raise ReshardError(f"re-partitioned groups of {sizes} elements, the engine's of {list(partition_sizes)}")
    for path in files.values():
        path.unlink()
    for rank, state in enumerate(new_states):
        torch.save({**loaded[0], OPTIMIZER_STATE_DICT: state}, tag_dir / f"{prefix}{rank}_mp_rank_{mp}_optim_states.pt")
