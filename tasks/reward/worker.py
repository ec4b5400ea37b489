"""A reward worker process: scores one request at a time for the pool.

Started by the pool as ``python -m asyncrl.tasks.reward.worker --fd N`` with one end
of a socket pair. Protocol (pickled tuples over a multiprocessing Connection):

- pool -> worker: ``("config", dict)`` once, then ``("score", job_id, RewardRequest)``
  or ``("stop",)``;
- worker -> pool: ``("ready", pid)`` or ``("error", message)`` after loading, then
  ``("result", job_id, RewardResult)`` per request.

The worker runs math-verify in its main thread (its timeout is signal.alarm-based)
and exits when the pool's end of the socket closes or the pool's thread dies.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection

from asyncrl.tasks.reward.code_reward import score_code
from asyncrl.configs.reward import RewardConfig
from asyncrl.tasks.reward.math_reward import score_math
from asyncrl.tasks.reward.plugin import RewardFunction, load_plugin, score_plugin
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult, failure

_PR_SET_PDEATHSIG = 1


class Scorer:
    """Routes a request to its verifier: math, code (sandboxed) or the plug-in it names."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.sandbox = Sandbox(config.code)
        # Every configured plug-in loads at start: a broken one fails the pool's start, naming it.
        self.plugins: dict[str, RewardFunction] = {
            name: load_plugin(plugin.function, f"reward.plugins.{name}.function")
            for name, plugin in config.plugins.items()
        }
        if config.pool.preload_math:
            # sympy's import and math-verify's first parse take seconds: pay them before the first item.
            score_math("\\boxed{\\frac{1}{2}}", "0.5", config.math)

    def score(self, request: RewardRequest) -> RewardResult:
        """Score one request. A bug below is reported as verifier_error with its traceback's last frame."""
        start = time.monotonic()
        try:
            if request.kind == "math":
                if not isinstance(request.reference, str):
                    return failure(Reason.BAD_REQUEST, f"math reference must be str, got {type(request.reference).__name__}")
                return score_math(request.response, request.reference, self.config.math)
            if request.kind == "code":
                return score_code(request.response, request.reference, self.config.code, self.sandbox)
            function = self.plugins.get(request.plugin)
            if function is None:
                known = ", ".join(sorted(self.plugins)) or "none"
                return failure(
                    Reason.BAD_REQUEST,
                    f"plug-in {request.plugin!r} is not configured under reward.plugins (configured: {known})",
                )
            return score_plugin(function, request)
        except Exception as exc:  # noqa: BLE001 - never crash the worker; the reason says what broke
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return failure(
                Reason.VERIFIER_ERROR,
                f"{request.kind} verifier raised {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})",
                time.monotonic() - start,
            )


def serve(conn: Connection) -> int:
    """Worker main loop; returns the process exit status."""
    kind, payload = conn.recv()
    if kind != "config":
        raise RuntimeError(f"reward worker: expected the config message first, got {kind!r}")
    try:
        scorer = Scorer(RewardConfig.model_validate(payload))
    except Exception as exc:  # noqa: BLE001 - sent to the pool, which raises it from start()
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return 0  # the pool is gone
        if message[0] == "stop":
            return 0
        _, job_id, request = message
        conn.send(("result", job_id, scorer.score(request)))


def _die_with_parent() -> None:
    """SIGKILL this worker when the pool thread that started it ends (and check it has not already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="asyncrl reward worker (started by RewardPool)")
    parser.add_argument("--fd", type=int, required=True, help="socket to the pool")
    parser.add_argument("--parent", type=int, required=True, help="pid of the pool process")
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent:
        return 1  # the pool died before the death signal was armed
    return serve(Connection(args.fd))


if __name__ == "__main__":
    sys.exit(main())
