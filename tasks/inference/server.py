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

import errno
import getpass
import importlib.metadata
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from threading import Event
from types import TracebackType
from typing import Self

import httpx
from asyncrl.tasks.system.network import is_loopback
from asyncrl.tasks.system.process_group import check_session_nice, child_setup_hook, kill_group, read_log_tail, usable_cpus
from asyncrl.configs.cpus import check_cpu_cores
from asyncrl.configs.secrets import API_KEY_ENV
from asyncrl.tasks.inference.client import GENERATE_PATH
from asyncrl.tasks.inference.vllm_platform import FORK_ENGINE_CORE_ENV

WORKER_EXTENSION = "asyncrl.tasks.inference.weight_sync.WeightSyncExtension"
AUTH_MIDDLEWARE = "asyncrl.tasks.inference.auth.BearerAuthMiddleware"
LOG_TAIL_LINES = 40
_HEALTH_POLL_S = 0.5
WARM_UP_TOKENS = 8
"""Decode steps of the start-up warm-up generation (:meth:`RolloutServer.is_ready`)."""


class RolloutServerError(RuntimeError):
    """The rollout server could not start, died, or refused a request.

    ``log_tail`` holds the last lines of the server log (empty if there is none).
    """

    def __init__(self, message: str, log_tail: str = "") -> None:
        full = f"{message}\n--- rollout server log (last lines) ---\n{log_tail}" if log_tail else message
        super().__init__(full)
        self.log_tail = log_tail


class PortInUseError(RolloutServerError):
    """The server's fixed port is taken by another process (found before spawning)."""


class ForeignServerError(RolloutServerError):
    """Something answers on the server's port, but it is not the server this object started."""


@dataclass(frozen=True)
class RolloutServerConfig:
    """How to start one rollout server."""

    model_dir: Path
    """HF-format model directory (config.json, *.safetensors, tokenizer files)."""
    host: str = "127.0.0.1"
    """Address to bind; anything but a loopback address requires ``api_key``."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    advertise_host: str | None = None
    """Host name in ``handle.url`` (what clients and the registry see); None = ``host``, or
    this machine's name (``socket.gethostname()``) when ``host`` is a wildcard address."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token every request but ``/health`` must carry; None = no auth (loopback only)."""
    kv_cache_gib: float = 1.0
    """KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``; on CPU it is integral, rounded up, >= 1)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None = the model's maximum."""
    served_model_name: str | None = None
    """Name requests may give as ``model``; None = ``model_dir`` as given to vLLM. The server
    also serves ``<name>-<nonce>`` (``handle.model``), unique to each start."""
    seed: int = 0
    """vLLM's sampling seed (``--seed``)."""
    enable_scale_out: bool = True
    """Serve vLLM's token-in/token-out ``POST /inference/v1/generate`` (``--enable-scale-out``),
    whose choices carry per-token ``weight_versions`` spans; the rollout client uses it."""
    extra_args: tuple[str, ...] = ()
    """Further ``api_server`` arguments, appended last."""
    log_path: Path | None = None
    """Server log file (stdout + stderr); None = a new temporary directory."""
    start_timeout_s: float = 600.0
    """Seconds :meth:`RolloutServer.wait_healthy` waits by default."""
    stop_grace_s: float = 15.0
    """Seconds between SIGTERM and SIGKILL in :meth:`RolloutServer.stop`."""
    die_with_parent: bool = True
    """Linux: the server gets SIGTERM when the *thread* that started it exits
    (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no orphaned server. Start the
    server from a thread that outlives it (the main thread, or the supervising task)."""
    cpu_cores: tuple[int, ...] | None = None
    """Linux: CPU ids the server and every process it spawns (vLLM's engine core) are pinned
    to (``sched_setaffinity`` before ``exec``); None = no pinning."""
    tensor_parallel_size: int = 1
    """GPUs (or CPU ranks) the model is sharded over (vLLM's ``--tensor-parallel-size``, given
    when above 1)."""
    cuda_visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` of the server (comma-separated GPU indices or UUIDs, at least
    ``tensor_parallel_size`` of them); None = inherited from this process."""
    gpu_memory_utilization: float | None = None
    """Share of each GPU's memory vLLM may take (``--gpu-memory-utilization``), lowered when
    other components share the GPU; None = vLLM's default."""
    dtype: str = "float32"
    """Parameter dtype (``--dtype``): the run's ``model.dtype``, the trainer's."""
    enforce_eager: bool = True
    """``--enforce-eager``: no CUDA graphs (on CPU they do not exist; on GPUs graphs are
    captured once per start, faster generation for a slower start), and nothing else
    compiled either: the server runs with ``TORCH_COMPILE_DISABLE=1`` (:func:`server_env`)."""
    session_nice: int | None = None
    """Lower CPU priority (nice 0..19) of the server's whole session, so that on a machine
    with few cores the processes beside it (driver, trainer) are not starved by vLLM's
    busy-polling engine (see :func:`~asyncrl.tasks.system.process_group.lower_own_session_priority`);
    None = unchanged."""
    worker_in_engine_process: bool = True
    """On CPU (the ``vllm-cpu`` build) with ``tensor_parallel_size`` 1: run vLLM's model worker
    inside its engine-core process (vLLM's ``uni`` executor, its own choice on a GPU) instead of
    a third spawned process that imports vLLM again, a large share of every start on few cores,
    and busy-polls a queue between the two. The worker's OpenMP threads are then the server's
    cores less one, at least one (:func:`cpu_worker_threads`, the count vLLM's CPU binding
    gives its worker); an ``OMP_NUM_THREADS`` in the environment wins. False = vLLM's CPU
    default, the multiprocess executor."""
    fork_engine_core: bool = True
    """With the worker in the engine core (``worker_in_engine_process`` on the ``vllm-cpu``
    build): the API server forks its engine-core process instead of spawning it as vLLM's CPU
    platform asks (:mod:`asyncrl.tasks.inference.vllm_platform`), so the engine core does not
    import vLLM again, a large share of every start. False = vLLM's spawn."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu_cores", check_cpu_cores(self.cpu_cores, "RolloutServerConfig.cpu_cores"))
        check_session_nice(self.session_nice, "RolloutServerConfig.session_nice")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"RolloutServerConfig.tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.cuda_visible_devices is not None:
            entries = self.cuda_visible_devices.split(",")
            if any(not entry or entry != entry.strip() for entry in entries):
                raise ValueError(
                    "RolloutServerConfig.cuda_visible_devices must be comma-separated GPU indices or UUIDs "
                    f"without spaces, got {self.cuda_visible_devices!r}"
                )
            if len(entries) < tp:
                raise ValueError(
                    f"RolloutServerConfig: tensor_parallel_size {tp} needs {tp} GPUs, cuda_visible_devices "
                    f"{self.cuda_visible_devices!r} names {len(entries)}"
                )
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"RolloutServerConfig.gpu_memory_utilization must be in (0, 1], got {utilization}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"RolloutServerConfig.port must be in [0, 65535], got {self.port}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"RolloutServerConfig.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"RolloutServerConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.start_timeout_s <= 0 or self.stop_grace_s < 0:
            raise ValueError(
                f"RolloutServerConfig: start_timeout_s must be > 0 and stop_grace_s >= 0, "
                f"got {self.start_timeout_s} and {self.stop_grace_s}"
            )
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ValueError("RolloutServerConfig.api_key must be a non-empty string without whitespace")
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"RolloutServerConfig: host {self.host!r} is not a loopback address; "
                "a server reachable from other machines needs api_key"
            )


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


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, or empty)."""
    return host in ("", "0.0.0.0", "::")


def server_urls(config: RolloutServerConfig, port: int) -> tuple[str, str]:
    """(advertised base URL, local probe URL) of a server bound to ``config.host:port``.

    Health probes stay on this machine: through loopback when bound to every interface.
    """
    wildcard = is_wildcard(config.host)
    advertised = config.advertise_host or (socket.gethostname() if wildcard else config.host)
    probe = ("::1" if ":" in config.host else "127.0.0.1") if wildcard else config.host
    return f"http://{_url_host(advertised)}:{port}", f"http://{_url_host(probe)}:{port}"


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the OS's pick for port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` naming ``host:port`` if a process listens there now.

    A bind test with ``SO_REUSEADDR`` (what the server itself binds with), so a port left in
    TIME_WAIT by our own stopped server is free, and one with a listener is not.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if is_wildcard(host) else host
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise RolloutServerError(f"rollout server cannot bind {_url_host(host)}:{port}: {exc.strerror}") from None
            raise PortInUseError(
                f"rollout server port {port} on {host} is already in use by another process; stop that "
                f"process (`ss -ltnp 'sport = :{port}'` shows it) or choose another port (rollout.base_port)"
            ) from None


def served_names(config: RolloutServerConfig, model_dir: Path, nonce: str) -> tuple[str, str]:
    """(name unique to this start, plain name): ``<name>-<nonce>`` and ``served_model_name``
    or the model directory."""
    plain = config.served_model_name or str(model_dir)
    return f"{plain}-{nonce}", plain


def served_name_args(config: RolloutServerConfig, model_dir: Path, nonce: str) -> list[str]:
    """``--served-model-name <name>-<nonce> <name>``: the first is the name responses carry
    and :meth:`RolloutServer.is_ready` looks for; requests may give either. Appended after
    ``extra_args``, so that it is the one vLLM takes."""
    return ["--served-model-name", *served_names(config, model_dir, nonce)]



def check_model_dir(model_dir: Path) -> Path:
    """``model_dir`` resolved, if it is a directory whose ``config.json`` is a JSON object.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the path otherwise: these
    mistakes are reported at once instead of after the server's slow imports.
    """
    resolved = Path(model_dir).expanduser().resolve()
    if not resolved.is_dir():
        raise FileNotFoundError(f"rollout server model directory {resolved} does not exist or is not a directory")
    config_path = resolved / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"rollout server model directory {resolved} has no config.json")
    try:
        content = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(content).__name__}")  # noqa: TRY004
    return resolved


def server_command(config: RolloutServerConfig, model_dir: Path, port: int) -> list[str]:
    """The api_server command line (no secrets: the key travels in the environment), less the
    served model names that :meth:`RolloutServer.start` appends (:func:`served_name_args`)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        config.host,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        *(["--enforce-eager"] if config.enforce_eager else []),
        "--seed",
        str(config.seed),
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.enable_scale_out:
        command += ["--enable-scale-out"]
    if config.api_key is not None:
        command += ["--middleware", AUTH_MIDDLEWARE]
    if config.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    return command + list(config.extra_args)


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
    """The server's environment: ours plus dev mode, KV cache size, (if set) the key and
    (if set) ``CUDA_VISIBLE_DEVICES``; on CPU with ``worker_in_engine_process``,
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
            "(rollout.base_port)",
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
