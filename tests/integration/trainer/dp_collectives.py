"""The trainer's collectives on a two-process gloo group (run by test_data_parallel.py
under ``torch.distributed.run --nproc-per-node=2``; not a test module). Each rank writes
what it saw to ``OUT_DIR/rank{r}.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from asyncrl.tasks.trainer.data_parallel import (
    all_gather_objects,
    all_reduce_floats,
    broadcast_from_rank0,
    run_and_agree,
)


class TwoArgumentError(Exception):
    """An exception whose pickled copy cannot be loaded (its constructor takes two arguments)."""

    def __init__(self, first: int, second: int) -> None:
        super().__init__(f"{first}/{second}")


def _raise(exc: Exception) -> Any:
    raise exc


def caught(call: Any) -> list[str]:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
        return [type(exc).__name__, str(exc)]
    return []


def main(out_dir: Path) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = {
        "sum": all_reduce_floats([rank + 1.0, 10.0 * rank], "sum"),
        "max": all_reduce_floats([float(rank), -float(rank)], "max"),
        "gathered": all_gather_objects({"rank": rank}),
        "broadcast": broadcast_from_rank0(lambda: ["chosen by", rank]),
        "error": caught(lambda: broadcast_from_rank0(lambda: _raise(ValueError("no shards")))),
        "two_argument_error": caught(lambda: broadcast_from_rank0(lambda: _raise(TwoArgumentError(1, 2)))),
        "agreed": caught(lambda: run_and_agree(lambda: _raise(OSError("disk full")) if rank == 1 else None, "upload")),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
