"""A real vLLM server on the tiny model: API, auth, in-place weight loads, shutdown.

One server for the whole module, started the way a run starts it (:func:`supervise` of a
:class:`RolloutComponent` in a thread, with an API key and no restarts); tests run in file
order and the last one kills the server's engine and checks the clean-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from typing import Any

import httpx
import pytest
import process_scan
import s3_servers
from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.server_registry import list_servers, read_server
from asyncrl.tasks.inference.server import RolloutServerHandle, vllm_is_cpu_build
from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.weight_sync import (
    WeightSyncError,
    server_weight_version,
    set_server_weight_version,
    tensor_fingerprint,
    update_server_weights,
)
from asyncrl.tasks.launch.components import RolloutComponent
from asyncrl.tasks.launch.supervisor import ComponentFailed, ComponentStatus, RestartPolicy, supervise

pytestmark = pytest.mark.slow

API_KEY = "rollout-test-key-0123456789"
SERVER_NAME = "rollout-0"
PROMPT = [17, 42, 99, 123, 7, 250, 3, 64]
MAX_TOKENS = 8
LOGPROB_TOL = 2e-3
START_TIMEOUT_S = 900.0  # minutes under load on 2 shared cores; ~30 s when idle


@dataclass
class LiveServer:
    handle: RolloutServerHandle
    root_uri: str
    cache_dir: Path
    thread: threading.Thread
    stop: threading.Event
    start_s: float
    inductor_cache: Path
    """``TORCHINDUCTOR_CACHE_DIR`` the server started with, its own."""
    outcome: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def live(
    aws_env: None, tiny_model_dir: Path, weight_variants: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """One server for the module, started with the store credentials in its environment (it
    reads the store with its own credentials: a weight load carries none)."""
    base = tmp_path_factory.mktemp("rollout-live")
    root_uri = f"file://{base}/run"
    WeightStore(open_root(root_uri)).publish(1, weight_variants[1])
    config = RolloutServerConfig(
        model_dir=tiny_model_dir,
        api_key=API_KEY,
        kv_cache_gib=1,
        max_model_len=512,
        log_path=base / "server.log",
        start_timeout_s=START_TIMEOUT_S,
    )
    component = RolloutComponent(SERVER_NAME, SERVER_NAME, open_root(root_uri), lambda: (config, None, None), base / "server.log")
    policy = RestartPolicy(max_restarts=0, start_timeout_s=START_TIMEOUT_S)
    status = ComponentStatus(SERVER_NAME)
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["outcome"] = supervise(component, stop, policy, status=status)
        except BaseException as exc:  # noqa: BLE001 (the last test checks it)
            outcome["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=run, name="rollout-supervisor", daemon=True)
    with pytest.MonkeyPatch.context() as env:  # the server's environment is taken at its start
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(base / "inductor"))
        thread.start()
        deadline = started + START_TIMEOUT_S + 60
        while not status.ready and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
    if not status.ready:
        stop.set()
        thread.join(60)
        raise RuntimeError(f"rollout server did not start: {outcome.get('error')!r}")
    server = LiveServer(
        component.handle, root_uri, base / "cache", thread, stop, time.monotonic() - started, base / "inductor", outcome
    )
    print(f"\nrollout server healthy after {server.start_s:.1f} s")
    try:
        yield server
    finally:
        stop.set()
        thread.join(120)


def complete(handle: RolloutServerHandle, prompt: list[int] = PROMPT) -> tuple[list[int], list[float]]:
    """Greedy completion of token-id ``prompt``: (token ids, their log-probabilities)."""
    response = httpx.post(
        f"{handle.url}/v1/completions",
        headers=handle.headers(),
        json={
            "model": handle.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


def reference_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[int]]:
    """transformers float32 forward of ``prompt + tokens``: each token's log-probability and
    the greedy (argmax) choice at each position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])  # (1, T)
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (T, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return (
        [float(logprobs[p, t]) for p, t in zip(positions, tokens)],
        [int(logprobs[p].argmax()) for p in positions],
    )


def assert_serves(handle: RolloutServerHandle, model_dir: Path) -> tuple[list[int], list[float]]:
    """The server's greedy tokens and logprobs are those of the weights in ``model_dir``."""
    tokens, logprobs = complete(handle)
    expected, greedy = reference_logprobs(model_dir, PROMPT, tokens)
    assert tokens == greedy
    assert logprobs == pytest.approx(expected, abs=LOGPROB_TOL)
    return tokens, logprobs


def server_tmp_dir(pid: int) -> Path:
    """The server's own temporary directory: ``TMPDIR`` of its process."""
    environ = dict(entry.split(b"=", 1) for entry in process_scan.initial_environ(pid))
    return Path(environ[b"TMPDIR"].decode())


def file_tensor_sha(model_dir: Path, name: str) -> str:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        return tensor_fingerprint(handle.get_tensor(name))


def test_registered_and_completes_token_ids(live: LiveServer, tiny_model_dir: Path) -> None:
    record = read_server(open_root(live.root_uri), SERVER_NAME)
    assert (record.url, record.model, record.pid) == (live.handle.url, live.handle.model, live.handle.pid)
    assert API_KEY not in (Path(live.root_uri.removeprefix("file://")) / "rollout/servers/rollout-0.json").read_text()
    tokens, logprobs = assert_serves(live.handle, tiny_model_dir)
    assert len(tokens) == len(logprobs) == MAX_TOKENS
    assert all(lp <= 0.0 for lp in logprobs)
    assert server_weight_version(live.handle) is None  # vLLM starts at "default"
    # Eager (the default) means nothing compiled, vLLM's sampler helpers for log-probs included:
    # inductor left nothing in the cache directory the server was given.
    assert not live.inductor_cache.exists() or not any(live.inductor_cache.iterdir())


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/pause?mode=abort", None),
        ("POST", "/resume", None),
        ("GET", "/is_paused", None),
        ("POST", "/collective_rpc", {"method": "load_weight_version", "args": []}),
        ("POST", "/update_weight_version", {"new_version": "666"}),
        ("GET", "/weight_info", None),
        ("POST", "/v1/completions", {"model": "x", "prompt": [1, 2], "max_tokens": 1}),
        ("POST", "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
    ],
)
def test_api_key_required_on_every_path_but_health(
    live: LiveServer, method: str, path: str, body: dict[str, Any] | None
) -> None:
    url = f"{live.handle.url}{path}"
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
        response = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, headers, response.text)
    assert httpx.get(f"{live.handle.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{live.handle.url}/is_paused", headers=live.handle.headers(), timeout=30).json() == {
        "is_paused": False
    }
    assert server_weight_version(live.handle) is None  # the refused update did not happen


def test_pause_resume_with_key(live: LiveServer) -> None:
    headers = live.handle.headers()
    assert httpx.post(f"{live.handle.url}/pause?mode=abort", headers=headers, timeout=60).status_code == 200
    assert httpx.get(f"{live.handle.url}/is_paused", headers=headers, timeout=30).json() == {"is_paused": True}
    assert httpx.post(f"{live.handle.url}/resume", headers=headers, timeout=60).status_code == 200
    assert httpx.get(f"{live.handle.url}/is_paused", headers=headers, timeout=30).json() == {"is_paused": False}


def test_load_version_from_local_store_in_place(live: LiveServer, weight_variants: dict[int, Path]) -> None:
    _, before = complete(live.handle)
    report = update_server_weights(live.handle, live.root_uri, None, 1, cache_dir=str(live.cache_dir))
    (worker,) = report.workers
    assert worker.version == 1 and not worker.cached
    assert worker.checksum_tensor == "model.embed_tokens.weight"
    assert worker.file_sha256 == file_tensor_sha(weight_variants[1], worker.checksum_tensor)
    assert worker.model_sha256 == worker.file_sha256
    assert report.prefix_cache_reset
    assert server_weight_version(live.handle) == 1
    # Same prompt as before the load: a stale prefix cache would give version-0 values.
    _, after = assert_serves(live.handle, weight_variants[1])
    assert max(abs(a - b) for a, b in zip(after, before)) > 10 * LOGPROB_TOL
    print(f"\nweight load v1 (local): {report.seconds:.2f} s")


def test_cached_version_is_reused(live: LiveServer, weight_variants: dict[int, Path]) -> None:
    report = update_server_weights(live.handle, live.root_uri, None, 1, cache_dir=str(live.cache_dir))
    assert report.workers[0].cached
    assert server_weight_version(live.handle) == 1
    assert_serves(live.handle, weight_variants[1])


def test_unknown_version_is_a_clear_error_and_server_survives(live: LiveServer, weight_variants: dict[int, Path]) -> None:
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        update_server_weights(live.handle, live.root_uri, None, 7, cache_dir=str(live.cache_dir), timeout_s=60)
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert "weight version 7 is not published" in message
    assert "available complete versions: [1]" in message
    assert httpx.get(f"{live.handle.url}/health", timeout=30).status_code == 200
    assert server_weight_version(live.handle) == 1
    assert_serves(live.handle, weight_variants[1])


def test_load_version_from_seaweedfs(
    live: LiveServer, weight_variants: dict[int, Path], seaweedfs_endpoint: Any
) -> None:
    bucket = s3_servers.create_bucket(seaweedfs_endpoint)
    root_uri = f"s3://{bucket}/run"
    options = s3_servers.storage_options(seaweedfs_endpoint)
    WeightStore(open_root(root_uri, dict(options))).publish(2, weight_variants[2])
    report = update_server_weights(live.handle, root_uri, options, 2, cache_dir=str(live.cache_dir))
    assert report.workers[0].version == 2 and not report.workers[0].cached
    assert report.workers[0].model_sha256 == file_tensor_sha(weight_variants[2], "model.embed_tokens.weight")
    assert server_weight_version(live.handle) == 2
    assert_serves(live.handle, weight_variants[2])
    log = live.handle.log_path.read_text(errors="replace")
    assert options["secret"] not in log
    print(f"\nweight load v2 (SeaweedFS): {report.seconds:.2f} s")


def test_token_in_token_out_generate_reports_weight_version(live: LiveServer) -> None:
    """``/inference/v1/generate`` (``--enable-scale-out``) gives the same greedy tokens and
    log-probabilities as ``/v1/completions``, and the version that sampled them."""
    tokens, logprobs = complete(live.handle)
    version = server_weight_version(live.handle)
    response = httpx.post(
        f"{live.handle.url}/inference/v1/generate",
        headers=live.handle.headers(),
        json={
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0, "ignore_eos": True},
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == tokens
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == pytest.approx(logprobs, abs=1e-5)
    assert choice["weight_versions"] == [{"version": str(version), "start": 0, "end": MAX_TOKENS}]


def test_set_weight_version_round_trips(live: LiveServer) -> None:
    set_server_weight_version(live.handle, 5)
    assert server_weight_version(live.handle) == 5
    set_server_weight_version(live.handle, 2)
    assert server_weight_version(live.handle) == 2


def vdso_mapping(pid: int) -> str:
    """The address range of process ``pid``'s vDSO (``/proc/<pid>/maps``)."""
    (line,) = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if line.endswith("[vdso]")]
    return line.split()[0]


def test_engine_death_is_reported_and_group_is_killed(live: LiveServer) -> None:
    """Kill the engine core: the supervisor (no restarts allowed) raises with the log tail,
    the group, the entry and the server's temporary directory are gone."""
    listing = subprocess.run(
        ["ps", "-o", "pid=,comm=", "-g", str(live.handle.pgid)], capture_output=True, text=True, check=True
    ).stdout
    engine_pids = [int(line.split()[0]) for line in listing.splitlines() if "EngineCor" in line]  # comm is cut to 15 characters
    assert engine_pids, listing
    if vllm_is_cpu_build():  # the model worker runs inside the engine core: no third vLLM process
        assert "Worker" not in listing, listing
        # ... and the engine core is forked from the API server, not spawned: its vDSO is mapped
        # where the API server's is. A spawned one is a new exec, which ASLR maps elsewhere.
        assert Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0"
        vdso = {pid: vdso_mapping(pid) for pid in (live.handle.pid, engine_pids[0])}
        assert vdso[engine_pids[0]] == vdso[live.handle.pid], vdso
    # vLLM's temporary files (its engine's IPC sockets, a rendezvous file) are in the server's own directory.
    tmp_dir = server_tmp_dir(live.handle.pid)
    assert tmp_dir.name.startswith("asyncrl-rollout-tmp-") and any(tmp_dir.iterdir())
    os.kill(engine_pids[0], signal.SIGKILL)
    live.thread.join(180)
    assert not live.thread.is_alive()
    error = live.outcome.get("error")
    assert isinstance(error, ComponentFailed), live.outcome
    assert error.component == SERVER_NAME and error.restarts == 0
    assert "exited with status" in str(error) and error.log_tail
    with pytest.raises(ProcessLookupError):
        os.killpg(live.handle.pgid, 0)
    assert not tmp_dir.exists()  # removed with the server, after a crash too
    assert list_servers(open_root(live.root_uri)) == []
