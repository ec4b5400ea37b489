"""A pool of reward worker processes that survives its workers.

One dispatcher thread owns the workers: it hands each idle worker one request at a time,
kills a worker that overruns its request's time budget, replaces one that dies, and
completes the batch when every item has a result (a failed item carries its reason; the
batch always completes). Workers are separate interpreters
(``python -m asyncrl.tasks.reward.worker``), not forks, so a pool can start from a threaded
process; they start with an allow-listed environment (``environ.worker_environment``), so
the caller's secrets never reach a worker, a plug-in or a sandbox. Which caps bound each
sandbox (a cgroup per sandbox, v2 or v1, or per-process rlimits) is decided once when the
pool starts (``sandbox_cgroup.decide_caps``), handed to every worker, and reported in the stats
(``PoolStats.caps``); with ``reward.code.require_cgroup`` a pool without a cgroup does not start.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from queue import Empty, SimpleQueue
from typing import Any

from asyncrl.configs.reward import RewardConfig
from asyncrl.tasks.reward.environ import worker_environment
from asyncrl.tasks.reward.sandbox_cgroup import SandboxCaps, decide_caps
from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult, failure

_STOP_WAIT_S = 2.0


class RewardPoolError(RuntimeError):
    """The pool cannot score: it failed to start, is closed, or its workers cannot load."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's counters (a copy; safe to keep)."""

    workers: int
    completed: int
    pending: int
    busy: int
    reasons: dict[str, int]
    reasons_by_kind: dict[str, dict[str, int]]
    worker_restarts: int
    workers_killed_for_timeout: int
    caps: str = ""
    """What caps each code sandbox: ``caps: cgroup v2 (...)``, ``caps: cgroup v1 (...)`` or
    ``caps: rlimit (...: reason)`` (``SandboxCaps.describe``); empty before the pool starts."""


def request_budget_s(request: RewardRequest, config: RewardConfig) -> float:
    """Seconds a request may run before the pool kills its worker.

    - math: math.timeout_s + pool.kill_grace_s (math-verify stops itself first);
    - code: n_tests * (wall + 1) + pool.kill_grace_s, where wall is the problem's wall limit per
      test, min(tests.time_limit_s, limits.wall_s) (each sandbox run stops itself first);
    - plugin: plugins[request.plugin].timeout_s (a user function has no timeout of its own);
      pool.kill_grace_s for a name that is not configured (the worker answers bad_request at once).
    """
    grace = config.pool.kill_grace_s
    if request.kind == "math":
        return config.math.timeout_s + grace
    if request.kind == "code":
        tests = request.reference
        wall = config.code.limits.wall_s
        if tests.time_limit_s is not None:
            wall = min(wall, tests.time_limit_s)
        return tests.count * (wall + 1.0) + grace
    plugin = config.plugins.get(request.plugin)
    return plugin.timeout_s if plugin is not None else grace


@dataclass
class _Batch:
    future: Future[list[RewardResult]]
    results: list[RewardResult | None]
    remaining: int


@dataclass
class _Job:
    job_id: int
    batch: _Batch
    index: int
    request: RewardRequest
    budget_s: float


@dataclass
class _Worker:
    slot: int
    proc: subprocess.Popen[bytes]
    conn: Connection
    pidfd: int
    ready: bool = False
    gone: bool = False
    job: _Job | None = None
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)


class RewardPool:
    """Score batches of RewardRequests in ``config.pool.workers`` processes.

    Use as a context manager, or ``start()`` / ``close()``. ``submit()`` returns a
    concurrent Future; ``await pool.score(batch)`` is the asyncio form.
    """

    def __init__(self, config: RewardConfig, workers: int | None = None) -> None:
        self.config = config
        self.size = workers if workers is not None else config.pool.workers
        if self.size < 1:
            raise ValueError(f"RewardPool: workers must be >= 1, got {self.size}")
        self._inbox: SimpleQueue[list[_Job]] = SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._reasons: Counter[str] = Counter()
        self._reasons_by_kind: dict[str, Counter[str]] = {}
        self._completed = 0
        self._restarts = 0
        self._killed = 0
        self._pending_count = 0
        self._busy_count = 0
        self._ready = threading.Event()
        self._error: str | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_job = 0
        self._pids: list[int] = []
        self.caps: SandboxCaps | None = None
        """The code sandboxes' caps, decided by ``start()`` (None before)."""
        self._worker_config = config

    # -- public API ---------------------------------------------------------------------

    def start(self) -> RewardPool:
        """Start the workers and wait until each has loaded its verifiers. Refused when
        ``reward.code.require_cgroup`` is set and no cgroup can cap the code sandboxes."""
        if self._thread is not None:
            raise RewardPoolError("RewardPool.start: already started")
        code = self.config.code
        self.caps = decide_caps(code, sandboxed=shutil.which(code.bwrap) is not None)
        refusal = self.caps.refusal(code)
        if refusal is not None:
            self.close()
            raise RewardPoolError(f"reward pool failed to start: {refusal}")
        self._worker_config = self.config.model_copy(update={"code": self.caps.for_workers(code)})
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()
        timeout = self.config.pool.startup_timeout_s
        if not self._ready.wait(timeout) or self._error is not None:
            error = self._error or f"workers not ready after {timeout} s"
            self.close()
            raise RewardPoolError(f"reward pool failed to start: {error}")
        return self

    def submit(self, requests: Sequence[RewardRequest]) -> Future[list[RewardResult]]:
        """Queue a batch; the future's result lists one RewardResult per request, in order."""
        self._check_usable()
        for i, request in enumerate(requests):
            if not isinstance(request, RewardRequest):
                raise TypeError(f"RewardPool.submit: requests[{i}] is a {type(request).__name__}, not a RewardRequest")
        future: Future[list[RewardResult]] = Future()
        if not requests:
            future.set_result([])
            return future
        batch = _Batch(future, [None] * len(requests), len(requests))
        jobs = []
        with self._lock:
            for index, request in enumerate(requests):
                self._next_job += 1
                jobs.append(_Job(self._next_job, batch, index, request, request_budget_s(request, self.config)))
        self._inbox.put(jobs)
        self._wake()
        return future

    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """asyncio form of submit(): ``results = await pool.score(batch)``."""
        return await asyncio.wrap_future(self.submit(requests))

    def score_sync(self, requests: Sequence[RewardRequest], timeout: float | None = None) -> list[RewardResult]:
        """Blocking form of submit()."""
        return self.submit(requests).result(timeout)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                workers=self.size,
                completed=self._completed,
                pending=self._pending_count,
                busy=self._busy_count,
                reasons=dict(self._reasons),
                reasons_by_kind={kind: dict(c) for kind, c in self._reasons_by_kind.items()},
                worker_restarts=self._restarts,
                workers_killed_for_timeout=self._killed,
                caps=self.caps_report,
            )

    @property
    def caps_report(self) -> str:
        """``SandboxCaps.describe`` of the code sandboxes' caps; empty before ``start()``."""
        return self.caps.describe(self.config.code.limits) if self.caps is not None else ""

    def worker_pids(self) -> list[int]:
        """Pids of the current workers (for supervision and tests)."""
        with self._lock:
            return list(self._pids)

    @property
    def healthy(self) -> bool:
        """True while the dispatcher runs and no fatal error happened."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> str | None:
        return self._error

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers; batches still pending fail with RewardPoolError."""
        self._closing.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass  # closed by an earlier close()
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission helpers -----------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._thread is None:
            raise RewardPoolError("RewardPool: not started (use start() or a with-block)")
        if self._closing.is_set():
            raise RewardPoolError("RewardPool: closed")
        if self._error is not None:
            raise RewardPoolError(f"RewardPool: broken: {self._error}")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or the pool is closed

    # -- dispatcher thread ------------------------------------------------------------------

    def _run(self) -> None:
        workers: dict[int, _Worker] = {}
        pending: deque[_Job] = deque()
        try:
            for slot in range(self.size):
                workers[slot] = self._spawn(slot)
            self._publish_pids(workers)
            while not self._closing.is_set() and self._error is None:
                self._drain_inbox(pending)
                self._assign(workers, pending)
                waitables: list[Any] = [self._wake_r]
                for w in workers.values():
                    waitables += [w.conn, w.pidfd]
                ready = set(wait(waitables, self._next_timeout(workers)))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                for w in list(workers.values()):
                    if w.conn in ready:
                        self._read(w, workers)
                for w in list(workers.values()):
                    if w.pidfd in ready or w.gone:
                        self._replace(w, workers, pending, killed=False)
                self._enforce_deadlines(workers, pending)
        except BaseException as exc:  # noqa: BLE001 - recorded: every waiting caller gets it
            self._error = f"dispatcher crashed: {type(exc).__name__}: {exc}"
        finally:
            self._ready.set()
            error = RewardPoolError(f"RewardPool: {self._error or 'closed'}")
            self._shutdown(workers)
            for job in pending:
                self._fail_batch(job.batch, error)
            for w in workers.values():
                if w.job is not None:
                    self._fail_batch(w.job.batch, error)
            while True:
                try:
                    jobs = self._inbox.get_nowait()
                except Empty:
                    break
                for job in jobs:
                    self._fail_batch(job.batch, error)

    def _drain_inbox(self, pending: deque[_Job]) -> None:
        """Move submitted jobs to the pending queue, oldest batch first."""
        while True:
            try:
                pending.extend(self._inbox.get_nowait())
            except Empty:
                break
        with self._lock:
            self._pending_count = len(pending)

    def _spawn(self, slot: int) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "asyncrl.tasks.reward.worker",
                    "--fd", str(child_sock.fileno()), "--parent", str(os.getpid()),
                ],
                pass_fds=[child_sock.fileno()],
                env=worker_environment(os.environ),  # allow-listed: no secret reaches a worker
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: killed as a whole on a timeout
            )  # fmt: skip
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        conn.send(("config", self._worker_config.model_dump(mode="json")))
        return _Worker(slot=slot, proc=proc, conn=conn, pidfd=os.pidfd_open(proc.pid))

    def _read(self, w: _Worker, workers: dict[int, _Worker]) -> None:
        """Handle every message a worker has sent."""
        while not w.gone:
            try:
                if not w.conn.poll(0):
                    return
                message = w.conn.recv()
            except (EOFError, OSError):
                w.gone = True
                return
            if message[0] == "ready":
                w.ready = True
                if all(x.ready for x in workers.values()):
                    self._ready.set()
            elif message[0] == "error":
                self._error = f"worker {w.proc.pid} could not load: {message[1]}"
            elif message[0] == "result":
                _, job_id, result = message
                if w.job is not None and w.job.job_id == job_id:
                    self._complete(w.job, result)
                    w.job = None
                    self._count_busy(workers)

    def _assign(self, workers: dict[int, _Worker], pending: deque[_Job]) -> None:
        for w in workers.values():
            if not pending:
                break
            if not w.ready or w.gone or w.job is not None:
                continue
            job = pending.popleft()
            try:
                w.conn.send(("score", job.job_id, job.request))
            except OSError:
                pending.appendleft(job)  # never received: give it to another worker
                w.gone = True
                continue
            w.job = job
            w.deadline = time.monotonic() + job.budget_s
        with self._lock:
            self._pending_count = len(pending)
        self._count_busy(workers)

    def _enforce_deadlines(self, workers: dict[int, _Worker], pending: deque[_Job]) -> None:
        now = time.monotonic()
        for w in list(workers.values()):
            if w.job is not None and now >= w.deadline:
                self._replace(w, workers, pending, killed=True)

    def _replace(self, w: _Worker, workers: dict[int, _Worker], pending: deque[_Job], killed: bool) -> None:
        """Reap a dead (or kill an overrunning) worker, give its item a reason, start a new one."""
        self._read(w, workers)  # a result sent just before dying still counts
        if killed or w.proc.poll() is None:
            _kill_group(w.proc.pid)  # overran its budget, or lost its socket but still runs
        status = w.proc.wait()
        w.conn.close()
        os.close(w.pidfd)
        if not w.ready and self._error is None:
            self._error = f"worker {w.proc.pid} exited with {_describe_status(status)} before it was ready"
        job = w.job
        if job is not None:
            if killed:
                result = failure(
                    Reason.TIMEOUT,
                    f"{job.request.kind} item exceeded its budget of {job.budget_s:.1f} s; "
                    f"worker {w.proc.pid} killed and replaced",
                    job.budget_s,
                )
            else:
                result = failure(
                    Reason.WORKER_DIED,
                    f"worker {w.proc.pid} died ({_describe_status(status)}) while scoring this "
                    f"{job.request.kind} item; replaced",
                    time.monotonic() - (w.deadline - job.budget_s),
                )
            self._complete(job, result)
        del workers[w.slot]
        with self._lock:
            self._restarts += 1
            self._killed += int(killed)
        if self._error is None and not self._closing.is_set():
            workers[w.slot] = self._spawn(w.slot)
        self._publish_pids(workers)
        self._count_busy(workers)

    def _complete(self, job: _Job, result: RewardResult) -> None:
        batch = job.batch
        batch.results[job.index] = result
        batch.remaining -= 1
        with self._lock:
            self._completed += 1
            self._reasons[result.reason.value] += 1
            self._reasons_by_kind.setdefault(job.request.kind, Counter())[result.reason.value] += 1
        if batch.remaining == 0 and not batch.future.done():
            batch.future.set_result([r for r in batch.results if r is not None])

    def _fail_batch(self, batch: _Batch, error: Exception) -> None:
        if not batch.future.done():
            batch.future.set_exception(error)

    def _next_timeout(self, workers: dict[int, _Worker]) -> float | None:
        deadlines = [w.deadline for w in workers.values() if w.job is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _count_busy(self, workers: dict[int, _Worker]) -> None:
        with self._lock:
            self._busy_count = sum(w.job is not None for w in workers.values())

    def _publish_pids(self, workers: dict[int, _Worker]) -> None:
        with self._lock:
            self._pids = [w.proc.pid for w in workers.values()]

    def _shutdown(self, workers: dict[int, _Worker]) -> None:
        """Ask each worker to stop, then SIGKILL the stragglers' process groups."""
        for w in workers.values():
            try:
                w.conn.send(("stop",))
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + _STOP_WAIT_S
        for w in workers.values():
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(w.proc.pid)
                w.proc.wait()
            w.conn.close()
            os.close(w.pidfd)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _describe_status(status: int) -> str:
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    return f"exit status {status}"
