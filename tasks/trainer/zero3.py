"""ZeRO stage 3 in the trainer: the policy built partitioned from an HF checkpoint, and
gathered back one parameter at a time to publish it.

Under stage 3 each of the W ranks holds 1/W of every partitioned parameter (DeepSpeed gives
each a ``ds_id``; a module's parameters are all-gathered while it runs and partitioned
again after it). Here no rank holds more than its partitions and one whole parameter:

- building: the model is constructed inside ``deepspeed.zero.Init`` (every parameter is
  partitioned as its module is created, weight initialisation skipped), then filled from
  the checkpoint one tensor at a time: rank 0 reads the tensor, the parameter is gathered,
  rank 0 copies the tensor in and DeepSpeed broadcasts it and partitions it again;
- publishing: one parameter at a time is gathered on every rank (a collective), and rank
  0 appends its bytes to the safetensors file, whose header (names, dtypes, shapes,
  offsets) is known before any data. Peak extra memory: the largest parameter (plus its
  CPU copy off a CPU), never a second copy of the model.

transformers' own ZeRO-3 loading needs ``accelerate`` (not installed) and reads the whole
state dict on every rank first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
"""torch dtype name -> safetensors dtype tag."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def parameters_partitioned(module: Any) -> bool:
    """Whether ZeRO stage 3 partitions ``module``'s parameters (DeepSpeed gave them a
    ``ds_id``): a forward pass is then a collective, and a parameter's values can only be
    read after gathering it."""
    parameters = getattr(module, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return first is not None and hasattr(first, "ds_id")


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of a parameter as a whole (``ds_shape`` of a partitioned one)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def saved_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or persistent buffer) of what an HF checkpoint of ``module`` holds, in
    state-dict order; a tensor tied to an earlier name (lm_head.weight when the embeddings
    are tied) is left out, as ``save_pretrained`` leaves it out."""
    seen: set[int] = set()
    kept = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept.append((name, tensor))
    return kept


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of the HF checkpoint in ``model_dir`` (one file, or
    the shards its index names)."""
    from safetensors import safe_open

    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / WEIGHTS_FILE
    if not single.is_file():
        raise ValueError(f"{model_dir}: no {WEIGHTS_FILE} or {SAFETENSORS_INDEX} (ZeRO stage 3 loads safetensors)")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def build_partitioned_model(
    model_dir: Path, ds_config: dict[str, Any], dtype: torch.dtype, attn_implementation: str, rank: int
) -> torch.nn.Module:
    """The causal LM in ``model_dir`` with parameters in ``dtype``, built under
    ``deepspeed.zero.Init`` and filled from its checkpoint one tensor at a time (see the
    module docstring); collective.

    transformers creates the tensors, in ``dtype`` as ``from_pretrained`` would; zero.Init
    only partitions them (its dtype override is off: it would also turn float32 buffers
    such as the rotary ``inv_freq`` into bf16/fp16, which ``from_pretrained`` keeps in
    float32). ``ValueError`` if the checkpoint's tensor names are not the module's (a
    publish of this model would then name its tensors differently)."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(model_dir)
    partitioning = deepspeed.zero.Init(config_dict_or_path=ds_config, tensor_overrides=[DeepSpeedTensorOverride.device])
    with no_init_weights(), partitioning:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    files = checkpoint_files(model_dir)
    tensors = saved_tensors(model)
    names = {name for name, _ in tensors}
    aliases = set(model.state_dict(keep_vars=True)) - names  # tied copies, e.g. lm_head.weight
    missing, unexpected = sorted(names - set(files)), sorted(set(files) - names - aliases)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: the checkpoint's tensor names differ from the model's (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); ZeRO stage 3 loads checkpoints whose names are the module's"
        )
    with torch.no_grad(), _Reader(files if rank == 0 else {}) as read:
        for name, tensor in tensors:
            if not hasattr(tensor, "ds_id"):  # a buffer, or a parameter ZeRO did not partition
                tensor.copy_(_broadcast_from_rank0(read(name) if rank == 0 else tensor, tensor))
                continue
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                if rank == 0:
                    tensor.copy_(read(name))
    return model.eval()


class _Reader:
    """``read(name)``: one tensor of the checkpoint, files opened once (rank 0 only)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> Callable[[str], torch.Tensor]:
        return self.read

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)


def _broadcast_from_rank0(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``value`` on every rank, with the dtype and device of ``like`` (collective)."""
    import torch.distributed as dist

    tensor = value.to(dtype=like.dtype, device=like.device).contiguous()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=0)
    return tensor


def safetensors_header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The header of a safetensors file holding ``entries`` (name, dtype tag, shape, bytes),
    their data laid out in that order: an 8-byte little-endian length, then the JSON
    (``__metadata__`` ``{"format": "pt"}`` as transformers writes it), space-padded to a
    multiple of 8 bytes so the data starts aligned."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def file_order(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`saved_tensors` in the order safetensors lays their data out: larger dtypes
    first, then by name (every rank computes the same order, so gathers pair up)."""
    return sorted(saved_tensors(module), key=lambda item: (-item[1].element_size(), item[0]))


def gathered_tensors(
    tensors: list[tuple[str, torch.Tensor]], keep: bool
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, whole CPU tensor) of each of ``tensors`` in turn, each partitioned parameter
    gathered on every rank while its item is current (collective: every rank consumes it
    to the end, in the same order). The tensor may share the gathered parameter's memory:
    valid until the next item, to be dropped before asking for it. None where ``keep`` is
    false (the ranks that only take part in the gathers)."""
    import deepspeed

    for name, tensor in tensors:
        if not hasattr(tensor, "ds_id"):
            yield name, tensor.detach().cpu() if keep else None
            continue
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            yield name, tensor.detach().cpu() if keep else None


def write_gathered_safetensors(module: torch.nn.Module, path: Path | None) -> int:
    """Write ``module``'s tensors (:func:`saved_tensors`) as one safetensors file at
    ``path``, gathering one parameter at a time (:func:`gathered_tensors`); collective.
    Every rank but the writer (rank 0) passes ``path`` None. Returns the bytes of tensor
    data (the model's size)."""
    import math

    import torch

    tensors = file_order(module)
    entries = []
    for name, tensor in tensors:
        dtype = SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors tag here")
        shape = full_shape(tensor)
        entries.append((name, dtype, shape, math.prod(shape) * tensor.element_size()))
    total = sum(nbytes for *_, nbytes in entries)
    if path is None:
        for _ in gathered_tensors(tensors, keep=False):
            pass
        return total
    items = gathered_tensors(tensors, keep=True)
    with open(path, "wb") as out:
        out.write(safetensors_header(entries))
        # next() rather than zip/enumerate, which would hold the previous item (and its
        # gathered memory) through the next gather.
        for name, _, shape, nbytes in entries:
            _, tensor = next(items)
            assert tensor is not None and tuple(tensor.shape) == shape, name
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != nbytes:
                raise RuntimeError(f"{name}: gathered {data.nbytes} bytes, expected {nbytes}")
            out.write(memoryview(data))
            del tensor, data
    for _ in items:  # ends the last gather
        pass
    return total
