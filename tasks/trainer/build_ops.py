"""Build DeepSpeed's just-in-time ops into ``TORCH_EXTENSIONS_DIR`` and print one report line:
``python -m asyncrl.tasks.trainer.build_ops`` (run by ``make setup``; the library side is
:mod:`asyncrl.tasks.trainer.jit_ops`)."""

from __future__ import annotations

import os

from asyncrl.tasks.trainer.jit_ops import build_jit_ops
from asyncrl.tasks.trainer.process import with_torch_extensions_dir


def main() -> int:
    os.environ.update(with_torch_extensions_dir(os.environ))
    loaded = build_jit_ops()
    where = os.environ["TORCH_EXTENSIONS_DIR"]
    print(f"DeepSpeed ops ready in {where}: {', '.join(loaded)}" if loaded else "no DeepSpeed op to build here")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
