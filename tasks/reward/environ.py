"""The environments of reward workers and of sandboxed programs, written once.

A reward worker is started from a process (the trainer, the reward server) whose environment
holds secrets: cloud keys, API keys, the reward server's token. A worker needs none of them,
and everything it holds can leak (into a plug-in, into bubblewrap's readable
``/proc/1/environ``, into a crash report). So workers get ``worker_environment(os.environ)``:
only WORKER_ENV_NAMES and names starting with WORKER_ENV_PREFIXES, no ``ASYNCRL_*`` variable
(a worker reads its configuration from the pool's first message). Bubblewrap is started
with SANDBOX_ENV and gives the program the same variables and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

WORKER_ENV_NAMES: frozenset[str] = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE",
        "TMPDIR", "TEMP", "TMP",
        "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
        "PYTHONHASHSEED", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONWARNINGS", "PYTHONFAULTHANDLER",
        "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONPYCACHEPREFIX",
    }
)  # fmt: skip
"""Variables a reward worker keeps (when set in the pool's environment)."""
WORKER_ENV_PREFIXES: tuple[str, ...] = ("LC_",)
"""Prefixes of variables a reward worker keeps (the locale categories)."""

SANDBOX_PATH = "/usr/bin:/bin"
SANDBOX_HOME = "/tmp"
SANDBOX_ENV: Mapping[str, str] = MappingProxyType(
    {
        "PATH": SANDBOX_PATH,
        "HOME": SANDBOX_HOME,
        "TMPDIR": SANDBOX_HOME,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
)
"""The whole environment of bubblewrap and of the sandboxed program."""


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of ``environ`` (a new dict, for ``Popen(env=...)``)."""
    return {
        name: value
        for name, value in environ.items()
        if name in WORKER_ENV_NAMES or name.startswith(WORKER_ENV_PREFIXES)
    }


def sandbox_setenv_args() -> list[str]:
    """bwrap arguments giving the program exactly SANDBOX_ENV: ``--clearenv --setenv NAME VALUE ...``."""
    args = ["--clearenv"]
    for name, value in SANDBOX_ENV.items():
        args += ["--setenv", name, value]
    return args
