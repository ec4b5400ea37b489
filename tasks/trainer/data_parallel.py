"""Data parallelism of the trainer: who trains what, and the few collectives the trainer calls.

Every data-parallel rank runs the same code on the same step input; the trainer splits
work with pure functions of that input (:func:`balanced_partition`), so every rank
computes the same split without talking to the others. The functions here that
communicate say so in their name (``all_reduce_*``, ``all_gather_*``, ``broadcast_*``,
``barrier``) and must be called by every rank, in the same order; with one process (no
process group, or a group of one) they return at once.

Ranks of one node share its local disk: the *node leader* (local rank 0) is the one that
moves files between that disk and the run root (checkpoints, the initial model).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

T = TypeVar("T")
ReduceOp = Literal["sum", "max"]


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split items with token counts ``lengths`` into ``parts`` shares of near-equal tokens.

    Rule (longest processing time first, deterministic): take the items longest first
    (ties: lower index first) and give each to the share with the fewest tokens so far
    (ties: the lower share index). Each share lists its indices in ascending order.

    Guarantees: every index is in exactly one share; the result depends only on
    ``lengths`` and ``parts`` (every rank computes the same split); and with
    T_k = sum of the lengths in share k,

        max_k T_k - min_k T_k <= max_i lengths[i]

    (the last item put on the fullest share went to the then-emptiest one). A share is
    empty when there are fewer items than parts.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"lengths[{index}] must be >= 0, got {length}")
    shares: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(parts), key=lambda k: (tokens[k], k))
        shares[target].append(index)
        tokens[target] += lengths[index]
    return [sorted(share) for share in shares]


def _group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, set by torchrun/deepspeed; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_node_leader() -> bool:
    """Whether this process moves its node's files (local rank 0)."""
    return local_rank() == 0


def barrier() -> None:
    """Wait for every rank (collective; no-op in one process)."""
    import torch.distributed as dist

    if _group_size() > 1:
        dist.barrier()


def all_reduce_floats(values: Sequence[float], op: ReduceOp) -> list[float]:
    """Element-wise sum or max of ``values`` over ranks, in float64 (collective; the values
    themselves in one process). One call reduces a whole vector: one round trip."""
    import torch
    import torch.distributed as dist

    if op not in ("sum", "max"):
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    if _group_size() == 1 or not values:
        return [float(v) for v in values]
    # NCCL reduces device tensors only; gloo (CPU) takes the CPU tensor as is.
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        from deepspeed.accelerator import get_accelerator

        tensor = tensor.to(get_accelerator().current_device_name())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return [float(v) for v in tensor.cpu().tolist()]


def all_gather_objects(value: T) -> list[T]:
    """``value`` of every rank, in rank order (collective; ``[value]`` in one process)."""
    import torch.distributed as dist

    if _group_size() == 1:
        return [value]
    gathered: list[T | None] = [None] * _group_size()
    dist.all_gather_object(gathered, value)
    return gathered  # type: ignore[return-value]


def broadcast_from_rank0(look: Callable[[], T]) -> T:
    """Run ``look`` on rank 0 and give its result to every rank (collective).

    An exception raised by ``look`` is raised on every rank (so all ranks fail alike
    instead of the others waiting for rank 0 forever): rank 0 raises it, the others a copy,
    or a :class:`DataParallelError` with its text when it does not survive pickling (an
    exception class whose constructor takes other arguments than its message). ``look``
    must return a picklable value. Other ranks do not call ``look``.
    """
    import torch.distributed as dist

    if _group_size() == 1:
        return look()
    message: list[object] = [None]
    failure: Exception | None = None
    if _group_rank() == 0:
        try:
            message[0] = ("ok", look())
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            failure = exc
            message[0] = ("error", _portable(exc))
    dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    kind, payload = message[0]  # type: ignore[misc]
    if kind == "error":
        raise payload  # type: ignore[misc]
    return payload  # type: ignore[no-any-return]


def _portable(exc: Exception) -> Exception:
    """``exc`` if a pickled copy loads, else a :class:`DataParallelError` carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send the text
        return DataParallelError(f"rank 0: {type(exc).__name__}: {exc}")
    return exc


def run_and_agree(work: Callable[[], T], what: str) -> T:
    """Run ``work`` here, then learn whether it failed on any rank (collective).

    A rank whose ``work`` raised re-raises its exception; every other rank raises
    :class:`DataParallelError` naming the failed ranks and their reasons. So local work of
    some ranks (a node leader's upload) fails them all, instead of leaving the others
    waiting at the next collective. In one process the exception simply propagates.
    """
    if _group_size() == 1:
        return work()
    result: T | None = None
    failure: Exception | None = None
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - re-raised below
        failure = exc
    reasons = all_gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(rank, reason) for rank, reason in enumerate(reasons) if reason is not None]
    if failed:
        listed = "; ".join(f"rank {rank}: {reason}" for rank, reason in failed)
        raise DataParallelError(f"{what} failed on {len(failed)} rank(s): {listed}")
    return result  # type: ignore[return-value]


class DataParallelError(RuntimeError):
    """Work of one or more ranks failed; the message names the ranks and their reasons."""
