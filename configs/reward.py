"""Configuration of the reward service: verifiers, sandbox limits, pool, named plug-ins.

Plain pydantic (no heavy import), so it can be embedded in the run config as a
``reward:`` section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncrl.configs.base import StrictModel


class MathRewardConfig(StrictModel):
    timeout_s: int = Field(5, ge=1, le=600, description="Budget of one math verification (parse both sides, compare), whole seconds.")
    """Whole seconds: math-verify's own timeout is signal.alarm-based."""


class SandboxLimits(StrictModel):
    cpu_s: int = Field(5, ge=1, le=3600, description="RLIMIT_CPU of each process of one test run, seconds.")
    """SIGXCPU at the limit, SIGKILL one second later."""
    wall_s: float = Field(10.0, gt=0.0, le=3600.0, description="Wall time of one test run; the whole sandbox is killed when it is over.")
    memory_mb: int = Field(512, ge=32, description="RLIMIT_AS of each process; with a cgroup also the memory limit of the whole sandbox, MiB.")
    """With a cgroup (``code.cgroup``; v2 memory.max, v1 memory.limit_in_bytes) the sandbox as
    a whole, its /tmp and /dev/shm files included, is capped at this too; without, only each
    process is (docs/sandbox.md)."""
    nproc: int = Field(16, ge=2, le=4096, description="RLIMIT_NPROC: processes and threads of the sandbox; with a cgroup also its pids.max.")
    """Counted inside the sandbox's own user namespace (so concurrent sandboxes do not share it)."""
    cpus: float = Field(1.0, ge=0.01, le=1024.0, description="With a cgroup, the CPU bandwidth of the whole sandbox: the CPUs its processes share.")
    """The sandbox's CPU bandwidth (quota per 100 ms period: v2 cpu.max, v1 cpu.cfs_quota_us).
    Only with a cgroup: RLIMIT_CPU bounds each process's CPU time, not how many cores a sandbox
    keeps busy at once."""
    nofile: int = Field(64, ge=8, le=65536, description="RLIMIT_NOFILE: open file descriptors per process.")
    fsize_mb: int = Field(16, ge=1, description="RLIMIT_FSIZE: largest file a process may write, MiB.")
    tmpfs_mb: int = Field(64, ge=1, description="Size of the private, writable /tmp (memory-backed, gone after the run), MiB.")
    output_bytes: int = Field(1 << 20, ge=1024, description="Most bytes read from each of stdout and stderr; more is an output_limit failure.")


class CodeRewardConfig(StrictModel):
    bwrap: str = Field("bwrap", description="bubblewrap executable (name on PATH or absolute path).")
    python: str | None = Field(None, description="Interpreter that runs the program inside the sandbox (under /usr).")
    """Interpreter that runs the program inside the sandbox; it must resolve under /usr
    (the only system tree mounted), never into a home directory. None: the first of
    /usr/bin/python3, /usr/local/bin/python3 that exists."""
    prlimit: str = Field("/usr/bin/prlimit", description="util-linux prlimit, which sets the rlimits inside the sandbox.")
    """util-linux prlimit, used inside the sandbox to set the rlimits after the user
    namespace exists (so RLIMIT_NPROC counts only that sandbox's processes)."""
    sandbox_uid: int = Field(65534, ge=1, description="Host uid (and gid) the sandbox runs as when the service runs as root.")
    """Host uid (and gid) the sandbox runs as when the service runs as root: root is
    exempt from RLIMIT_NPROC, so code must never run with host uid 0."""
    cgroup: Literal["auto", "off"] = Field("auto", description="`auto`: a cgroup (v2, else v1) caps each whole sandbox where the host allows; `off`: rlimits only.")
    """``auto``: decided once when the pool starts, and reported (``caps: ...`` in the pool's
    stats and the reward service's log): cgroup v2 where the unified hierarchy is mounted at
    /sys/fs/cgroup, else cgroup v1 where its memory, pids and cpu hierarchies are mounted and
    writable; where neither is available (controllers not delegated, read-only, processes of
    other programs in the own v2 cgroup) the rlimits alone cap, and the report says why. How to
    delegate a cgroup: docs/sandbox.md."""
    cgroup_parent: str | None = Field(None, description="cgroup v2 directory holding one cgroup per sandbox; null: made in the process's own cgroup(s).")
    """An absolute path under the cgroup v2 mount with the cpu, memory and pids controllers
    available (e.g. a directory delegated to the service's user); cgroup v2 only. None:
    ``asyncrl-sandboxes`` in the process's own cgroup (``/proc/self/cgroup``; on cgroup v1 in
    each of its memory, pids and cpu cgroups). On v2 the own cgroup's processes move to a leaf
    child ``asyncrl-leaf`` when they must (cgroup v2 lets only a cgroup without processes give
    its children controllers), and only if all are the service's own."""
    require_cgroup: bool = Field(False, description="Refuse to start the pool or score code unless a cgroup (v1 or v2) caps each sandbox.")
    """With ``true``, where no cgroup can cap the sandboxes (``cgroup: off`` included) the
    reward pool does not start and code is not scored (``sandbox_unavailable``); the error
    names this field and why no cgroup is available."""
    allow_unsandboxed: bool = Field(False, description="Run programs WITHOUT bubblewrap when bwrap is missing (unsafe).")
    """Run programs WITHOUT bubblewrap (rlimits and a temp dir only) when bwrap is missing.
    Unsafe for untrusted code: the program can read host files and use the network."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits, description="Resource limits of one test run in the sandbox.")
    scoring: Literal["fraction", "all"] = Field("fraction", description="Reward: share of tests passed (`fraction`) or 1 only if all pass (`all`).")
    """Reward = passed / total tests (fraction) or 1 if all pass else 0 (all; stops at
    the first failure)."""
    sandbox_per: Literal["program", "test"] = Field("program", description="One sandbox for all the tests of a program, or one per test.")
    """``program``: all the tests of one program run in one sandbox, each as its own process with
    the per-test limits (a sandbox start per program, not per test; see sandbox_driver.py);
    ``test``: a fresh sandbox for every test. The unsandboxed mode always runs tests one by one."""
    extract: Literal["last_fence", "first_fence", "whole"] = Field("last_fence", description="Which part of the response is the program.")
    """Which part of the response is the program: the last or first fenced block
    (a ```python block is preferred over other languages), or the whole response."""


    @field_validator("cgroup_parent")
    @classmethod
    def _absolute_cgroup_parent(cls, path: str | None) -> str | None:
        if path is not None and not path.startswith("/"):
            raise ValueError(f"{path!r} must be an absolute path (a directory under the cgroup v2 mount, /sys/fs/cgroup)")
        return path


class PluginRewardConfig(StrictModel):
    function: str = Field(min_length=3, description="Import path `package.module:function` or `/path/to/file.py:function`.")
    """Of ``f(response: str, reference, **metadata) -> float | tuple[float, str]``."""
    timeout_s: float = Field(10.0, gt=0.0, le=3600.0, description="Hard limit of one call: past it the worker is killed and replaced.")

    @field_validator("function")
    @classmethod
    def _has_function_name(cls, function: str) -> str:
        return check_import_path(function)


def check_import_path(function: str) -> str:
    """``function`` if it looks like ``<module or file>:<identifier>``, else ``ValueError``."""
    module, sep, name = function.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"{function!r} must look like 'package.module:function' or '/path/to/file.py:function'")
    return function


RESERVED_PLUGIN_NAMES = ("math", "code")
"""Task names scored by the built-in verifiers: no plug-in may take them."""


class PoolConfig(StrictModel):
    workers: int = Field(2, ge=1, le=256, description="Worker processes scoring in parallel.")
    startup_timeout_s: float = Field(120.0, gt=0.0, description="How long start() waits for every worker to load its verifiers.")
    kill_grace_s: float = Field(5.0, ge=0.0, description="Slack over a request's own limits before the pool kills its worker.")
    preload_math: bool = Field(True, description="Import math-verify (and sympy) when a worker starts, not on its first item.")


class RewardConfig(StrictModel):
    math: MathRewardConfig = Field(default_factory=MathRewardConfig, description="The math verifier (task `math`).")
    code: CodeRewardConfig = Field(default_factory=CodeRewardConfig, description="The code verifier (task `code`): sandbox and scoring.")
    plugins: dict[str, PluginRewardConfig] = Field(default_factory=dict, description="Users' own reward functions by name (a task name in data rows).")
    """Users' own reward functions by name: a ``plugin`` request goes to
    ``plugins[request.plugin]``; a prompt row whose task is that name is scored by it."""
    pool: PoolConfig = Field(default_factory=PoolConfig, description="The reward service's pool of worker processes.")

    @field_validator("plugins")
    @classmethod
    def _plugin_names(cls, plugins: dict[str, PluginRewardConfig]) -> dict[str, PluginRewardConfig]:
        """Plug-in names are Python identifiers (a task name in data rows), never ``math`` or ``code``."""
        for name in plugins:
            if name in RESERVED_PLUGIN_NAMES:
                raise ValueError(
                    f"reward.plugins.{name}: {name!r} is a built-in task ({', '.join(RESERVED_PLUGIN_NAMES)}); "
                    "name the plug-in otherwise"
                )
            if not name.isidentifier():
                raise ValueError(f"reward.plugins.{name}: plug-in name {name!r} must be an identifier (letters, digits, _)")
        return plugins
