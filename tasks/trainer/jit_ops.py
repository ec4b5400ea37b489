"""DeepSpeed's just-in-time compiled ops, built before the first trainer needs them.

On CPU, ``deepspeed.init_distributed`` loads DeepSpeed's shared-memory collective op
(``deepspeed_shm_comm``), which DeepSpeed compiles on first use: a long wait inside the
first trainer start of a fresh environment (a user's first run, a benchmark's first measured
run, whichever test starts a trainer first). Built once into ``TORCH_EXTENSIONS_DIR``
(:func:`~asyncrl.tasks.trainer.process.with_torch_extensions_dir`), it then loads without
compiling. ``make setup`` runs ``python -m asyncrl.tasks.trainer.build_ops`` after installing,
and the benchmarks that time trainers call :func:`ensure_jit_ops_built` before they measure.
An accelerator without such ops (CUDA's collectives are NCCL's) builds nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from asyncrl.tasks.trainer.process import with_torch_extensions_dir

BUILD_MODULE = "asyncrl.tasks.trainer.build_ops"
"""The process that builds them (:mod:`asyncrl.tasks.trainer.build_ops`)."""
JIT_OP_BUILDERS = ("ShareMemCommBuilder",)
"""The op builders the trainer's start loads (``deepspeed.comm.torch.build_shm_op``)."""


def build_jit_ops(builders: Sequence[str] = JIT_OP_BUILDERS) -> list[str]:
    """Build (or, when built, load) each op of ``builders`` this accelerator has and this
    DeepSpeed install can compile; return the names of those it loaded. Builds into
    ``TORCH_EXTENSIONS_DIR``, which must be set (see
    :func:`~asyncrl.tasks.trainer.process.with_torch_extensions_dir`)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    loaded = []
    for name in builders:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        builder.load()
        loaded.append(builder.absolute_name())
    return loaded


class JitOpsBuildError(RuntimeError):
    """Building DeepSpeed's ops failed; the message carries the builder's output."""


def ensure_jit_ops_built(timeout_s: float = 900.0) -> str:
    """Build the trainer's ops in a child process (DeepSpeed stays out of the caller) and
    return its report line; :class:`JitOpsBuildError` with the build's output if it fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", BUILD_MODULE],
            env=with_torch_extensions_dir(os.environ),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise JitOpsBuildError(f"building DeepSpeed's ops took over {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        raise JitOpsBuildError(f"building DeepSpeed's ops failed (exit {done.returncode}):\n{output}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
