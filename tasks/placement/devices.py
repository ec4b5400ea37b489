"""Device placement: what ``inference.devices[k]`` and ``trainer.devices`` mean on the machine
where the component starts, decided there (a remote component's machine, not the flow's).

:func:`detect_machine` finds GPUs without importing torch (``nvidia-smi -L``, then device
files); the GPUs this process may hand out follow its own ``CUDA_VISIBLE_DEVICES``.
:func:`place` maps a device set: on a GPU machine device id i is the i-th GPU this process
sees (``CUDA_VISIBLE_DEVICES`` in the component's environment); on a machine without GPUs
the ids are CPU ids the component is pinned to. An id the machine lacks is refused at start
with :class:`DeviceError`. Servers sharing a GPU (``placement.share_devices``) split vLLM's
memory budget (:func:`shared_gpu_memory_fraction`). Rules in full:
``docs/internals/launch.md``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.configs.inference import InferenceConfig
from asyncrl.configs.processes import ServerLaunchConfig
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.cpus import machine_cpus

CUDA_ENV = "CUDA_VISIBLE_DEVICES"
GPU_MEMORY_BUDGET = 0.9
"""Share of a shared GPU's memory its n holders divide: each vLLM server on it takes
GPU_MEMORY_BUDGET / n, leaving the rest to the others (vLLM alone takes 0.92 by default)."""
_NVIDIA_SMI_TIMEOUT_S = 15.0
_GPU_LINE = re.compile(r"^GPU \d+:")
_DEVICE_FILE = re.compile(r"^nvidia\d+$")


class DeviceError(ValueError):
    """A device set that this machine cannot give; the message names the field."""


@dataclass(frozen=True)
class Machine:
    """What the machine a component starts on offers this process."""

    gpus: tuple[str, ...] = ()
    """``CUDA_VISIBLE_DEVICES`` entries of the GPUs this process sees, in CUDA order; () = none."""
    cpus: frozenset[int] = field(default_factory=machine_cpus)
    """CPU ids of the machine."""
    gpu_source: str = "no NVIDIA GPU found"
    """How ``gpus`` was found (shown in errors)."""

    @property
    def has_gpus(self) -> bool:
        return bool(self.gpus)

    def describe(self) -> str:
        """What the machine offers, for error messages."""
        if self.gpus:
            return f"it has {len(self.gpus)} GPU(s), device ids 0-{len(self.gpus) - 1} ({self.gpu_source})"
        return f"it has no GPU ({self.gpu_source}), so device ids are CPU ids: CPUs {id_ranges(self.cpus)}"


@dataclass(frozen=True)
class DevicePlacement:
    """How one component is started on its devices."""

    env: Mapping[str, str] = field(default_factory=dict)
    """Environment to add (``CUDA_VISIBLE_DEVICES`` on a GPU machine), else empty."""
    cpu_cores: tuple[int, ...] | None = None
    """CPU ids to pin to; None = no pinning."""

    @property
    def cuda_visible_devices(self) -> str | None:
        return self.env.get(CUDA_ENV)


def id_ranges(ids: Sequence[int] | frozenset[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ordered = sorted(set(ids))
    if not ordered:
        return "none"
    runs: list[tuple[int, int]] = [(ordered[0], ordered[0])]
    for value in ordered[1:]:
        start, end = runs[-1]
        runs[-1:] = [(start, value)] if value == end + 1 else [(start, end), (value, value)]
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def count_gpus_nvidia_smi() -> int | None:
    """GPUs ``nvidia-smi -L`` lists, or None when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return sum(1 for line in done.stdout.splitlines() if _GPU_LINE.match(line.strip()))


def count_gpus_files(dev: Path = Path("/dev"), proc: Path = Path("/proc/driver/nvidia/gpus")) -> tuple[int, str]:
    """GPUs seen as ``/dev/nvidia<N>`` files, else as ``/proc/driver/nvidia/gpus`` entries."""
    try:
        files = [p for p in dev.iterdir() if _DEVICE_FILE.match(p.name)]
    except OSError:
        files = []
    if files:
        return len(files), f"{len(files)} /dev/nvidia<N> device file(s)"
    try:
        entries = list(proc.iterdir())
    except OSError:
        entries = []
    if entries:
        return len(entries), f"{len(entries)} entries in {proc}"
    return 0, f"no nvidia-smi GPU, {dev}/nvidia<N> file or {proc} entry found"


@functools.cache
def gpu_hardware() -> tuple[int, str]:
    """(GPUs of this machine, how they were found): ``nvidia-smi -L``, else the device files.
    Cached: the hardware does not change while a process runs."""
    listed = count_gpus_nvidia_smi()
    if listed is not None:
        return listed, f"nvidia-smi -L lists {listed}"
    return count_gpus_files()


def visible_gpus(count: int, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs a process with environment ``environ`` sees on a machine of ``count`` GPUs:
    its ``CUDA_VISIBLE_DEVICES`` entries up to the first invalid one, else ``0 .. count-1``."""
    if count <= 0:
        return ()
    if CUDA_ENV not in environ:
        return tuple(str(i) for i in range(count))
    visible: list[str] = []
    for entry in environ[CUDA_ENV].split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < count:
            visible.append(str(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")):
            visible.append(entry)
        else:
            break  # CUDA ignores this entry and every one after it
    return tuple(visible)


def detect_machine(
    environ: Mapping[str, str] | None = None, hardware: Callable[[], tuple[int, str]] = gpu_hardware
) -> Machine:
    """This machine as this process sees it (see the module docstring). ``hardware`` counts
    the GPUs (replaceable for tests); ``environ`` defaults to this process's environment."""
    environ = os.environ if environ is None else environ
    count, source = hardware()
    gpus = visible_gpus(count, environ)
    if count and CUDA_ENV in environ:
        source += f"; {CUDA_ENV}={environ[CUDA_ENV]!r} in this process's environment"
    return Machine(gpus=gpus, cpus=machine_cpus(), gpu_source=source)


def place(
    ids: Sequence[int] | None,
    field_name: str,
    machine: Machine,
    cpu_cores: Sequence[int] | None = None,
    cpu_cores_field: str = "cpu_cores",
) -> DevicePlacement:
    """The start of a component with device set ``ids`` (config field ``field_name``) and CPU
    pinning ``cpu_cores`` (field ``cpu_cores_field``) on ``machine``; the mapping rule is in the
    module docstring. :class:`DeviceError` naming the field for a missing device, or for both
    settings on a machine without GPUs."""
    cores = tuple(sorted(set(cpu_cores))) if cpu_cores is not None else None
    if ids is None:
        return DevicePlacement({}, cores)
    if machine.has_gpus:
        missing = sorted({i for i in ids if not 0 <= i < len(machine.gpus)})
        if missing:
            raise DeviceError(
                f"{field_name}: device {', '.join(map(str, missing))} is not on this machine: {machine.describe()}"
            )
        return DevicePlacement({CUDA_ENV: ",".join(machine.gpus[i] for i in ids)}, cores)
    if cores is not None:
        raise DeviceError(
            f"{cpu_cores_field}: set together with {field_name} on a machine without GPUs, where {field_name} "
            f"are CPU ids too: two ways to say the same pinning; keep one ({machine.gpu_source})"
        )
    missing = sorted(set(ids) - machine.cpus)
    if missing:
        raise DeviceError(
            f"{field_name}: device {', '.join(map(str, missing))} is not on this machine: {machine.describe()}"
        )
    return DevicePlacement({}, tuple(sorted(set(ids))))


def rollout_placement(inference: InferenceConfig, index: int, machine: Machine) -> DevicePlacement:
    """Rollout server ``index``'s start: ``inference.devices[index]`` and ``inference.cpu_cores``;
    ``ValueError`` naming the field when the list has no entry for ``index`` (a server added to a
    running run past ``num_servers`` needs its own)."""
    if inference.devices is not None and not 0 <= index < len(inference.devices):
        raise ValueError(
            f"inference.devices: {len(inference.devices)} entries, none for rollout server {index}; "
            "give every server its device set (one entry per server, an added server's too)"
        )
    ids = inference.devices[index] if inference.devices is not None else None
    return place(ids, f"inference.devices[{index}]", machine, inference.cpu_cores, "inference.cpu_cores")


def trainer_placement(config: RunConfig, machine: Machine) -> DevicePlacement:
    """The trainer's start (all its processes on this node): ``trainer.devices`` and
    ``trainer.cpu_cores``. Under torchrun, local rank r computes on the r-th device."""
    return place(config.trainer.devices, "trainer.devices", machine, config.trainer.cpu_cores, "trainer.cpu_cores")


def evaluator_placement(config: ServerLaunchConfig, machine: Machine) -> DevicePlacement:
    """The evaluator's vLLM server (evaluation during training): ``pipeline.training_eval.devices``."""
    return place(config.pipeline.training_eval.devices, "pipeline.training_eval.devices", machine)


def _device_holders(config: ServerLaunchConfig, place_of: object) -> list[set[int]]:
    """The device sets of the components on placement ``place_of``: each rollout server's,
    the trainer's, and the evaluator's (it runs ``local``, when on and given devices)."""
    holders: list[set[int]] = []
    if config.inference.devices is not None and config.placement.rollout_server == place_of:
        holders.extend(set(ids) for ids in config.inference.devices)
    if config.trainer.devices is not None and config.placement.trainer == place_of:
        holders.append(set(config.trainer.devices))
    evaluator = config.pipeline.training_eval.devices
    if config.pipeline.eval_every and evaluator is not None and place_of == "local":
        holders.append(set(evaluator))
    return holders


def _memory_share(mine: set[int], holders: list[set[int]]) -> float | None:
    sharers = max(sum(1 for held in holders if device in held) for device in mine)
    if sharers <= 1:
        return None
    return int(GPU_MEMORY_BUDGET / sharers * 100) / 100


def shared_gpu_memory_fraction(config: RunConfig, index: int) -> float | None:
    """``gpu_memory_utilization`` of rollout server ``index`` on a GPU machine:
    ``GPU_MEMORY_BUDGET / n`` (rounded down to 0.01), n = the most components on the server's
    placement that hold one of its device ids; None when no other component holds them (vLLM's
    default). Components without a device set are not counted."""
    devices = config.inference.devices
    if devices is None:
        return None
    return _memory_share(set(devices[index]), _device_holders(config, config.placement.rollout_server))


def evaluator_gpu_memory_fraction(config: ServerLaunchConfig) -> float | None:
    """``gpu_memory_utilization`` of the evaluator's server, by the rule of
    :func:`shared_gpu_memory_fraction` among the components on the ``local`` placement."""
    ids = config.pipeline.training_eval.devices
    if ids is None:
        return None
    return _memory_share(set(ids), _device_holders(config, "local"))
