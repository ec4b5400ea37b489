"""One measured process of ``asyncrl bench trainer-memory``: set the heap, then measure.

    python -m asyncrl.bench.trainer_memory_worker --settings JSON --heap glibc|MIB --out-dir DIR

(under ``torchrun`` for several ranks) writes ``DIR/rank<R>.json``. The heap is set before
torch is imported or anything large allocated, as the trainer sets it first thing in its ``main``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.bench.trainer_memory import GLIBC_DEFAULT, MemorySettings, measure_phases
from asyncrl.tasks.system.host_memory import return_freed_memory_to_os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help="MemorySettings as JSON")
    parser.add_argument("--heap", required=True, help="glibc, or an mmap threshold in MiB")
    parser.add_argument("--out-dir", required=True, type=Path)
    args = parser.parse_args()
    if args.heap != GLIBC_DEFAULT and not return_freed_memory_to_os(int(args.heap) << 20):
        raise SystemExit(f"heap {args.heap} MiB: glibc's mallopt is not available here")

    fields = json.loads(args.settings)
    settings = MemorySettings(**{**fields, "model_dir": Path(fields["model_dir"])})
    measured = measure_phases(settings, args.out_dir / "version")
    (args.out_dir / f"rank{measured['rank']}.json").write_text(json.dumps({"heap": args.heap, **measured}))


if __name__ == "__main__":
    main()
