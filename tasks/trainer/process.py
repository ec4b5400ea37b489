"""The trainer as an OS process group: its command line and its start.

The trainer (``python -m asyncrl.tasks.trainer.main``, or ``torchrun`` with one process
per device) runs in its own session, so the whole group can be signalled at once; the one
supervisor (:mod:`asyncrl.tasks.launch.supervisor`) runs it for RL and for the SFT warm start
alike. On Linux the trainer also gets SIGKILL if the thread that started it dies without
cleaning up (``PR_SET_PDEATHSIG``), so no trainer outlives a killed supervisor.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.tasks.system.process_group import spawn_session
from asyncrl.configs.cpus import check_cpu_cores

MODULE = "asyncrl.tasks.trainer.main"
# The supervisor's own process-group variables (if it is itself a torch.distributed
# process, e.g. a test) must not leak: the trainer picks its own port and ranks.
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""What cuBLAS needs, set before CUDA starts, for deterministic matrix products
(``trainer.deterministic``); without effect on CPU."""


@dataclass(frozen=True)
class TrainerLaunch:
    """How to start the trainer process."""

    config_path: Path
    log_path: Path
    overrides: tuple[str, ...] = ()
    mode: str = "rl"
    work_dir: Path | None = None
    """Local scratch directory (default: the config's). Checkpoints and the initial weights
    pass through it; every node of a multi-node trainer has its own (a local disk)."""
    metrics_file: Path | None = None
    wait_timeout_s: float | None = None
    nproc: int = 1
    """Processes (devices) on this node; above 1 (or with ``nnodes`` > 1) the trainer starts under ``torchrun``."""
    nnodes: int = 1
    """Nodes of the trainer; above 1 every node runs this launch and they meet at ``rendezvous``."""
    rendezvous: str | None = None
    """``host:port`` of torchrun's c10d rendezvous (``nnodes`` > 1)."""
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    cpu_cores: tuple[int, ...] | None = None
    """Linux: CPU ids the trainer and its workers are pinned to (``sched_setaffinity`` before
    ``exec``); None = no pinning."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu_cores", check_cpu_cores(self.cpu_cores, "TrainerLaunch.cpu_cores"))


def trainer_command(launch: TrainerLaunch) -> list[str]:
    """The command line of the trainer process group."""
    if launch.nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {launch.nproc}")
    if launch.nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {launch.nnodes}")
    if launch.nnodes > 1 and not launch.rendezvous:
        raise ValueError(f"nnodes={launch.nnodes} needs a rendezvous host:port")
    torchrun = [launch.python, "-m", "torch.distributed.run", f"--log-dir={torchrun_log_dir(launch)}"]
    if launch.nproc == 1 and launch.nnodes == 1:
        command = [launch.python, "-m", MODULE]
    elif launch.nnodes == 1:
        command = [*torchrun, "--standalone", f"--nproc-per-node={launch.nproc}", "-m", MODULE]
    else:
        command = [
            *torchrun, f"--nnodes={launch.nnodes}", f"--nproc-per-node={launch.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rendezvous}", "-m", MODULE,
        ]  # fmt: skip
    command += ["--config", str(launch.config_path), "--mode", launch.mode]
    if launch.work_dir is not None:
        command += ["--work-dir", str(launch.work_dir)]
    if launch.metrics_file is not None:
        command += ["--metrics-file", str(launch.metrics_file)]
    if launch.wait_timeout_s is not None:
        command += ["--wait-timeout", str(launch.wait_timeout_s)]
    return command + list(launch.overrides)


def torchrun_log_dir(launch: TrainerLaunch) -> Path:
    """Where torchrun keeps its per-start directory (a failed rank's error file): beside the
    trainer's log, instead of a ``torchelastic_*`` directory in ``/tmp`` that nothing removes."""
    return launch.log_path.parent / "torchrun"


def torch_extensions_dir() -> Path:
    """Where DeepSpeed builds its JIT ops unless ``TORCH_EXTENSIONS_DIR`` says otherwise: inside
    this environment (as ``make`` sets it), not the shared ``~/.cache/torch_extensions`` that
    every venv rebuilds and where a build killed midway leaves a lock that hangs the next."""
    return Path(sys.prefix) / "torch_extensions"


def with_torch_extensions_dir(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with :func:`torch_extensions_dir` as ``TORCH_EXTENSIONS_DIR`` unless it sets
    one: where the trainer loads DeepSpeed's JIT ops and where they are built ahead
    (:mod:`asyncrl.tasks.trainer.jit_ops`)."""
    return {"TORCH_EXTENSIONS_DIR": str(torch_extensions_dir()), **environ}


def without_process_group_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without :data:`DIST_ENV`: a process that built an engine holds its
    MASTER_PORT, which a trainer it starts must not inherit."""
    return {k: v for k, v in environ.items() if k not in DIST_ENV}


def trainer_env(launch: TrainerLaunch) -> dict[str, str]:
    """This process's environment without its process-group variables, with a per-venv
    ``TORCH_EXTENSIONS_DIR`` default (a Prefect worker is not started by ``make``), plus ``launch.env``."""
    inherited = with_torch_extensions_dir(without_process_group_env(os.environ))
    return {**inherited, **launch.env}


def start_trainer(launch: TrainerLaunch) -> subprocess.Popen[bytes]:
    """Spawn the trainer in a new session (its pid is the process group id), logging to ``log_path``."""
    return spawn_session(trainer_command(launch), launch.log_path, env=trainer_env(launch), cores=launch.cpu_cores)


